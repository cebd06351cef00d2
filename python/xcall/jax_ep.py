"""Expert parallelism in JAX: xcall's dispatch and combine across every
device of one process, or of the processes of one host under
``jax.distributed``, under ``jax.jit`` and ``shard_map``.

Inside ``shard_map`` over a mesh (one axis, the experts' axis), each
device holds ``T`` tokens ``[T, H]`` routed top-k over
``E`` experts, ``E / P`` of them on each device (device ``q`` of the axis
hosts experts ``q*L .. (q+1)*L``)::

    d = ep_dispatch(x, ids, probs, mesh=mesh, num_experts=E)
    # d.rows [expert_rows, H]: the rows every device sent to this device's
    # experts, grouped by local expert; d.tokens_per_expert [L] int32
    y = ep_combine(expert_fn(d.rows), d)      # [T, H], weighted by probs

Both are differentiable (``x``, ``probs`` and the experts' rows) through
xcall's backward calls (``jax.grad`` through a whole MoE layer works).

**Groups.** The first call for a set of devices and a shape opens xcall's
shmem world and expert-parallel group for every device of the mesh at
once, one thread per device, while the program is traced (never inside a
device's computation, so nothing waits for a peer that XLA has not
started); later calls reuse it. Under ``jax.distributed`` a mesh may hold
devices of several processes of one host (a process per GPU, or several
GPUs each): each process opens its own devices' part, and the processes
meet at a Unix socket that the process holding the axis's first device
names through jax.distributed's key-value store (peers reached by CUDA
IPC, or shared memory on CPU); every process then makes the same calls
in the same order, as one SPMD program does. :func:`ep_group` opens one up front;
:func:`ep_close_all` (run at exit) frees them. On GPUs a device takes part
in one group at a time.

**Which device is which PE.** On GPUs the handler looks up the device of
its call in the group's device list (the mesh axis order); on CPU devices
it reads its rank from an operand (``jax.lax.axis_index``, in host memory).

**Calls.** Each call is collective over the mesh: every device's program
makes the same calls in the same order (what one SPMD program does). Each
begins with an empty phase; ``ep_dispatch`` saves its routing into
``d.routing``, and ``ep_combine`` and the backward calls put it back
first, so each follows its own dispatch whatever was dispatched between
(several layers, then their gradients). All calls are command-buffer
compatible on GPUs.

**Rows.** ``d.rows`` has the worst-case rows (dropless: ``P * T * min(k,
L)`` plus alignment padding; with ``capacity=C``: ``L * round_up(C,
align)``). Expert ``l``'s rows start at a multiple of ``align``; rows no
route fills are zero with ``zero_unused=True`` (the default; False skips
that write when the experts work row by row, e.g. a benchmark).
:meth:`EpDispatch.row_experts` gives each row's local expert (-1: unused).
The gradient of the rows has zeros there always.

Every size is checked while tracing: a wrong dtype, shapes that disagree,
``k > E``, experts that do not split over the devices, a mesh with devices
of another process outside ``jax.distributed`` raise an exception with
xcall's message, and nothing runs.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import hashlib
import os
import tempfile
import threading
import uuid
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import xcall as _xcall
from xcall._ep_abi import EpConfig as _Config
from xcall._ep_abi import EpSizes as _Sizes

__all__ = [
    "EpGroup",
    "EpDispatch",
    "ep_group",
    "ep_dispatch",
    "ep_combine",
    "ep_close_all",
]

_PLATFORM_HOST, _PLATFORM_CUDA = 0, 1
_PRECISION = {np.dtype(np.float32): 0, np.dtype(jnp.bfloat16): 1}
_STATUS_INVALID_ARGUMENT = 2


_OPS = ("ep_dispatch", "ep_combine", "ep_combine_backward", "ep_dispatch_backward")
_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()
_groups: dict = {}


def _load() -> ctypes.CDLL:
    """libxcall with the expert-parallel handlers registered, once."""
    global _lib
    if _lib is not None:
        return _lib
    # The library xcall.load_library loaded (the one xcall.jax.load picked,
    # if it was called first); this module registers only its own handlers.
    lib = _xcall.load_library()
    lib.xcall_last_error_message.restype = ctypes.c_char_p
    u64 = ctypes.c_uint64
    lib.xcall_ep_layout.argtypes = [ctypes.POINTER(_Config), ctypes.c_uint32, ctypes.POINTER(_Sizes)]
    lib.xcall_xla_ep_open.argtypes = [
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint32),
        u64,
        ctypes.POINTER(_Config),
        u64,
        ctypes.POINTER(u64),
        ctypes.POINTER(u64),
    ]
    lib.xcall_xla_ep_open_ranks.argtypes = [
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(u64),
        u64,
        u64,
        ctypes.c_char_p,
        ctypes.POINTER(_Config),
        u64,
        ctypes.POINTER(u64),
        ctypes.POINTER(u64),
    ]
    lib.xcall_xla_ep_close.argtypes = [u64]
    lib.xcall_xla_ep_check.argtypes = [u64]
    lib.xcall_xla_ep_dropped_routes.argtypes = [u64, u64, ctypes.POINTER(u64)]
    for op in _OPS:
        for platform, suffix in (("cpu", "host"), ("CUDA", "cuda")):
            handler = getattr(lib, f"xcall_xla_{op}_{suffix}")
            jax.ffi.register_ffi_target(f"xcall_{op}", jax.ffi.pycapsule(handler), platform=platform)
    _lib = lib
    return lib


def _check(lib, status: int, what: str) -> None:
    if status != 0:
        message = lib.xcall_last_error_message().decode()
        error = ValueError if status == _STATUS_INVALID_ARGUMENT else RuntimeError
        raise error(f"xcall.jax: {what}: {message} (status {status})")


def _devices(mesh, axis_name):
    """The mesh's devices in axis order, checked: one axis of size > 1
    (``axis_name``), one platform; devices of other processes only under
    ``jax.distributed`` (and at least one of this process's)."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"xcall.jax: the mesh has no axis {axis_name!r} (axes {mesh.axis_names})")
    devices = list(np.asarray(mesh.devices).reshape(-1))
    if len(devices) != mesh.shape[axis_name]:
        raise ValueError(
            f"xcall.jax: expert parallelism runs over one mesh axis: {axis_name!r} has "
            f"{mesh.shape[axis_name]} devices, the mesh {len(devices)}"
        )
    here = jax.process_index()
    foreign = [d for d in devices if d.process_index != here]
    if foreign and jax.process_count() == 1:
        raise ValueError(
            f"xcall.jax: the mesh's devices must all be this process's (process {here}), "
            f"unless the processes run under jax.distributed; {foreign[0]} is process "
            f"{foreign[0].process_index}'s"
        )
    if len(foreign) == len(devices):
        raise ValueError(
            f"xcall.jax: none of the mesh's devices is this process's (process {here}): "
            "a process calls expert-parallel ops only over meshes holding its devices"
        )
    platforms = {d.platform for d in devices}
    if len(platforms) != 1 or not platforms <= {"cpu", "gpu", "cuda"}:
        raise ValueError(f"xcall.jax: the mesh's devices must be all CPU or all CUDA, got {platforms}")
    return devices


class EpGroup:
    """An expert-parallel group over a mesh axis's devices, for one shape
    (``tokens`` per device, ``hidden``, ``topk``, ``experts``, ``dtype``,
    ``align``, ``capacity``): xcall's world and group on every device,
    opened at once. Made by :func:`ep_group`."""

    def __init__(self, key, devices, axis_name, config, sizes, gid, routing_bytes):
        self.key = key
        self.devices = devices
        here = jax.process_index()
        #: The ranks (mesh axis positions) of this process's devices.
        self.local_ranks = [r for r, d in enumerate(devices) if d.process_index == here]
        self.local_devices = [devices[r] for r in self.local_ranks]
        self.axis_name = axis_name
        self.config = config
        self.pes = len(devices)
        self.local_experts = int(sizes.local_experts)
        self.expert_rows = int(sizes.expert_rows)
        self.id = gid
        self.routing_bytes = routing_bytes
        self.closed = False

    @property
    def tokens(self):
        return self.config["tokens"]

    @property
    def hidden(self):
        return self.config["hidden"]

    @property
    def topk(self):
        return self.config["topk"]

    @property
    def dtype(self):
        return self.config["dtype"]

    def check(self) -> None:
        """Raises the first error a GPU call of the group met (a peer that
        never came, ids that were not taken), after waiting for the
        devices. Nothing to report on CPU."""
        _sync(self.local_devices)
        _check(_load(), _load().xcall_xla_ep_check(self.id), "expert-parallel check")

    def dropped_routes(self) -> list:
        """Routes each of this process's devices' experts dropped by the
        capacity (in mesh order: every device's in one process), summed
        over every dispatch so far."""
        _sync(self.local_devices)
        lib = _load()
        out = []
        for rank in self.local_ranks:
            n = ctypes.c_uint64(0)
            _check(lib, lib.xcall_xla_ep_dropped_routes(self.id, rank, ctypes.byref(n)), "dropped routes")
            out.append(n.value)
        return out

    def __repr__(self):
        return f"EpGroup({self.pes} devices, {self.config}, id {self.id})"


def _sync(devices):
    """Waits for every array on ``devices`` (their computations done)."""
    wanted = set(devices)
    for a in jax.live_arrays():
        try:
            if set(a.devices()) & wanted:
                a.block_until_ready()
        except RuntimeError:
            pass


def _config(mesh, axis_name, tokens, hidden, topk, experts, dtype, align, capacity, num_sms):
    dtype = np.dtype(dtype)
    if dtype not in _PRECISION:
        raise TypeError(f"xcall.jax: expert-parallel tokens must be float32 or bfloat16, not {dtype}")
    for name, v in (("tokens", tokens), ("hidden", hidden), ("topk", topk), ("experts", experts),
                    ("align", align), ("capacity", capacity), ("num_sms", num_sms)):
        if int(v) < 0:
            raise ValueError(f"xcall.jax: {name} must not be negative, got {v}")
    return dict(tokens=int(tokens), hidden=int(hidden), topk=int(topk), experts=int(experts),
                dtype=dtype, align=int(align), capacity=int(capacity), num_sms=int(num_sms))


def ep_group(mesh, *, tokens: int, hidden: int, topk: int, experts: int, dtype=jnp.bfloat16,
             axis_name: str = "ep", align: int = 1, capacity: int = 0, num_sms: int = 0,
             timeout_ms: int = 60000) -> EpGroup:
    """The group of ``mesh``'s devices (along ``axis_name``) for this
    shape, opened on first use (every device at once) and kept until
    :func:`ep_close_all` or exit. ``capacity=0``: dropless."""
    lib = _load()
    devices = _devices(mesh, axis_name)
    config = _config(mesh, axis_name, tokens, hidden, topk, experts, dtype, align, capacity, num_sms)
    key = (tuple(d.id for d in devices), tuple(sorted((k, str(v)) for k, v in config.items())))
    with _lock:
        g = _groups.get(key)
        if g is not None:
            return g
        c = _Config(config["tokens"], config["hidden"], config["topk"], config["experts"],
                    config["align"], config["capacity"], _PRECISION[config["dtype"]],
                    config["num_sms"])
        sizes = _Sizes()
        _check(lib, lib.xcall_ep_layout(ctypes.byref(c), len(devices), ctypes.byref(sizes)),
               "expert-parallel group")
        cuda = devices[0].platform != "cpu"
        here = jax.process_index()
        local = [(r, d) for r, d in enumerate(devices) if d.process_index == here]
        ordinals = (ctypes.c_uint32 * len(local))(
            *[(d.local_hardware_id if d.local_hardware_id is not None else d.id) for _, d in local]
        )
        platform = _PLATFORM_CUDA if cuda else _PLATFORM_HOST
        gid, routing = ctypes.c_uint64(0), ctypes.c_uint64(0)
        if len(local) == len(devices):
            status = lib.xcall_xla_ep_open(platform, ordinals, len(devices), ctypes.byref(c),
                                           int(timeout_ms), ctypes.byref(gid),
                                           ctypes.byref(routing))
        else:
            socket = _agree_socket(key, devices, local, int(timeout_ms))
            ranks = (ctypes.c_uint64 * len(local))(*[r for r, _ in local])
            status = lib.xcall_xla_ep_open_ranks(platform, ordinals, ranks, len(local),
                                                 len(devices), socket.encode(), ctypes.byref(c),
                                                 int(timeout_ms), ctypes.byref(gid),
                                                 ctypes.byref(routing))
        _check(lib, status, "expert-parallel group")
        g = EpGroup(key, devices, axis_name, config, sizes, gid.value, routing.value)
        _groups[key] = g
        return g


_opened = collections.Counter()


def _agree_socket(key, devices, local, timeout_ms) -> str:
    """The Unix socket where the processes of a group meet: made up by the
    process holding rank 0 and handed to the others through
    jax.distributed's key-value store, under a name every process derives
    alike (the group's devices and shape, and how many times this process
    opened that group: the processes open groups in the same order)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "xcall.jax: a mesh over several processes needs jax.distributed.initialize() first"
        )
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    _opened[digest] += 1
    name = f"xcall/jax_ep/{digest}/{_opened[digest]}"
    if local[0][0] == 0:
        path = os.path.join(tempfile.gettempdir(), f"xcall-ep-{uuid.uuid4().hex[:20]}.sock")
        client.key_value_set(name, path)
        return path
    return client.blocking_key_value_get(name, timeout_ms or 60000)


def ep_close_all() -> None:
    """Frees every open group, after waiting for their devices' work
    (run at exit), and clears JAX's caches: programs compiled with a
    closed group are traced again, opening a new one."""
    if _lib is None:
        return
    with _lock:
        groups = list(_groups.values())
        _groups.clear()
    for g in groups:
        _sync(g.local_devices)
        g.closed = True
        _check(_lib, _lib.xcall_xla_ep_close(g.id), "closing an expert-parallel group")
    if groups:
        jax.clear_caches()


atexit.register(ep_close_all)


# ------------------------------------------------------------ the calls


def _attrs(g):
    return {"group": np.int64(g.id)}


def _rank(g):
    try:
        return jax.lax.axis_index(g.axis_name).astype(jnp.int32)
    except NameError as e:
        raise ValueError(
            f"xcall.jax: expert-parallel calls run inside shard_map over the mesh's axis "
            f"{g.axis_name!r} ({e})"
        ) from None


def _call(name, g, results, *operands, **attrs):
    if g.closed:
        raise RuntimeError("xcall.jax: this expert-parallel group was closed; call ep_dispatch again")
    ffi = jax.ffi.ffi_call(f"xcall_{name}", results)
    return tuple(_varying(o, g.axis_name) for o in ffi(*operands, _rank(g), **_attrs(g), **attrs))


def _varying(a, axis):
    """``a`` typed as varying over the mesh axis (each device's result is
    its own), as shard_map's checks expect of every per-device value."""
    t = jax.typeof(a)
    m = getattr(t, "manual_axis_type", None)
    vma = m.varying if m is not None else getattr(t, "vma", None)
    if vma is None:  # a JAX without varying-axis types
        return a
    return a if axis in vma else jax.lax.pcast(a, (axis,), to="varying")


def _rows_spec(g):
    return jax.ShapeDtypeStruct((g.expert_rows, g.hidden), g.dtype)


def _tokens_spec(g):
    return jax.ShapeDtypeStruct((g.tokens, g.hidden), g.dtype)


def _raw_dispatch(g, x, ids, probs, zero_unused):
    rows, tpe, routing = _call(
        "ep_dispatch",
        g,
        (
            _rows_spec(g),
            jax.ShapeDtypeStruct((g.local_experts, 2), jnp.int32),
            jax.ShapeDtypeStruct((g.routing_bytes,), jnp.uint8),
        ),
        x, ids, probs,
        zero_unused=np.bool_(zero_unused),
    )
    # s64 counts as int32 pairs (low word first): the low word holds them.
    return rows, tpe[:, 0], routing


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _dispatch(g, x, ids, probs, zero_unused):
    return _raw_dispatch(g, x, ids, probs, zero_unused)


def _dispatch_fwd(g, x, ids, probs, zero_unused):
    out = _raw_dispatch(g, x, ids, probs, zero_unused)
    return out, out[2]


def _dispatch_bwd(g, zero_unused, routing, cts):
    ct_rows = cts[0]
    (grad_x,) = _call("ep_dispatch_backward", g, (_tokens_spec(g),), ct_rows.astype(g.dtype), routing)
    return grad_x, None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _raw_combine(g, expert_out, routing):
    (y,) = _call("ep_combine", g, (_tokens_spec(g),), expert_out, routing)
    return y


# `probs` is an argument of combine only for its gradient: the weights
# are the probs given to the dispatch, saved in its routing (the same
# array, carried by EpDispatch).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(g, expert_out, probs, routing):
    return _raw_combine(g, expert_out, routing)


def _combine_fwd(g, expert_out, probs, routing):
    return _raw_combine(g, expert_out, routing), (expert_out, routing)


def _combine_bwd(g, res, ct_y):
    expert_out, routing = res
    grad_rows, grad_probs = _call(
        "ep_combine_backward",
        g,
        (_rows_spec(g), jax.ShapeDtypeStruct((g.tokens, g.topk), jnp.float32)),
        ct_y.astype(g.dtype), expert_out, routing,
    )
    return grad_rows, grad_probs, None


_combine.defvjp(_combine_fwd, _combine_bwd)


@jax.tree_util.register_pytree_node_class
class EpDispatch:
    """What :func:`ep_dispatch` returns: ``rows`` ``[expert_rows, H]``,
    ``tokens_per_expert`` ``[L]`` int32 (routes each local expert got,
    after the capacity), and for :func:`ep_combine` the dispatch's
    ``routing`` (bytes) and ``probs`` ``[T, k]`` float32."""

    def __init__(self, rows, tokens_per_expert, routing, probs, group):
        self.rows = rows
        self.tokens_per_expert = tokens_per_expert
        self.routing = routing
        self.probs = probs
        self.group = group

    def tree_flatten(self):
        return (self.rows, self.tokens_per_expert, self.routing, self.probs), self.group

    @classmethod
    def tree_unflatten(cls, group, children):
        return cls(*children, group)

    def row_experts(self):
        """``[expert_rows]`` int32: each row's local expert, -1 for rows
        no route fills (padding, the unused tail)."""
        g = self.group
        tpe = self.tokens_per_expert.astype(jnp.int32)
        align = g.config["align"]
        # Each expert's rows follow the previous one's, from a multiple
        # of align (with a capacity too: the kept routes, padded).
        span = (tpe + align - 1) // align * align
        ends = jnp.cumsum(span)
        starts = ends - span
        r = jnp.arange(g.expert_rows, dtype=jnp.int32)
        # Unrolled: a loop on the device would wait on the host for each
        # of its log2(L) steps (an XLA while loop); unrolled, the steps
        # fuse into one kernel.
        e = jnp.searchsorted(ends, r, side="right", method="scan_unrolled").astype(jnp.int32)
        safe = jnp.minimum(e, g.local_experts - 1)
        valid = (e < g.local_experts) & (r - starts[safe] < tpe[safe])
        return jnp.where(valid, e, -1)


def ep_dispatch(x, ids, probs, *, mesh, num_experts: int, axis_name: str = "ep", align: int = 1,
                capacity: int = 0, num_sms: int = 0, zero_unused: bool = True,
                timeout_ms: int = 60000) -> EpDispatch:
    """Sends each of this device's tokens ``x`` ``[T, H]`` (float32 or
    bfloat16) once to each device hosting one of its experts ``ids``
    ``[T, k]`` (integers in ``-1..E``, -1: no route, distinct per token),
    with ``probs`` ``[T, k]``; returns the rows every device sent to this
    device's experts (:class:`EpDispatch`). Call inside ``shard_map`` over
    ``mesh`` (``axis_name`` the experts' axis). Differentiable in ``x``;
    the gradient of ``probs`` comes from :func:`ep_combine`."""
    x, ids, probs = jnp.asarray(x), jnp.asarray(ids), jnp.asarray(probs)
    if x.ndim != 2:
        raise ValueError(f"xcall.jax: x must be [T, H] on each device, has shape {x.shape}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"xcall.jax: ids must be [T, k] with T = {x.shape[0]} (x's), has shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"xcall.jax: ids must be integers, got {ids.dtype}")
    if probs.shape != ids.shape:
        raise ValueError(f"xcall.jax: probs has shape {probs.shape}, ids {ids.shape}")
    if not jnp.issubdtype(probs.dtype, jnp.floating):
        raise TypeError(f"xcall.jax: probs must be floating point, got {probs.dtype}")
    g = ep_group(mesh, tokens=x.shape[0], hidden=x.shape[1], topk=ids.shape[1],
                 experts=num_experts, dtype=x.dtype, axis_name=axis_name, align=align,
                 capacity=capacity, num_sms=num_sms, timeout_ms=timeout_ms)
    probs32 = probs.astype(jnp.float32)
    rows, tpe, routing = _dispatch(g, x, ids.astype(jnp.int32), probs32, bool(zero_unused))
    return EpDispatch(rows, tpe, routing, probs32, g)


def ep_combine(expert_out, d: EpDispatch):
    """Each of this device's tokens of dispatch ``d`` becomes the sum of
    its experts' output rows (``expert_out`` ``[expert_rows, H]``, the
    layout of ``d.rows``, its dtype), each times its prob; ``[T, H]``.
    Differentiable in ``expert_out`` and in the dispatch's ``probs``."""
    if not isinstance(d, EpDispatch):
        raise TypeError("xcall.jax: ep_combine takes the EpDispatch that ep_dispatch returned")
    g = d.group
    expert_out = jnp.asarray(expert_out)
    if expert_out.shape != (g.expert_rows, g.hidden):
        raise ValueError(
            f"xcall.jax: expert_out has shape {expert_out.shape}; the dispatch's rows are "
            f"{(g.expert_rows, g.hidden)}"
        )
    if expert_out.dtype != g.dtype:
        raise TypeError(f"xcall.jax: expert_out is {expert_out.dtype}; the group moves {g.dtype}")
    return _combine(g, expert_out, d.probs, d.routing)
