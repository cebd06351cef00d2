"""Times one expert-parallel MoE layer step in one process over all its
GPUs: xcall's ep_dispatch / ep_combine beside the same layer in plain JAX,
with jax.lax.ragged_all_to_all and GShard-style with a capacity and
jax.lax.all_to_all.

    XCALL_LIB=.../libxcall.so python3 python/bench_xcall_jax_ep.py \\
        [--tokens 4096 --hidden 7168 --experts 256 --topk 8] [--platform gpu] [--check]

The layer: each device's T tokens [T, H] bf16, routed top-k over E
experts (uniformly at random, distinct per token), E / P on each device;
expert e computes silu(x) * scale_e; each token gets the sum of its
experts' outputs weighted by its probs. Each figure is the median over 7
repetitions of 20 back-to-back steps of one jitted function, ended by
block_until_ready (wall clock per step). --check first runs the three
layers on the same data and compares them (the capacity layer with no
route dropped); it also runs on CPU devices (--platform cpu, with
XLA_FLAGS=--xla_force_host_platform_device_count=N and small sizes).

--processes N runs the xcall layers alone over N processes of this host
under jax.distributed, process i on GPU i (process 0 prints): the way a
program with a process per GPU runs them.
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import xcall.jax as xj  # noqa: E402

AXIS = "ep"


def timed(f, *args, reps=7, calls=20):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def experts(rows, expert, scale):
    """silu(rows) * scale[expert], per row (expert: global ids)."""
    return (jax.nn.silu(rows.astype(jnp.float32)) * scale[expert][:, None]).astype(rows.dtype)


def pallas_experts(rows, local_expert, scale, interpret=False):
    """silu(rows) * scale[expert] as one Pallas kernel over blocks of rows,
    skipping the blocks no route filled (local_expert >= 0, read on the
    device: dispatch packs the filled rows first within each expert's
    group, so the unused tail is whole blocks); rows left unfilled inside a
    block get values combine never reads."""
    from jax.experimental import pallas as pl

    n, h = rows.shape
    width = next(b for b in (1024, 512, 256, 128, h) if h % b == 0)
    block = next(r for r in (16, 8, 4, 2, 1) if n % r == 0)
    row_scale = scale[jnp.maximum(local_expert, 0)]

    def kernel(e_ref, s_ref, x_ref, o_ref):
        @pl.when(jnp.max(e_ref[...]) >= 0)
        def _():
            x = x_ref[...].astype(jnp.float32)
            o_ref[...] = (x / (1.0 + jnp.exp(-x)) * s_ref[...][:, None]).astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=(n // block, h // width),
        in_specs=[
            pl.BlockSpec((block,), lambda i, j: (i,)),
            pl.BlockSpec((block,), lambda i, j: (i,)),
            pl.BlockSpec((block, width), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((block, width), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        interpret=interpret,
    )(local_expert, row_scale, rows)


def xcall_layer(mesh, e, pes, capacity=0, pallas=False, interpret=False):
    local = e // pes

    def body(x, ids, probs, scale):
        d = xj.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e, capacity=capacity,
                           zero_unused=False)
        ex = d.row_experts()
        first = jax.lax.axis_index(AXIS) * local
        if pallas:
            mine = jax.lax.dynamic_slice_in_dim(scale, first, local)
            return xj.ep_combine(pallas_experts(d.rows, ex, mine, interpret), d)
        glob = first + jnp.maximum(ex, 0)
        # Rows past the counts are never read by combine.
        return xj.ep_combine(experts(d.rows, glob, scale), d)

    return body


def ragged_layer(mesh, e, pes):
    """Routes sorted by destination device, exchanged with
    ragged_all_to_all (and their expert ids with them), computed, sent
    back the same way, unsorted and summed."""
    local = e // pes

    def body(x, ids, probs, scale):
        t, k = ids.shape
        flat = ids.reshape(-1)
        dest = flat // local
        order = jnp.argsort(dest, stable=True)
        send = x[order // k]
        send_e = flat[order][:, None]
        sizes = jnp.bincount(dest, length=pes).astype(jnp.int32)
        every = jax.lax.all_gather(sizes, AXIS)              # [sender, receiver]
        me = jax.lax.axis_index(AXIS)
        in_off = jnp.cumsum(sizes) - sizes
        out_off = (jnp.cumsum(every, axis=0) - every)[me]     # where mine land at each receiver
        recv_sizes = every[:, me]
        recv_off = jnp.cumsum(recv_sizes) - recv_sizes
        rows = pes * t * k
        recv = jax.lax.ragged_all_to_all(send, jnp.zeros((rows,) + x.shape[1:], x.dtype), in_off,
                                         sizes, out_off, recv_sizes, axis_name=AXIS)
        recv_e = jax.lax.ragged_all_to_all(send_e, jnp.zeros((rows, 1), jnp.int32), in_off, sizes,
                                           out_off, recv_sizes, axis_name=AXIS)
        h = experts(recv, jnp.clip(recv_e[:, 0], 0, e - 1), scale)
        # Back: each sender's chunk to where it came from.
        back_off = (jnp.cumsum(every, axis=1) - every)[:, me]
        back = jax.lax.ragged_all_to_all(h, jnp.zeros((t * k,) + x.shape[1:], x.dtype), recv_off,
                                         recv_sizes, back_off, sizes, axis_name=AXIS)
        routes = jnp.zeros_like(back).at[order].set(back).reshape(t, k, -1)
        return jnp.sum(routes.astype(jnp.float32) * probs[:, :, None], axis=1).astype(x.dtype)

    return body


def capacity_layer(mesh, e, pes, capacity):
    """GShard: each device's routes into [E, C] slots (routes past C
    dropped), all_to_all to the experts' devices and back, then a
    weighted gather."""
    local = e // pes

    def body(x, ids, probs, scale):
        t, k = ids.shape
        flat = ids.reshape(-1)
        onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)
        pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)   # rank within its expert
        slot = jnp.where(pos < capacity, flat * capacity + pos, e * capacity)
        tok = jnp.arange(t * k) // k
        buf = jnp.zeros((e * capacity,) + x.shape[1:], x.dtype).at[slot].set(x[tok], mode="drop")
        buf = buf.reshape(pes, local * capacity, -1)
        got = jax.lax.all_to_all(buf, AXIS, 0, 0, tiled=True)            # [sender, L*C, H]
        me = jax.lax.axis_index(AXIS)
        expert = me * local + (jnp.arange(local * capacity) // capacity)
        h = experts(got.reshape(pes * local * capacity, -1), jnp.tile(expert, pes), scale)
        back = jax.lax.all_to_all(h.reshape(pes, local * capacity, -1), AXIS, 0, 0, tiled=True)
        back = back.reshape(e * capacity, -1)
        picked = jnp.where((pos < capacity)[:, None], back[jnp.minimum(slot, e * capacity - 1)], 0)
        w = probs.reshape(-1, 1)
        return jnp.sum((picked.astype(jnp.float32) * w).reshape(t, k, -1), axis=1).astype(x.dtype)

    return body


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--platform", default="gpu")
    ap.add_argument("--tokens", type=int, default=4096, help="per device")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--xcall-capacity-factor", type=float, default=0.0,
                    help="0: dropless (the experts' op runs over the worst-case rows); "
                    "else a capacity per expert of this times the mean routes")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--pallas-experts", action="store_true",
                    help="also time the xcall layer with its experts as one Pallas kernel over "
                    "the filled rows (interpreted on CPU)")
    ap.add_argument("--processes", type=int, default=1,
                    help="run the xcall layers over this many processes (jax.distributed)")
    ap.add_argument("--process-id", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.processes > 1 and a.process_id < 0:
        return spawn(a.processes)
    if a.process_id >= 0:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                                   num_processes=a.processes, process_id=a.process_id,
                                   local_device_ids=[a.process_id])
    devices = jax.devices(a.platform)
    pes = len(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    t, h, e, k = a.tokens, a.hidden, a.experts, a.topk
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((pes * t, e)), axis=1)[:, :k].astype(np.int32)
    probs = rng.uniform(0.0, 1.0, (pes * t, k)).astype(np.float32)
    x = np.asarray(jnp.asarray(rng.standard_normal((pes * t, h)), jnp.bfloat16))
    scale = np.linspace(0.5, 1.5, e).astype(np.float32)

    def put(v, spec):
        # Each process builds its own devices' shards (all of them in one).
        return jax.make_array_from_callback(v.shape, jax.sharding.NamedSharding(mesh, spec),
                                            lambda i: v[i])

    x, ids_d, probs_d = (put(v, P(AXIS)) for v in (x, ids, probs))
    scale = put(scale, P())
    cap = int(np.ceil(t * k / e * a.capacity_factor))

    def jit(body, check_vma=True):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3 + (P(),),
                                     out_specs=P(AXIS), check_vma=check_vma))

    xcap = int(np.ceil(pes * t * k / e * a.xcall_capacity_factor))
    xname = "xcall ep_dispatch/ep_combine" + (f", capacity {xcap}" if xcap else "")
    interpret = a.platform == "cpu"
    pallas = [(xname + ", Pallas experts",
               jit(xcall_layer(mesh, e, pes, xcap, pallas=True, interpret=interpret),
                   check_vma=False))]
    layers = [
        (xname, jit(xcall_layer(mesh, e, pes, xcap))),
        *(pallas if a.pallas_experts else []),
        ("jax ragged_all_to_all", jit(ragged_layer(mesh, e, pes))),
        (f"jax all_to_all, capacity {cap}", jit(capacity_layer(mesh, e, pes, cap))),
    ]
    if a.process_id >= 0:
        layers = [layer for layer in layers if layer[0].startswith("xcall")]
    if a.check:
        every = jit(capacity_layer(mesh, e, pes, t * k))   # no route dropped
        want = np.asarray(every(x, ids_d, probs_d, scale), np.float32)
        dropless = [("xcall ep_dispatch/ep_combine", jit(xcall_layer(mesh, e, pes)))]
        if a.pallas_experts:
            dropless.append(("xcall, Pallas experts", jit(xcall_layer(
                mesh, e, pes, pallas=True, interpret=interpret), check_vma=False)))
        ragged = [layer for layer in layers if layer[0] == "jax ragged_all_to_all"]
        for name, f in dropless + ragged:
            try:
                got = np.asarray(f(x, ids_d, probs_d, scale), np.float32)
            except jax.errors.JaxRuntimeError as err:
                print(f"check: {name} does not run here: {str(err).splitlines()[0]}")
                continue
            np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2, err_msg=name)
            print(f"check: {name} agrees with the capacity layer (nothing dropped)")
    bytes_moved = t * k * h * 2 * 2  # each route's row out and back, bf16
    quiet = a.process_id > 0
    where = f", {a.processes} processes (jax.distributed)" if a.process_id >= 0 else ""
    if not quiet:
        print(f"{pes} x {devices[0].device_kind}{where}, T={t} per device, H={h}, E={e}, "
              f"top-{k}, bf16")
    base = None
    for name, f in layers:
        try:
            s = timed(f, x, ids_d, probs_d, scale)
        except jax.errors.JaxRuntimeError as err:
            print(f"{name:36s} does not run here: {str(err).splitlines()[0]}")
            continue
        base = base or s
        if not quiet:
            print(f"{name:36s} {s * 1e3:9.3f} ms  {bytes_moved / s / 2**30:8.1f} GiB/s per "
                  f"device  {s / base:6.2f}x xcall", flush=True)


def spawn(processes):
    """Runs this bench in `processes` processes (the same arguments, each
    told its id) and waits for them; process 0 prints."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, *sys.argv, "--process-id", str(i), "--port",
                               str(port)], env=env) for i in range(processes)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"bench processes exited {codes}")


if __name__ == "__main__":
    main()
