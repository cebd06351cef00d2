"""xcall's XLA FFI handlers through JAX, against pure jax.numpy references.

Runs on every platform JAX has here ("cpu" always, "gpu" when a CUDA
jaxlib sees a GPU). XCALL_JAX_PLATFORMS (e.g. "cpu,gpu") narrows or
insists on the list: a named platform that is missing fails. The references
below never call xcall: row-id maps are rebuilt with numpy cumsums,
permute/unpermute with jnp scatters and gathers.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xcall.jax as xj


def _platforms():
    wanted = os.environ.get("XCALL_JAX_PLATFORMS")
    have = []
    for p in ("cpu", "gpu"):
        try:
            if jax.devices(p):
                have.append(p)
        except RuntimeError:
            pass
    if not wanted:
        return have
    names = [p.strip() for p in wanted.split(",") if p.strip()]
    missing = [p for p in names if p not in have]
    if missing:
        raise RuntimeError(f"XCALL_JAX_PLATFORMS asks for {missing}; JAX has {have}")
    return names


PLATFORMS = _platforms()


@pytest.fixture(params=PLATFORMS)
def device(request):
    return jax.devices(request.param)[0]


# ---------------------------------------------------------------- references


def ref_row_id_map(routing, num_out_tokens=-1, align=0, capacity=0):
    """(dst [T, E] with -1 for no kept route, tokens_per_expert, offsets,
    row_id_map [T, 2E+1]) by whole-column cumsums."""
    routing = np.asarray(routing).astype(bool)
    t, e = routing.shape
    rank = np.cumsum(routing, axis=0) - 1  # rank of token t within expert e
    counts = routing.sum(axis=0)
    if capacity:
        sizes = np.full(e, capacity)
    elif align:
        sizes = -(-counts // align) * align
    else:
        sizes = counts
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    dst = np.where(routing, offsets[:-1][None, :] + rank, -1)
    if capacity:
        dst = np.where(rank < capacity, dst, -1)
    if num_out_tokens >= 0:
        dst = np.where(dst < num_out_tokens, dst, -1)
    kept = (dst >= 0).sum(axis=0)
    m = np.full((t, 2 * e + 1), -1, np.int32)
    for i in range(t):
        experts = np.flatnonzero(dst[i] >= 0)
        m[i, : len(experts)] = dst[i, experts]
        m[i, e : e + len(experts)] = experts
        m[i, 2 * e] = len(experts)
    return dst, kept.astype(np.int64), offsets.astype(np.int64), m


def ref_permute(x, dst, n, probs=None):
    t, e = dst.shape
    tok, ex = np.nonzero(dst >= 0)
    rows = dst[tok, ex]
    out = jnp.zeros((n, x.shape[1]), x.dtype).at[rows].set(x[tok])
    if probs is None:
        return out, None
    return out, jnp.zeros((n,), jnp.float32).at[rows].set(probs[tok, ex])


def ref_unpermute(y, dst, merging_probs=None):
    valid = jnp.asarray(dst >= 0)
    gathered = y[jnp.asarray(np.maximum(dst, 0))].astype(jnp.float32)  # [T, E, H]
    w = valid.astype(jnp.float32)
    if merging_probs is not None:
        w = w * merging_probs
    return jnp.sum(gathered * w[..., None], axis=1).astype(y.dtype)


def ref_chunk_map(split_sizes, sorted_indices, t):
    split_sizes = np.asarray(split_sizes)
    sorted_indices = np.asarray(sorted_indices)
    starts_in = np.concatenate([[0], np.cumsum(split_sizes)])
    out_sizes = split_sizes[sorted_indices]
    starts_out = np.concatenate([[0], np.cumsum(out_sizes)])
    position = np.empty_like(sorted_indices)
    position[sorted_indices] = np.arange(len(sorted_indices))
    m = np.arange(t, dtype=np.int64)
    for c in range(len(split_sizes)):
        rows = np.arange(starts_in[c], starts_in[c + 1])
        m[rows] = starts_out[position[c]] + (rows - starts_in[c])
    return m


# ---------------------------------------------------------------- data


def top_k_routing(rng, t, e, k):
    logits = rng.standard_normal((t, e))
    top = np.argsort(-logits, axis=1)[:, :k]
    routing = np.zeros((t, e), bool)
    np.put_along_axis(routing, top, True, axis=1)
    return routing


def random_probs(rng, routing):
    p = rng.random(routing.shape).astype(np.float32) + 0.1
    return np.where(routing, p, 0).astype(np.float32)


def on(device, *arrays):
    return [jax.device_put(jnp.asarray(a), device) for a in arrays]


TOL = {jnp.float32: dict(rtol=1e-6, atol=1e-6), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}

# (T, E, H, k, options)
ROW_ID_CASES = [
    (64, 7, 32, 2, {}),
    (96, 16, 16, 5, {}),
    (64, 7, 32, 2, {"num_out_tokens": 77}),
    (80, 8, 24, 2, {"align": 16}),
    (128, 8, 16, 2, {"capacity": 20}),
]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("t,e,h,k,opts", ROW_ID_CASES)
def test_make_row_id_map_matches_reference(device, t, e, h, k, opts):
    rng = np.random.default_rng(t * 31 + e)
    routing = top_k_routing(rng, t, e, k)
    (r,) = on(device, routing)
    m, tpe, off = jax.jit(lambda r: xj.make_row_id_map(r, **opts))(r)
    _, ref_tpe, ref_off, ref_m = ref_row_id_map(routing, **opts)
    np.testing.assert_array_equal(np.asarray(m), ref_m)
    np.testing.assert_array_equal(np.asarray(tpe), ref_tpe)
    np.testing.assert_array_equal(np.asarray(off), ref_off)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,e,h,k,opts", ROW_ID_CASES)
def test_permute_and_unpermute_match_reference(device, dtype, t, e, h, k, opts):
    rng = np.random.default_rng(t + e + h)
    routing = top_k_routing(rng, t, e, k)
    dst, _, off, _ = ref_row_id_map(routing, **opts)
    n = opts.get("num_out_tokens", -1)
    n = int(off[-1]) if n < 0 else n
    n += 3  # rows past every chunk must come back zero
    x = (rng.standard_normal((t, h)) * 3).astype(np.float32)
    probs = random_probs(rng, routing)
    xr, r, p = on(device, jnp.asarray(x, dtype), routing, probs)

    @jax.jit
    def layer(x, r, p):
        m, tpe, offsets = xj.make_row_id_map(r, **opts)
        y, yp = xj.permute(x, m, tpe, offsets, p, num_out_rows=n)
        back = xj.unpermute(y, m, tpe, offsets, p)
        plain = xj.unpermute(y, m, tpe, offsets)
        return y, yp, back, plain

    y, yp, back, plain = layer(xr, r, p)
    ry, ryp = ref_permute(jnp.asarray(x, dtype), dst, n, jnp.asarray(probs))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ry, np.float32))
    np.testing.assert_array_equal(np.asarray(yp), np.asarray(ryp))
    ref_back = ref_unpermute(ry, dst, jnp.asarray(probs))
    ref_plain = ref_unpermute(ry, dst)
    np.testing.assert_allclose(
        np.asarray(back, np.float32), np.asarray(ref_back, np.float32), **TOL[dtype]
    )
    np.testing.assert_allclose(
        np.asarray(plain, np.float32), np.asarray(ref_plain, np.float32), **TOL[dtype]
    )


def test_unpermute_backward_matches_vjp_of_reference(device):
    rng = np.random.default_rng(5)
    t, e, h, k = 48, 6, 40, 2
    routing = top_k_routing(rng, t, e, k)
    dst, tpe, off, m = ref_row_id_map(routing)
    n = int(off[-1])
    y = rng.standard_normal((n, h)).astype(np.float32)
    probs = random_probs(rng, routing)
    g = rng.standard_normal((t, h)).astype(np.float32)
    args = on(device, g, y, m, tpe, off, probs)
    act, pg = jax.jit(xj.unpermute_backward)(*args)
    _, vjp = jax.vjp(lambda y, p: ref_unpermute(y, dst, p), jnp.asarray(y), jnp.asarray(probs))
    ref_act, ref_pg = vjp(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(act), np.asarray(ref_act), rtol=1e-6, atol=1e-6)
    # Only routed (t, e) have a gradient; the rest is 0 in xcall's output.
    np.testing.assert_allclose(
        np.asarray(pg), np.where(routing, np.asarray(ref_pg), 0), rtol=1e-5, atol=1e-5
    )


def test_gradients_of_permute_and_unpermute_match_reference(device):
    rng = np.random.default_rng(9)
    t, e, h, k = 40, 5, 24, 2
    routing = top_k_routing(rng, t, e, k)
    dst, tpe, off, m = ref_row_id_map(routing)
    n = int(off[-1]) + 2
    x = rng.standard_normal((t, h)).astype(np.float32)
    probs = random_probs(rng, routing)
    w = rng.standard_normal((n, h)).astype(np.float32)  # per-row expert weights
    xd, pd, md, tpd, od, wd = on(device, x, probs, m, tpe, off, w)

    def layer(x, p):
        y, yp = xj.permute(x, md, tpd, od, p, num_out_rows=n)
        h_ = jnp.tanh(y * wd) * yp[:, None]
        return jnp.sum(xj.unpermute(h_, md, tpd, od, p) ** 2)

    def ref_layer(x, p):
        y, yp = ref_permute(x, dst, n, p)
        h_ = jnp.tanh(y * jnp.asarray(w)) * yp[:, None]
        return jnp.sum(ref_unpermute(h_, dst, p) ** 2)

    gx, gp = jax.jit(jax.grad(layer, argnums=(0, 1)))(xd, pd)
    rx, rp = jax.grad(ref_layer, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(probs))
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(gp), np.where(routing, np.asarray(rp), 0), rtol=1e-5, atol=1e-5
    )
    # Without probs: permute's backward is unpermute, unpermute's is permute.
    c = rng.standard_normal((t, h)).astype(np.float32)
    (cd,) = on(device, c)

    def plain(x):
        y, _ = xj.permute(x, md, tpd, od, num_out_rows=n)
        return jnp.sum(xj.unpermute(jnp.sin(y), md, tpd, od) * cd)

    def ref_plain(x):
        y, _ = ref_permute(x, dst, n)
        return jnp.sum(ref_unpermute(jnp.sin(y), dst) * jnp.asarray(c))

    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.grad(plain))(xd)),
        np.asarray(jax.grad(ref_plain)(jnp.asarray(x))),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("s,t,h", [(8, 200, 16), (64, 512, 8)])
def test_chunk_sort_matches_reference_with_gradient(device, s, t, h):
    rng = np.random.default_rng(s)
    cuts = np.sort(rng.choice(np.arange(1, t - 5), s - 1, replace=False))
    split = np.diff(np.concatenate([[0], cuts, [t - 5]])).astype(np.int64)  # 5 rows past
    order = rng.permutation(s).astype(np.int64)
    x = rng.standard_normal((t, h)).astype(np.float32)
    probs = rng.random(t).astype(np.float32)
    sd, od, xd, pd = on(device, split, order, x, probs)
    smap = jax.jit(lambda a, b: xj.make_chunk_sort_map(a, b, t))(sd, od)
    ref_map = ref_chunk_map(split, order, t)
    np.testing.assert_array_equal(np.asarray(smap), ref_map)
    out, op = jax.jit(lambda x, m, p: xj.sort_chunks_by_map(x, m, p))(xd, smap, pd)
    ref_out = jnp.zeros_like(x).at[ref_map].set(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(op), np.asarray(jnp.zeros_like(probs).at[ref_map].set(probs)))
    back, _ = xj.sort_chunks_by_map(out, smap, backward=True)
    np.testing.assert_array_equal(np.asarray(back), x)
    c = rng.standard_normal((t, h)).astype(np.float32)
    g = jax.grad(lambda x: jnp.sum(xj.sort_chunks_by_map(x, smap)[0] * c))(xd)
    np.testing.assert_array_equal(np.asarray(g), c[ref_map])


def test_bad_shape_raises_with_xcall_message(device):
    rng = np.random.default_rng(1)
    routing = top_k_routing(rng, 16, 4, 2)
    x, r, p_bad = on(device, rng.standard_normal((16, 8)).astype(np.float32), routing,
                     np.ones((16, 3), np.float32))
    m, tpe, off = xj.make_row_id_map(r)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(
            jax.jit(lambda x, p: xj.permute(x, m, tpe, off, p, num_out_rows=32))(x, p_bad)
        )
    text = str(info.value)
    assert "xcall_permute: probs dim 1 is 3, expected 4 (experts)" in text, text
    assert "XCALL_STATUS_INVALID_ARGUMENT" in text, text
    y, _ = xj.permute(x, m, tpe, off, num_out_rows=32)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(xj.unpermute(y, m, tpe, off, p_bad))
    text = str(info.value)
    assert "xcall_unpermute: merging_probs dim 1 is 3, expected 4 (experts)" in text, text


def test_unknown_attribute_is_refused(device):
    (r,) = on(device, np.ones((1, 4, 2), bool))
    i32 = np.dtype(np.int32)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(
            xj._call(
                "make_row_id_map",
                {"routing": r},
                (xj._row_id_map_results, (i32,)),
                {"row_id_map": None, "tokens_per_expert": i32, "expert_offsets": i32},
                capacityy=4,
            )
        )
    assert 'xcall_make_row_id_map has no attribute "capacityy"' in str(info.value)


def test_no_global_switch_and_int64_where_asked():
    """Without jax_enable_x64 every integer result is int32; with it,
    index_dtype=int64 gives the same values as int64; without it, asking
    for int64 is a clear error."""
    assert not jax.config.jax_enable_x64
    rng = np.random.default_rng(21)
    routing = top_k_routing(rng, 50, 6, 2)
    m, tpe, off = xj.make_row_id_map(jnp.asarray(routing), align=8)
    assert (m.dtype, tpe.dtype, off.dtype) == (jnp.int32,) * 3
    _, ref_tpe, ref_off, ref_m = ref_row_id_map(routing, align=8)
    np.testing.assert_array_equal(np.asarray(tpe), ref_tpe)
    np.testing.assert_array_equal(np.asarray(off), ref_off)
    smap = xj.make_chunk_sort_map(jnp.array([3, 4, 5]), jnp.array([2, 0, 1]), 14)
    assert smap.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(smap), ref_chunk_map([3, 4, 5], [2, 0, 1], 14))
    with pytest.raises(ValueError, match="jax_enable_x64"):
        xj.make_row_id_map(jnp.asarray(routing), index_dtype=jnp.int64)
    jax.config.update("jax_enable_x64", True)
    try:
        m64, tpe64, off64 = xj.make_row_id_map(jnp.asarray(routing), align=8, index_dtype=jnp.int64)
        assert (tpe64.dtype, off64.dtype) == (jnp.int64, jnp.int64)
        np.testing.assert_array_equal(np.asarray(tpe64), ref_tpe)
        np.testing.assert_array_equal(np.asarray(off64), ref_off)
        np.testing.assert_array_equal(np.asarray(m64), ref_m)
        # int64 chunks go to permute as they are; int32 ones as pairs.
        x = jnp.asarray(rng.standard_normal((50, 8)), jnp.float32)
        a, _ = xj.permute(x, m64, tpe64, off64, num_out_rows=int(ref_off[-1]))
        b, _ = xj.permute(x, m64, tpe64.astype(jnp.int32), off64.astype(jnp.int32),
                          num_out_rows=int(ref_off[-1]))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_alias_table_gives_no_aliases():
    for op in xj._OPS:
        assert xj.alias_table(op) == ()


def test_graph_cache_attribute_on_host_is_accepted():
    rng = np.random.default_rng(3)
    routing = top_k_routing(rng, 32, 4, 2)
    a = xj.make_row_id_map(jnp.asarray(routing), graph_cache=True)
    b = xj.make_row_id_map(jnp.asarray(routing))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
