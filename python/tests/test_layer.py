"""token_dispatch / token_combine against references that never call
xcall (cumsum row-id maps, jnp scatters and gathers), in both routing
forms, [T, H] and [B, S, H] inputs, align, capacity, groups, gradients,
vmap, and sharded over four CPU devices with no collective in the HLO."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from test_xcall_jax import ref_permute, ref_row_id_map, ref_unpermute

import xcall.jax as xj

AUTO = jax.sharding.AxisType.Auto

T, E, H, K = 96, 8, 16, 2


def case(seed, t=T, e=E, k=K):
    """Top-k ids [t, k] (distinct per token), the same routing as a map,
    top-k probs [t, k] and the dense probs [t, e]."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k].astype(np.int32)
    routing = np.zeros((t, e), bool)
    np.put_along_axis(routing, ids, True, axis=1)
    pk = (rng.random((t, k)) + 0.1).astype(np.float32)
    dense = np.zeros((t, e), np.float32)
    np.put_along_axis(dense, ids, pk, axis=1)
    x = (rng.standard_normal((t, H)) * 2).astype(np.float32)
    return ids, routing, pk, dense, x


def reference(x, routing, dense, groups, rows, opts):
    """Per group: the reference map, permute into `rows` rows, and the
    chunk sizes; then the groups side by side."""
    ys, yps, sizes, dsts = [], [], [], []
    for xg, rg, pg in zip(*(np.split(a, groups) for a in (x, routing, dense))):
        dst, _, off, _ = ref_row_id_map(rg, **opts)
        y, yp = ref_permute(jnp.asarray(xg), dst, rows, jnp.asarray(pg))
        ys.append(np.asarray(y))
        yps.append(np.asarray(yp))
        sizes.append(np.diff(off))
        dsts.append(dst)
    return np.concatenate(ys), np.concatenate(yps), np.stack(sizes), dsts


def combine_reference(y, dsts, dense, groups):
    yg = np.split(np.asarray(y), groups)
    pg = np.split(dense, groups)
    return np.concatenate(
        [np.asarray(ref_unpermute(jnp.asarray(a), d, jnp.asarray(p))) for a, d, p in zip(yg, dsts, pg)]
    )


@pytest.mark.parametrize("form", ["ids", "map"])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("opts", [{}, {"align": 8}, {"capacity": 10}])
@pytest.mark.parametrize("groups", [1, 4])
def test_dispatch_and_combine_match_reference(form, batched, opts, groups):
    ids, routing, pk, dense, x = case(len(opts) * 7 + groups)
    tg = T // groups
    if "capacity" in opts:
        rows = E * opts["capacity"]
        kw = {"capacity": opts["capacity"]}
    else:
        rows = tg * K + (E * (opts["align"] - 1) if "align" in opts else 0)
        kw = dict(opts)
    if form == "ids":
        routing_in, probs_in, extra = ids, pk, {"num_experts": E}
    else:
        routing_in, probs_in, extra = routing, dense, {}
        if "capacity" not in opts:
            extra["num_out_tokens"] = tg * K
    shape = (4, T // 4) if batched else (T,)
    xin = x.reshape(shape + (H,))
    rin = routing_in.reshape(shape + routing_in.shape[1:])
    pin = probs_in.reshape(shape + probs_in.shape[1:])

    @jax.jit
    def layer(x, r, p):
        d = xj.token_dispatch(x, r, p, num_groups=groups, **kw, **extra)
        out = xj.token_combine(
            jnp.tanh(d.permuted), d.row_id_map, p,
            routing=r if form == "ids" else None, num_groups=groups, **kw,
        )
        return d, out

    d, out = layer(jnp.asarray(xin), jnp.asarray(rin), jnp.asarray(pin))
    ry, ryp, sizes, dsts = reference(x, routing, dense, groups, rows, opts)
    assert d.permuted.shape == (groups * rows, H)
    np.testing.assert_array_equal(np.asarray(d.permuted), ry)
    np.testing.assert_array_equal(np.asarray(d.permuted_probs), ryp)
    assert d.tokens_per_expert.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(d.tokens_per_expert), sizes[0] if groups == 1 else sizes)
    assert out.shape == xin.shape
    ref_out = combine_reference(np.tanh(ry), dsts, dense, groups)
    np.testing.assert_allclose(np.asarray(out).reshape(T, H), ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["ids", "map"])
def test_layer_gradients_match_reference(form):
    ids, routing, pk, dense, x = case(31)
    groups = 2
    rows = T // groups * K
    w = np.random.default_rng(3).standard_normal((groups * rows, H)).astype(np.float32)
    if form == "ids":
        r, p, extra, comb = jnp.asarray(ids), jnp.asarray(pk), {"num_experts": E}, {"routing": jnp.asarray(ids)}
    else:
        r, p, extra, comb = jnp.asarray(routing), jnp.asarray(dense), {"num_out_tokens": rows}, {}

    def layer(x, p):
        d = xj.token_dispatch(x, r, p, num_groups=groups, **extra)
        h = jnp.sin(d.permuted * w) * d.permuted_probs[:, None]
        return jnp.sum(xj.token_combine(h, d.row_id_map, p, num_groups=groups, **comb) ** 2)

    dsts = [ref_row_id_map(g)[0] for g in np.split(routing, groups)]

    def ref_layer(x, p):
        pd = p if form == "map" else jnp.zeros((T, E)).at[jnp.arange(T)[:, None], ids].set(p)
        outs = []
        for i, dst in enumerate(dsts):
            sl = slice(i * T // groups, (i + 1) * T // groups)
            y, yp = ref_permute(x[sl], dst, rows, pd[sl])
            h = jnp.sin(y * w[i * rows:(i + 1) * rows]) * yp[:, None]
            outs.append(ref_unpermute(h, dst, pd[sl]))
        return jnp.sum(jnp.concatenate(outs) ** 2)

    gx, gp = jax.jit(jax.grad(layer, argnums=(0, 1)))(jnp.asarray(x), p)
    rx, rp = jax.grad(ref_layer, argnums=(0, 1))(jnp.asarray(x), p)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-4, atol=1e-4)
    mask = routing if form == "map" else np.ones_like(pk, bool)
    np.testing.assert_allclose(np.asarray(gp), np.where(mask, np.asarray(rp), 0), rtol=1e-4, atol=1e-4)


def test_vmap_over_a_batch_of_layers():
    ids, _, pk, _, x = case(5)
    xs = jnp.stack([jnp.asarray(x) * (i + 1) for i in range(3)])

    def one(x):
        return xj.token_dispatch(x, ids, pk, num_experts=E).permuted

    got = jax.jit(jax.vmap(one))(xs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(one(xs[i])))


def test_bad_layer_arguments_are_clear_errors():
    ids, routing, pk, dense, x = case(8)
    with pytest.raises(ValueError, match="num_out_tokens"):
        xj.token_dispatch(x, routing, dense)
    with pytest.raises(ValueError, match="multiple of num_groups=5"):
        xj.token_dispatch(x, ids, pk, num_experts=E, num_groups=5)
    with pytest.raises(ValueError, match="probs has shape"):
        xj.token_dispatch(x, ids, dense, num_experts=E)
    with pytest.raises(ValueError, match="2 or 3 dims"):
        xj.token_dispatch(x[None, None], ids, pk, num_experts=E)
    with pytest.raises(TypeError, match="integers"):
        xj.token_dispatch(x, ids.astype(np.float32), pk, num_experts=E)
    with pytest.raises(ValueError, match="capacity fixes the rows"):
        xj.token_dispatch(x, ids, pk, num_experts=E, capacity=4, num_out_tokens=10)
    with pytest.raises(ValueError, match="int32 or int64"):
        xj.make_row_id_map(jnp.asarray(routing), index_dtype=jnp.float32)


COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def collectives(compiled):
    text = compiled.as_text()
    return [c for c in COLLECTIVES if c in text]


AXES = ["auto", "explicit", "explicit-set-mesh"]


@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices (conftest sets XLA_FLAGS)")
@pytest.mark.parametrize("axes", AXES)
def test_token_sharded_layer_runs_locally_and_matches_unsharded(axes):
    kind = AUTO if axes == "auto" else jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices("cpu")[:4], axis_types=(kind,))
    ids, _, pk, dense, x = case(13)
    context = jax.sharding.set_mesh(mesh) if axes == "explicit-set-mesh" else contextlib.nullcontext()

    def layer(x, ids, pk):
        d = xj.token_dispatch(x, ids, pk, num_experts=E, num_groups=4)
        y = jnp.tanh(d.permuted)
        return d.permuted, xj.token_combine(y, d.row_id_map, pk, routing=ids, num_groups=4)

    rows = NamedSharding(mesh, P("d"))
    args = [jax.device_put(jnp.asarray(a), rows) for a in (x, ids, pk)]
    cpu = jax.devices("cpu")[0]
    # The references run on one CPU device: the same platform as the mesh
    # (a GPU's tanh differs from the CPU's in the last bits).
    with context, jax.default_device(cpu):
        compiled = jax.jit(layer).lower(*args).compile()
        assert collectives(compiled) == [], compiled.as_text()[:4000]
        permuted, out = compiled(*args)
        # The gradient runs locally too.
        grad = jax.jit(jax.grad(lambda x, i, p: jnp.sum(layer(x, i, p)[1] ** 2), argnums=(0, 2)))
        grad_compiled = grad.lower(*args).compile()
        assert collectives(grad_compiled) == [], grad_compiled.as_text()[:4000]
        gx, gp = grad_compiled(*args)
    assert permuted.sharding.spec[0] == "d" and out.sharding.spec[0] == "d"
    assert gx.sharding.spec[0] == "d"
    one_device = [jax.device_put(jnp.asarray(a), cpu) for a in (x, ids, pk)]
    rgx, rgp = grad(*one_device)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rgx), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gp), np.asarray(rgp), rtol=1e-6, atol=1e-6)
    ref_permuted, ref_out = jax.jit(layer)(*one_device)
    np.testing.assert_array_equal(np.asarray(permuted), np.asarray(ref_permuted))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    # Against the one-group layer: the same tokens, the same result.
    one = jax.jit(lambda x, i, p: xj.token_combine(
        jnp.tanh(xj.token_dispatch(x, i, p, num_experts=E).permuted),
        xj.token_dispatch(x, i, p, num_experts=E).row_id_map, p, routing=i))(*one_device)
    np.testing.assert_allclose(np.asarray(out), np.asarray(one), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices (conftest sets XLA_FLAGS)")
def test_hidden_sharded_ops_run_locally():
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices("cpu")[:4], axis_types=(AUTO,))
    _, routing, _, dense, x = case(17)
    m, tpe, off = xj.make_row_id_map(jnp.asarray(routing))
    n = T * K

    def ops(x, p):
        y, yp = xj.permute(x, m, tpe, off, p, num_out_rows=n)
        return y, xj.unpermute(y * 2, m, tpe, off, p)

    cols = NamedSharding(mesh, P(None, "d"))
    args = (jax.device_put(jnp.asarray(x), cols), jax.device_put(jnp.asarray(dense), NamedSharding(mesh, P())))
    compiled = jax.jit(ops).lower(*args).compile()
    assert collectives(compiled) == [], compiled.as_text()[:4000]
    y, back = compiled(*args)
    assert y.sharding.spec[1] == "d"
    ry, rback = jax.jit(ops)(jnp.asarray(x), jnp.asarray(dense))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ry))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(rback))
