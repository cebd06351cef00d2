"""One process of an expert-parallel JAX program under jax.distributed
(test_xcall_jax_ep_processes.py starts several): a global mesh over every
process's devices, one MoE layer (xcall.jax_ep dispatch, experts scaling
their rows, combine) and its gradient, and the dropped routes; this
process's shards of the results saved to OUT/process-I.npz.

    python jax_ep_worker.py I PROCESSES PORT DEVICES PLATFORM CAPACITY OUT

PLATFORM: cpu (DEVICES virtual CPU devices per process) or cuda (DEVICES
GPUs per process: process I takes GPUs I*DEVICES ..). The layer and its
data come from `layer` and `inputs`, which the parent test also runs in
one process to compare with.
"""

import os
import sys

T, H, K = 12, 16, 3
AXIS = "ep"


def inputs(pes):
    """The global x [P*T, H] f32, ids, probs of every process (one seed)."""
    import numpy as np

    rng = np.random.default_rng(2026)
    e = 2 * pes
    x = rng.standard_normal((pes * T, H)).astype(np.float32)
    ids = np.stack([rng.choice(e, K, replace=False) for _ in range(pes * T)]).astype(np.int32)
    ids[::4, -1] = -1
    probs = rng.uniform(0.1, 1.0, (pes * T, K)).astype(np.float32)
    w = rng.standard_normal((pes * T, H)).astype(np.float32)
    return x, ids, probs, w, e


def layer(mesh, e, capacity):
    """(y, the gradient of sum(y * w) in x and in probs), jitted over
    `mesh`: experts scale their rows by their global index + 1."""
    import jax
    import jax.numpy as jnp
    import xcall.jax_ep as xe
    from jax.sharding import PartitionSpec as P

    pes = mesh.devices.size

    def body(x, ids, probs):
        d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e, capacity=capacity,
                           axis_name=AXIS)
        rank = jax.lax.axis_index(AXIS)
        ex = d.row_experts()
        scale = (rank * (e // pes) + ex + 1).astype(d.rows.dtype)
        rows = jnp.where(ex[:, None] >= 0, d.rows * scale[:, None], 0).astype(d.rows.dtype)
        return xe.ep_combine(rows, d)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))

    def loss(x, ids, probs, w):
        return jnp.sum(f(x, ids, probs) * w)

    return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 2)))


def main():
    me, processes, port, per, platform, capacity, out = sys.argv[1:8]
    me, processes, per, capacity = int(me), int(processes), int(per), int(capacity)
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("XCALL_TEST_INSTALLED") != "1":
        sys.path.insert(0, os.path.dirname(here))
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per}"
    import jax
    import numpy as np
    import xcall.jax_ep as xe
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    # The program has no XLA collective: CPU processes need no collectives
    # backend.
    local = None if platform == "cpu" else list(range(me * per, (me + 1) * per))
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=processes, process_id=me,
                               local_device_ids=local)
    devices = jax.devices()
    pes = len(devices)
    assert pes == processes * per, (devices, processes, per)
    mesh = Mesh(np.array(devices), (AXIS,))
    x, ids, probs, w, e = inputs(pes)
    sharding = NamedSharding(mesh, P(AXIS))

    def put(a):
        return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

    f, g = layer(mesh, e, capacity)
    y = f(put(x), put(ids), put(probs))
    gx, gp = g(put(x), put(ids), put(probs), put(w))
    group = next(iter(xe._groups.values()))
    saved = {"dropped": np.array(group.dropped_routes(), np.int64),
             "ranks": np.array(group.local_ranks, np.int64)}
    for name, a in (("y", y), ("gx", gx), ("gp", gp)):
        for s in a.addressable_shards:
            saved[f"{name}@{s.index[0].start}"] = np.asarray(s.data)
    np.savez(os.path.join(out, f"process-{me}.npz"), **saved)
    xe.ep_close_all()
    jax.distributed.shutdown()
    print(f"process {me}: ok", flush=True)


if __name__ == "__main__":
    main()
