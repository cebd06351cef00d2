"""Times xcall's permute and unpermute through XLA FFI under jax.jit against
jax.numpy equivalents and a plain copy of the same bytes, in one process.

    XCALL_LIB=.../libxcall.so python3 python/bench_xcall_jax.py [--platform gpu]

Each figure is the median over 7 repetitions of 50 back-to-back calls of
one jitted function, ended by block_until_ready (wall clock per call). The
row for a jnp equivalent is what XLA makes of the same data movement; the
copy row (y = x + 0 over the output's bytes) is the yardstick every ratio
refers to.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import xcall.jax as xj  # noqa: E402


def timed(f, *args, reps=7, calls=50):
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--platform", default="gpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2)
    a = ap.parse_args()
    dev = jax.devices(a.platform)[0]
    t, e, h, k = a.tokens, a.experts, a.hidden, a.topk
    rng = np.random.default_rng(0)
    top = np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k]
    routing = np.zeros((t, e), bool)
    np.put_along_axis(routing, top, True, axis=1)
    probs = np.where(routing, rng.random((t, e)), 0).astype(np.float32)
    x = jax.device_put(jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16), dev)
    r, p = (jax.device_put(jnp.asarray(v), dev) for v in (routing, probs))
    n = t * k
    m, tpe, off = xj.make_row_id_map(r)
    # The gather form of permute for jnp: source token of every output row.
    src = np.zeros(n, np.int32)
    dst = np.asarray(m)[:, :k]
    src[dst.reshape(-1)] = np.repeat(np.arange(t), k)
    src = jax.device_put(jnp.asarray(src), dev)
    dst_d = jax.device_put(jnp.asarray(dst), dev)
    w = jnp.take_along_axis(p, jnp.asarray(np.asarray(m)[:, e : e + k]), axis=1)

    permute = jax.jit(lambda x: xj.permute(x, m, tpe, off, num_out_rows=n)[0])
    jnp_permute = jax.jit(lambda x: x[src])
    y = permute(x)
    unpermute = jax.jit(lambda y: xj.unpermute(y, m, tpe, off, p))
    jnp_unpermute = jax.jit(
        lambda y: jnp.sum(y[dst_d].astype(jnp.float32) * w[..., None], axis=1).astype(y.dtype)
    )
    np.testing.assert_array_equal(np.asarray(permute(x)), np.asarray(jnp_permute(x)))
    copy_in = jax.jit(lambda y: y + jnp.zeros((), y.dtype))

    # The layer API from top-k ids: xcall's dispatch (map, permute, probs)
    # and combine, against the usual jnp form (a stable sort of the ids,
    # a gather, a scatter-add back).
    ids = jax.device_put(jnp.asarray(top.astype(np.int32)), dev)
    pk = jax.device_put(jnp.asarray(np.take_along_axis(probs, top, axis=1)), dev)
    dispatch = jax.jit(lambda x, i, q: xj.token_dispatch(x, i, q, num_experts=e)[:3])

    def jnp_dispatch_fn(x, i, q):
        order = jnp.argsort(i.reshape(-1), stable=True)
        return x[order // k], q.reshape(-1)[order], order

    jnp_dispatch = jax.jit(jnp_dispatch_fn)
    yd, ypd, rmap = dispatch(x, ids, pk)
    jy, jyp, order = jnp_dispatch(x, ids, pk)
    np.testing.assert_array_equal(np.asarray(yd), np.asarray(jy))
    np.testing.assert_array_equal(np.asarray(ypd), np.asarray(jyp))
    combine = jax.jit(lambda y, m, q, i: xj.token_combine(y, m, q, routing=i))

    def jnp_combine_fn(y, order, pp):
        w = y.astype(jnp.float32) * pp[:, None]
        return jnp.zeros((t, h), jnp.float32).at[order // k].add(w).astype(y.dtype)

    jnp_combine = jax.jit(jnp_combine_fn)
    np.testing.assert_allclose(
        np.asarray(combine(yd, rmap, pk, ids), np.float32),
        np.asarray(jnp_combine(jy, order, jyp), np.float32),
        rtol=2e-2,
        atol=2e-2,
    )

    rows = []
    moved = 2 * n * h * 2  # permute: read + write of N rows of bf16
    gathered = n * h * 2 + t * h * 2  # N rows one way, T rows the other
    for name, f, args, nbytes in [
        ("xcall permute (XLA FFI)", permute, (x,), moved),
        ("jnp gather permute", jnp_permute, (x,), moved),
        ("xcall unpermute+probs (XLA FFI)", unpermute, (y,), gathered),
        ("jnp unpermute+probs", jnp_unpermute, (y,), gathered),
        ("xcall token_dispatch (top-k ids)", dispatch, (x, ids, pk), gathered),
        ("jnp sort + gather dispatch", jnp_dispatch, (x, ids, pk), gathered),
        ("xcall token_combine (top-k probs)", combine, (yd, rmap, pk, ids), gathered),
        ("jnp scatter-add combine", jnp_combine, (jy, order, jyp), gathered),
        ("copy of N rows (y + 0)", copy_in, (y,), moved),
    ]:
        s = timed(f, *args)
        rows.append((name, s * 1e6, nbytes / s / 1e9))
    copy_bw = rows[-1][2]
    print(f"device: {dev.device_kind}, jax {jax.__version__}, T={t} E={e} H={h} top-{k} bf16")
    print(f"{'op':34} {'us/call':>9} {'GB/s':>8} {'/ copy':>7}")
    for name, us, gbs in rows:
        print(f"{name:34} {us:9.1f} {gbs:8.1f} {gbs / copy_bw:7.3f}")


if __name__ == "__main__":
    main()
