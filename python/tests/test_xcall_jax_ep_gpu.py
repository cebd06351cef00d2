"""Expert-parallel dispatch and combine (xcall.jax_ep) on the GPUs of this
process: 2 of them and all of them (1 where that is all), under jax.jit
and shard_map, with XLA command buffers off or on
(XCALL_XLA_COMMAND_BUFFERS, set by the device bundle with XLA_FLAGS):
values against numpy loops, one compiled step replayed with new routing,
gradients through MoE layers against plain JAX, and bad routing reported
by the group's check; and two processes of a GPU each under
jax.distributed. Skips without a GPU unless XCALL_REQUIRE_CUDA=1."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_xcall_jax_ep import AXIS, ep_layer, ep_moe, loss_of, plain_moe, ref_layer, routing

import xcall.jax_ep as xe


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()
MODE = os.environ.get("XCALL_XLA_COMMAND_BUFFERS")

if not GPUS:
    if os.environ.get("XCALL_REQUIRE_CUDA", "").strip().lower() in ("1", "true", "yes", "on"):
        raise RuntimeError("XCALL_REQUIRE_CUDA=1 but JAX sees no GPU")
    pytest.skip("no GPU visible to JAX: expert-parallel GPU tests skipped", allow_module_level=True)

# Two GPUs and all of them (one alone where that is all there is).
COUNTS = sorted({min(2, len(GPUS)), len(GPUS)})


@pytest.fixture(autouse=True)
def fresh_groups():
    """A GPU is in one group at a time: each test opens its own."""
    xe.ep_close_all()
    yield
    xe.ep_close_all()


def gpu_mesh(n):
    return Mesh(np.array(GPUS[:n]), (AXIS,))


@pytest.mark.parametrize("pes", COUNTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("capacity", [0, 3])
def test_layer_values_match_numpy_on_gpus(pes, dtype, capacity):
    mesh = gpu_mesh(pes)
    t, h, k, e = 40, 256, 4, 8 * pes
    f = ep_layer(mesh, e, capacity=capacity)
    # Replays of one executable (recorded once with command buffers on)
    # follow each call's routing.
    for seed in range(4):
        rng = np.random.default_rng(seed + 10 * pes)
        x = rng.standard_normal((pes * t, h)).astype(np.float32)
        ids, probs = routing(rng, pes, t, k, e, holes=seed % 2 == 1)
        xd = jnp.asarray(x, dtype)
        y = f(xd, ids, probs)
        want = ref_layer(np.asarray(xd.astype(jnp.float32)), ids, probs, np.arange(1, e + 1), pes,
                         e, capacity)
        tol = 1e-5 if dtype == jnp.float32 else 3e-2
        np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=tol, atol=tol,
                                   err_msg=f"seed {seed}, command buffers {MODE}")
    g = next(iter(xe._groups.values()))
    g.check()
    dropped = g.dropped_routes()
    assert (sum(dropped) > 0) == (capacity > 0), dropped


@pytest.mark.parametrize("pes", COUNTS)
def test_grad_through_two_moe_layers_matches_plain_jax_on_gpus(pes):
    mesh = gpu_mesh(pes)
    t, h, k, e = 16, 32, 2, 2 * pes
    rng = np.random.default_rng(pes)
    x = rng.standard_normal((pes * t, h)).astype(np.float32)
    wr = rng.standard_normal((2, h, e)).astype(np.float32)
    w = (0.3 * rng.standard_normal((2, e, h, h))).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        ep = loss_of(lambda x, wr, w: ep_moe(mesh, e, wr, w, x, topk=k, layers=2))
        got = jax.jit(jax.value_and_grad(ep, argnums=(0, 1, 2)))(x, wr, w)
        with jax.default_device(jax.devices("cpu")[0]):
            ref = loss_of(lambda x, wr, w: plain_moe(e, wr, w, x, topk=k, layers=2))
            want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2)))(x, wr, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    for a, b, name in zip(got[1], want[1], ("x", "router", "experts")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4,
                                   err_msg=f"gradient of {name}, command buffers {MODE}")


def test_bad_routing_is_reported_by_check():
    """An id listed twice for a token is not taken; the call completes on
    every GPU and the group's check names it."""
    mesh = gpu_mesh(COUNTS[0])
    pes = COUNTS[0]
    t, h, k, e = 8, 64, 2, 4 * pes
    rng = np.random.default_rng(0)
    x = rng.standard_normal((pes * t, h)).astype(np.float32)
    ids, probs = routing(rng, pes, t, k, e)
    ids[3] = [1, 1]
    f = ep_layer(mesh, e)
    f(x, ids, probs).block_until_ready()
    g = next(iter(xe._groups.values()))
    with pytest.raises(ValueError, match="not taken"):
        g.check()
    g.check()  # cleared


@pytest.mark.parametrize("capacity", [0, 2])
def test_a_process_per_gpu_under_jax_distributed(capacity):
    """Two processes, a GPU each (jax.distributed, CUDA IPC between them):
    the layer's values against numpy, its gradients against the same
    program on this process's CPU devices."""
    if len(GPUS) < 2:
        pytest.skip(f"needs 2 GPUs, JAX sees {len(GPUS)}")
    from test_xcall_jax_ep_processes import in_one_process, launch, worker

    got = launch(2, 1, "cuda", capacity)
    x, ids, probs, _, e = worker.inputs(2)
    np.testing.assert_allclose(got["y"], ref_layer(x, ids, probs, np.arange(1, e + 1), 2, e,
                                                   capacity), rtol=1e-5, atol=1e-5)
    cpus = jax.devices("cpu")
    with jax.default_device(cpus[0]):
        want = in_one_process(2, capacity, cpus)
    xe.ep_close_all()
    for name in ("gx", "gp"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(got["dropped"], want["dropped"])
