"""Expert-parallel dispatch and combine (xcall.jax_ep) on 1, 2 and 4
virtual CPU devices, under jax.jit and shard_map: values against numpy
loops over the routes, gradients against finite differences and against
the same layer in plain JAX, a whole MoE layer (router, dispatch,
per-expert matmuls, combine) under jax.grad, and bad input refused while
tracing with nothing run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import xcall.jax_ep as xe

AXIS = "ep"


@pytest.fixture(autouse=True)
def on_cpu():
    """Every computation here on CPU devices (the plain-JAX references
    too), whatever JAX's default backend; groups of other tests closed
    first (on GPUs a device is in one group at a time)."""
    xe.ep_close_all()
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def mesh_of(n, devices=None):
    devices = devices if devices is not None else jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, JAX has {len(devices)}")
    return Mesh(np.array(devices[:n]), (AXIS,))


def routing(rng, pes, t, k, e, holes=False):
    """Per-device top-k ids [P*T, k] (distinct per token) and probs."""
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(pes * t)]).astype(np.int32)
    if holes:
        ids[::3, -1] = -1
    probs = rng.uniform(0.1, 1.0, (pes * t, k)).astype(np.float32)
    return ids, probs


# ------------------------------------------------------ numpy references


def ref_dispatch(x, ids, pes, e, align=1, capacity=0):
    """Per PE q: (rows with unused rows zero, counts [L]), written from
    the definition: expert l's rows in (sender, token, slot) order, at
    most capacity of them, starting where the previous expert's end,
    rounded up to align."""
    t = x.shape[0] // pes
    k = ids.shape[1]
    local = e // pes
    out = []
    for q in range(pes):
        groups = []
        for l in range(local):
            got = [x[s * t + i] for s in range(pes) for i in range(t) for j in range(k)
                   if ids[s * t + i, j] == q * local + l]
            groups.append(got[:capacity] if capacity else got)
        rows = []
        for got in groups:
            span = -(-len(got) // align) * align
            rows.extend(got + [np.zeros_like(x[0])] * (span - len(got)))
        out.append((rows, [len(g) for g in groups]))
    return out


def ref_layer(x, ids, probs, scale, pes, e, capacity=0):
    """y[t] = sum over t's kept routes of p * scale[e] * x[t] (routes past
    an expert's capacity, in (sender, token, slot) order, add nothing)."""
    t = x.shape[0] // pes
    k = ids.shape[1]
    taken = np.zeros(e, int)
    y = np.zeros(x.shape, np.float64)
    for s in range(pes):
        for i in range(t):
            for j in range(k):
                ex = ids[s * t + i, j]
                if ex < 0:
                    continue
                taken[ex] += 1
                if capacity and taken[ex] > capacity:
                    continue
                y[s * t + i] += probs[s * t + i, j] * scale[ex] * x[s * t + i].astype(np.float64)
    # Capacity counts go in (sender, token, slot) order per receiving PE,
    # which is the order above (senders outermost).
    return y


# ------------------------------------------------------------- layers


def scaled_experts(d, e, pes):
    """Expert g scales its rows by g + 1; unused rows stay zero."""
    rank = jax.lax.axis_index(AXIS)
    local = e // pes
    ex = d.row_experts()
    scale = (rank * local + ex + 1).astype(d.rows.dtype)
    return jnp.where(ex[:, None] >= 0, d.rows * scale[:, None], 0).astype(d.rows.dtype)


def ep_layer(mesh, e, **kw):
    pes = mesh.devices.size

    def body(x, ids, probs):
        d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e, **kw)
        return xe.ep_combine(scaled_experts(d, e, pes), d)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS)))


@pytest.mark.parametrize("pes", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("align,capacity", [(1, 0), (4, 0), (1, 3), (2, 5)])
def test_dispatch_rows_and_counts_match_numpy(pes, dtype, align, capacity):
    mesh = mesh_of(pes)
    t, h, k, e = 12, 8, 2, 4 * pes
    rng = np.random.default_rng(pes * 100 + align * 10 + capacity)
    x = rng.standard_normal((pes * t, h)).astype(np.float32)
    ids, probs = routing(rng, pes, t, k, e, holes=capacity == 0)
    xd = jnp.asarray(x, dtype)

    def body(x, ids, probs):
        d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e, align=align, capacity=capacity)
        return d.rows, d.tokens_per_expert, d.row_experts()

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=(P(AXIS),) * 3))
    rows, counts, experts = (np.asarray(a) for a in f(xd, ids, probs))
    want = ref_dispatch(np.asarray(xd.astype(jnp.float32)), ids, pes, e, align, capacity)
    r = rows.shape[0] // pes
    local = e // pes
    for q, (want_rows, want_counts) in enumerate(want):
        np.testing.assert_array_equal(counts[q * local:(q + 1) * local], want_counts)
        got = rows[q * r:(q + 1) * r].astype(np.float32)
        n = len(want_rows)
        np.testing.assert_array_equal(got[:n], np.asarray(want_rows).reshape(n, h))
        # Rows no route fills: zero (zero_unused), and marked -1.
        assert not got[n:].any()
        ex = experts[q * r:(q + 1) * r]
        spans = [-(-c // align) * align for c in want_counts]
        starts = np.concatenate([[0], np.cumsum(spans)[:-1]]).astype(int)
        used = {int(s0) + i for s0, c in zip(starts, want_counts) for i in range(c)}
        assert set(np.flatnonzero(ex >= 0)) == set(used)


@pytest.mark.parametrize("pes", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("capacity", [0, 2])
def test_layer_values_match_numpy(pes, dtype, capacity):
    mesh = mesh_of(pes)
    t, h, k, e = 10, 16, 3, 2 * pes if pes > 1 else 4
    rng = np.random.default_rng(7 + pes)
    x = rng.standard_normal((pes * t, h)).astype(np.float32)
    ids, probs = routing(rng, pes, t, k, e, holes=True)
    xd = jnp.asarray(x, dtype)
    y = ep_layer(mesh, e, capacity=capacity)(xd, ids, probs)
    assert y.shape == x.shape and y.dtype == dtype
    want = ref_layer(np.asarray(xd.astype(jnp.float32)), ids, probs, np.arange(1, e + 1), pes, e,
                     capacity)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=tol, atol=tol)


def test_repeated_calls_follow_each_routing():
    """One compiled step, called with new routing each time."""
    mesh = mesh_of(2)
    t, h, k, e = 8, 8, 2, 4
    f = ep_layer(mesh, e)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((2 * t, h)).astype(np.float32)
        ids, probs = routing(rng, 2, t, k, e)
        want = ref_layer(x, ids, probs, np.arange(1, e + 1), 2, e)
        np.testing.assert_allclose(np.asarray(f(x, ids, probs)), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ gradients


def experts_params(rng, e, h):
    return (0.3 * rng.standard_normal((e, h, h))).astype(np.float32)


def ep_moe(mesh, e, wr, w, x, topk, layers=1):
    """`layers` MoE layers (router, dispatch, per-expert matmul, tanh,
    combine), residual, over the mesh; w [layers, E, H, H] sharded by
    expert, wr [layers, H, E] replicated."""
    pes = mesh.devices.size
    local = e // pes

    def body(x, wr, w):
        for i in range(layers):
            probs, ids = jax.lax.top_k(jax.nn.softmax(x @ wr[i]), topk)
            d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e)
            ex = d.row_experts()
            rows = jnp.where(ex[:, None] >= 0, d.rows, 0)
            mine = w[i][jnp.maximum(ex, 0)]                      # [R, H, H] of local experts
            out = jnp.tanh(jnp.einsum("rh,rhf->rf", rows, mine))
            out = jnp.where(ex[:, None] >= 0, out, 0)
            x = x + xe.ep_combine(out, d)
        return x

    return jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(None, AXIS)),
                         out_specs=P(AXIS))(x, wr, w)


def plain_moe(e, wr, w, x, topk, layers=1):
    """The same layers in plain jax.numpy, every expert on every token."""
    for i in range(layers):
        probs, ids = jax.lax.top_k(jax.nn.softmax(x @ wr[i]), topk)
        every = jnp.tanh(jnp.einsum("th,ehf->tef", x, w[i]))      # [T, E, H]
        picked = jnp.take_along_axis(every, ids[:, :, None], axis=1)
        x = x + jnp.sum(probs[:, :, None] * picked, axis=1)
    return x


def loss_of(layer):
    return lambda x, wr, w: jnp.sum(jnp.sin(layer(x, wr, w)))


@pytest.mark.parametrize("pes", [1, 2, 4])
@pytest.mark.parametrize("layers", [1, 2])
def test_grad_through_moe_layers_matches_plain_jax(pes, layers):
    """jax.grad of a loss through whole MoE layers (two: the second
    dispatch comes before the first layer's backward calls) equals plain
    JAX's, in x, the router and the experts' weights."""
    mesh = mesh_of(pes)
    t, h, k, e = 6, 8, 2, 2 * pes
    rng = np.random.default_rng(pes + 10 * layers)
    x = rng.standard_normal((pes * t, h)).astype(np.float32)
    wr = rng.standard_normal((layers, h, e)).astype(np.float32)
    w = np.stack([experts_params(rng, e, h) for _ in range(layers)])
    ep = functools.partial(ep_moe, mesh, e, topk=k, layers=layers)
    plain = functools.partial(plain_moe, e, topk=k, layers=layers)
    ep_loss = loss_of(lambda x, wr, w: ep(wr, w, x))
    plain_loss = loss_of(lambda x, wr, w: plain(wr, w, x))
    got = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1, 2)))(x, wr, w)
    want = jax.jit(jax.value_and_grad(plain_loss, argnums=(0, 1, 2)))(x, wr, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, wg, name in zip(got[1], want[1], ("x", "router", "experts")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wg), rtol=1e-4, atol=1e-5,
                                   err_msg=f"gradient of {name}")


@pytest.mark.parametrize("pes", [2, 4])
def test_gradients_match_finite_differences(pes):
    """Directional derivatives of the layer in x, the probs and the
    experts' rows (the scale) against central differences."""
    mesh = mesh_of(pes)
    t, h, k, e = 5, 8, 2, 2 * pes
    rng = np.random.default_rng(3 * pes)
    x = rng.standard_normal((pes * t, h)).astype(np.float32)
    ids, probs = routing(rng, pes, t, k, e)
    scale = rng.uniform(0.5, 1.5, e).astype(np.float32)
    local = e // pes

    def body(x, ids, probs, scale):
        d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e)
        ex = d.row_experts()
        s = scale[jax.lax.axis_index(AXIS) * local + jnp.maximum(ex, 0)]
        out = jnp.where(ex[:, None] >= 0, jnp.sin(d.rows) * s[:, None], 0)
        return xe.ep_combine(out, d)

    layer = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3 + (P(),), out_specs=P(AXIS))
    weights = rng.standard_normal((pes * t, h)).astype(np.float32)

    def loss(x, probs, scale):
        return jnp.sum(weights * layer(x, ids, probs, scale))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, probs, scale)
    f = jax.jit(loss)
    args = [x, probs, scale]
    for i, g in enumerate(grads):
        for trial in range(2):
            v = rng.standard_normal(args[i].shape).astype(np.float32)
            eps = 1e-2
            plus = list(args)
            minus = list(args)
            plus[i] = args[i] + eps * v
            minus[i] = args[i] - eps * v
            fd = (float(f(*plus)) - float(f(*minus))) / (2 * eps)
            an = float(np.sum(np.asarray(g) * v))
            assert abs(fd - an) <= 2e-2 * (1 + abs(fd)), (i, trial, fd, an)


# ---------------------------------------------------------- bad input


def layer_call(mesh, x, ids, probs, e, **kw):
    def body(x, ids, probs):
        d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e, **kw)
        return xe.ep_combine(d.rows, d)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS)))(
        x, ids, probs)


def test_bad_input_raises_xcall_messages_and_opens_nothing():
    mesh = mesh_of(2)
    t, h, k, e = 8, 8, 2, 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * t, h)).astype(np.float32)
    ids, probs = routing(rng, 2, t, k, e)
    before = dict(xe._groups)
    cases = [
        (TypeError, "float32 or bfloat16", (x.astype(np.float16), ids, probs, e), {}),
        (TypeError, "integers", (x, ids.astype(np.float32), probs, e), {}),
        (ValueError, "probs has shape", (x, ids, probs[:, :1], e), {}),
        (ValueError, "ids must be", (x, ids[: t], probs[: t], e), {}),
        # xcall's own messages, from its layout checks.
        (ValueError, "topk 2 is more than the 1 experts", (x, ids % 1, probs, 1), {}),
        (ValueError, "do not split evenly", (x, ids % 3, probs, 3), {}),
        (ValueError, "16-byte", (x[:, :3], ids, probs, e), {}),
        (ValueError, "align must be at least 1", (x, ids, probs, e), {"align": 0}),
    ]
    for error, text, args, kw in cases:
        with pytest.raises(error, match=text):
            layer_call(mesh, *args, **kw)
    assert xe._groups == before, "a refused call opened a group"


def test_combine_refuses_rows_that_are_not_the_dispatchs():
    mesh = mesh_of(2)
    t, h, k, e = 8, 8, 2, 4
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2 * t, h)).astype(np.float32)
    ids, probs = routing(rng, 2, t, k, e)

    def body(x, ids, probs, cut):
        d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e)
        return xe.ep_combine(d.rows[:-1] if cut else d.rows.astype(jnp.bfloat16), d)

    for cut, error, text in ((True, ValueError, "expert_out has shape"),
                             (False, TypeError, "expert_out is bfloat16")):
        f = jax.shard_map(functools.partial(body, cut=cut), mesh=mesh,
                          in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
        with pytest.raises(error, match=text):
            jax.jit(f)(x, ids, probs)


class _Foreign:
    """A device of another process."""

    id = 99
    process_index = 1
    platform = "cpu"
    local_hardware_id = None


class _FakeMesh:
    axis_names = (AXIS,)

    def __init__(self, devices):
        self.devices = np.array(devices, dtype=object)
        self.shape = {AXIS: len(devices)}


def test_a_mesh_with_another_process_device_is_refused():
    before = dict(xe._groups)
    mesh = _FakeMesh([jax.devices("cpu")[0], _Foreign()])
    with pytest.raises(ValueError, match="unless the processes run under jax.distributed"):
        xe.ep_group(mesh, tokens=8, hidden=8, topk=2, experts=4)
    with pytest.raises(ValueError, match="no axis 'tp'"):
        xe.ep_group(mesh_of(1), tokens=8, hidden=8, topk=2, experts=4, axis_name="tp")
    assert xe._groups == before


def test_handlers_check_every_operand_against_the_group():
    """The handler refuses an operand of the wrong shape with xcall's
    message (a call made around the Python checks)."""
    mesh = mesh_of(2)
    g = xe.ep_group(mesh, tokens=8, hidden=8, topk=2, experts=4, dtype=jnp.float32)

    def body(rows):
        bad = jnp.zeros((g.routing_bytes - 1,), jnp.uint8)
        return xe._call("ep_combine", g, (xe._tokens_spec(g),), rows, bad)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    with pytest.raises(Exception, match=r"xcall_ep_combine: routing is U8"):
        f(jnp.zeros((2 * g.expert_rows, 8), jnp.float32)).block_until_ready()


@pytest.mark.parametrize("pes", [2, 4])
def test_two_dispatches_before_their_combines(pes):
    """Two independent dispatches, then both combines: each combine puts
    its own dispatch's routing back."""
    mesh = mesh_of(pes)
    t, h, k, e = 8, 8, 2, 2 * pes
    rng = np.random.default_rng(pes)
    a = (rng.standard_normal((pes * t, h)).astype(np.float32),) + routing(rng, pes, t, k, e)
    b = (rng.standard_normal((pes * t, h)).astype(np.float32),) + routing(rng, pes, t, k, e)

    def body(x1, i1, p1, x2, i2, p2):
        d1 = xe.ep_dispatch(x1, i1, p1, mesh=mesh, num_experts=e)
        d2 = xe.ep_dispatch(x2, i2, p2, mesh=mesh, num_experts=e)
        return xe.ep_combine(d1.rows, d1), xe.ep_combine(2 * d2.rows, d2)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 6, out_specs=(P(AXIS),) * 2))
    y1, y2 = f(*a, *b)
    ones = np.ones(e)
    np.testing.assert_allclose(y1, ref_layer(a[0], a[1], a[2], ones, pes, e), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y2, ref_layer(b[0], b[1], b[2], 2 * ones, pes, e), rtol=1e-5,
                               atol=1e-5)


def test_grad_through_layers_under_scan_matches_plain_jax():
    """Layers stacked under jax.lax.scan (one call site dispatching once
    per layer, the gradients in reverse): each layer's backward calls put
    its own routing back."""
    pes, layers = 2, 3
    mesh = mesh_of(pes)
    t, h, k, e = 6, 8, 2, 4
    rng = np.random.default_rng(5)
    x = rng.standard_normal((pes * t, h)).astype(np.float32)
    wr = rng.standard_normal((layers, h, e)).astype(np.float32)
    w = np.stack([experts_params(rng, e, h) for _ in range(layers)])

    def body(x, wr, w):
        def layer(x, p):
            wr, w = p
            probs, ids = jax.lax.top_k(jax.nn.softmax(x @ wr), k)
            d = xe.ep_dispatch(x, ids, probs, mesh=mesh, num_experts=e)
            ex = d.row_experts()
            rows = jnp.where(ex[:, None] >= 0, d.rows, 0)
            out = jnp.tanh(jnp.einsum("rh,rhf->rf", rows, w[jnp.maximum(ex, 0)]))
            return x + xe.ep_combine(jnp.where(ex[:, None] >= 0, out, 0), d), None

        return jax.lax.scan(layer, x, (wr, w))[0]

    ep = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(None, AXIS)), out_specs=P(AXIS))
    got = jax.jit(jax.value_and_grad(loss_of(ep), argnums=(0, 1, 2)))(x, wr, w)
    plain = loss_of(lambda x, wr, w: plain_moe(e, wr, w, x, topk=k, layers=layers))
    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(x, wr, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, wg in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wg), rtol=1e-4, atol=1e-5)


def test_a_call_outside_shard_map_says_where_it_runs():
    mesh = mesh_of(2)
    x = np.zeros((8, 8), np.float32)
    ids = np.zeros((8, 2), np.int32) + np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match="inside shard_map"):
        jax.jit(lambda x: xe.ep_dispatch(x, ids, np.ones((8, 2), np.float32), mesh=mesh,
                                         num_experts=4).rows)(x)
