"""CUDA-only checks of the XLA FFI handlers: the graph_cache attribute under
XLA command buffers on and off, and one executable over two GPUs (pmap and
shard_map) where every device must capture and replay its own graphs.

XCALL_XLA_COMMAND_BUFFERS says how XLA_FLAGS set command buffers for this
process: "on" (custom calls recorded into XLA's command buffers), "off",
or unset (the checks that depend on it are skipped). XCALL_JAX_REPORT
names a file the observed cache counters are appended to. Skips without a
GPU unless XCALL_REQUIRE_CUDA=1.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_xcall_jax import ref_permute, ref_row_id_map, ref_unpermute, top_k_routing

import xcall.jax as xj


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _flag(name):
    """Boolean variable `name` as xcall spells booleans (docs/ENVIRONMENT.md)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise RuntimeError(f"{name}={value!r} is not a boolean: 1, 0, true, false, yes, no, on or off")


GPUS = _gpus()
MODE = os.environ.get("XCALL_XLA_COMMAND_BUFFERS")

if not GPUS:
    if _flag("XCALL_REQUIRE_CUDA"):
        raise RuntimeError("XCALL_REQUIRE_CUDA=1 but JAX sees no GPU")
    pytest.skip("no GPU visible to JAX: CUDA handler tests skipped", allow_module_level=True)


def report(name, value):
    path = os.environ.get("XCALL_JAX_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, "mode": MODE, **value}) + "\n")


def ordinal(d):
    return d.local_hardware_id if d.local_hardware_id is not None else d.id


def delta(before, after):
    return {k: after[k] - before[k] for k in after}


T, E, H, K = 256, 8, 128, 2
N = T * K


def case(seed):
    rng = np.random.default_rng(seed)
    routing = top_k_routing(rng, T, E, K)
    x = rng.standard_normal((T, H)).astype(np.float32)
    p = np.where(routing, rng.random((T, E)) + 0.1, 0).astype(np.float32)
    dst, _, _, _ = ref_row_id_map(routing)
    y, _ = ref_permute(jnp.asarray(x), dst, N, jnp.asarray(p))
    return routing, x, p, np.asarray(ref_unpermute(y, dst, jnp.asarray(p)))


def layer(r, x, p):
    m, tpe, off = xj.make_row_id_map(r, graph_cache=True)
    y, _ = xj.permute(x, m, tpe, off, p, num_out_rows=N, graph_cache=True)
    return xj.unpermute(jnp.tanh(y), m, tpe, off, p, graph_cache=True)


def expected(routing, x, p):
    dst, _, _, _ = ref_row_id_map(routing)
    y, _ = ref_permute(jnp.asarray(x), dst, N)
    return np.asarray(ref_unpermute(jnp.tanh(y), dst, jnp.asarray(p)))


def test_graph_cache_under_xla_command_buffers():
    d = GPUS[0]
    routing, x, p, _ = case(11)
    args = [jax.device_put(jnp.asarray(a), d) for a in (routing, x, p)]
    f = jax.jit(layer)
    before = xj.graph_stats(ordinal(d))
    for _ in range(3):
        out = jax.block_until_ready(f(*args))
        np.testing.assert_allclose(np.asarray(out), expected(routing, x, p), rtol=1e-5, atol=1e-5)
    seen = delta(before, xj.graph_stats(ordinal(d)))
    report("command_buffers", seen)
    calls = 3 * 3
    handled = seen["hits"] + seen["captures"] + seen["patches"] + seen["eager_caller_capturing"]
    assert handled + seen["eager_capture_failed"] >= 1, seen
    if MODE == "off":
        # xcall's cache captured every op (or, when XLA handed it new
        # buffer addresses, captured again or patched the pointers of its
        # graph) and replayed the rest; nothing ran eagerly.
        fresh = seen["captures"] + seen["patches"]
        assert fresh >= 3 and fresh + seen["hits"] == calls, seen
    elif MODE == "on":
        # XLA recorded the calls into its command buffers: xcall saw the
        # stream capturing and put its work into XLA's capture.
        assert seen["eager_caller_capturing"] >= 1, seen


@pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("how", ["pmap", "shard_map"])
def test_two_gpus_run_their_own_graphs(how):
    devices = GPUS[:2]
    cases = [case(100 + i) for i in range(2)]
    stacked = [np.stack([c[j] for c in cases]) for j in range(3)]
    if how == "pmap":
        f = jax.pmap(layer, devices=devices)
        args = stacked
    else:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        mesh = Mesh(np.array(devices), ("d",))
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:
            from jax.experimental.shard_map import shard_map

        def per_device(r, x, p):
            return layer(r[0], x[0], p[0])[None]

        f = jax.jit(
            shard_map(per_device, mesh=mesh, in_specs=(P("d"),) * 3, out_specs=P("d"))
        )
        args = [jax.device_put(a, NamedSharding(mesh, P("d"))) for a in stacked]
    before = [xj.graph_stats(ordinal(d)) for d in devices]
    for _ in range(3):
        out = np.asarray(jax.block_until_ready(f(*args)))
        for i, c in enumerate(cases):
            np.testing.assert_allclose(out[i], expected(*c[:3]), rtol=1e-5, atol=1e-5)
    seen = [delta(b, xj.graph_stats(ordinal(d))) for b, d in zip(before, devices)]
    report(f"two_gpus_{how}", {f"gpu{ordinal(d)}": s for d, s in zip(devices, seen)})
    if MODE == "off":
        for d, s in zip(devices, seen):
            # Every call of this test was answered from the device's own
            # graphs (captured or patched now, or by an earlier test with
            # the same buffers): nothing ran eagerly, and the results above
            # say no device ran another device's graph.
            assert s["captures"] + s["patches"] + s["hits"] == 9, seen
            total = xj.graph_stats(ordinal(d))
            assert total["captures"] >= 3 and total["entries"] >= 3, total


@pytest.mark.parametrize("axes", ["auto", "explicit-set-mesh"])
def test_token_sharded_layer_over_every_gpu(axes):
    """token_dispatch/token_combine with the tokens sharded over every GPU
    (num_groups = GPUs): no collective in the compiled HLO, every GPU
    holds its block, and the values equal the same grouped layer on one
    GPU and the jnp reference of each block."""
    import contextlib

    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    n = len(GPUS)
    kind = AxisType.Auto if axes == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((n,), ("d",), devices=GPUS, axis_types=(kind,))
    context = jax.sharding.set_mesh(mesh) if axes != "auto" else contextlib.nullcontext()
    rng = np.random.default_rng(29)
    t = 512 * n
    ids = np.argsort(-rng.standard_normal((t, E)), axis=1)[:, :K].astype(np.int32)
    pk = (rng.random((t, K)) + 0.1).astype(np.float32)
    x = rng.standard_normal((t, H)).astype(np.float32)

    def moe(x, ids, pk):
        d = xj.token_dispatch(x, ids, pk, num_experts=E, num_groups=n, graph_cache=True)
        y = jnp.tanh(d.permuted)
        return d.permuted, xj.token_combine(y, d.row_id_map, pk, routing=ids, num_groups=n)

    sharded = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("d"))) for a in (x, ids, pk)]
    with context:
        compiled = jax.jit(moe).lower(*sharded).compile()
        text = compiled.as_text()
        for c in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
            assert c not in text, f"{c} in the token-sharded layer's HLO"
        permuted, out = compiled(*sharded)
    assert {s.device for s in out.addressable_shards} == set(GPUS)
    one = [jax.device_put(jnp.asarray(a), GPUS[0]) for a in (x, ids, pk)]
    ref_permuted, ref_out = jax.jit(moe)(*one)
    np.testing.assert_array_equal(np.asarray(permuted), np.asarray(ref_permuted))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    # Each block against the reference: combine(tanh(dispatch(x))) sums
    # tanh(x) weighted by the block's top-k probs.
    want = np.tanh(x) * pk.sum(axis=1)[:, None]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    report("token_sharded_layer", {"gpus": n, "axes": axes})
