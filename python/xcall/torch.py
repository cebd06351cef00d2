"""Expert parallelism in PyTorch: xcall's dispatch and combine as
``torch.library`` custom ops (namespace ``xcall``), one process per GPU
under ``torchrun`` (or one process per CPU rank on Host; with more ranks
than GPUs, ranks share a GPU and take turns on it).

Each process (a PE) holds ``T`` tokens ``[T, H]`` routed top-k over ``E``
experts, ``E / P`` of them on each of the ``P`` processes (rank ``q``
hosts experts ``q*L .. (q+1)*L``)::

    import xcall.torch as xt

    group = xt.EpGroup(tokens=T, hidden=H, topk=k, experts=E, dtype=torch.bfloat16)
    d = xt.ep_dispatch(group, x, ids, probs)
    # d.rows [expert_rows, H]: the rows every PE sent to this PE's experts,
    # grouped by local expert; d.tokens_per_expert [L] int64, d.offsets
    # [L + 1] int64 (expert l's rows start at d.offsets[l])
    y = xt.ep_combine(group, expert_fn(d.rows), probs)   # [T, H]

Both ops are differentiable (``x``, ``probs`` and the experts' rows)
through xcall's backward calls, have fake implementations whose shapes
come from the group's sizes (``torch.compile(fullgraph=True)`` traces
them), and enqueue on ``torch.cuda.current_stream()`` with no wait on
the host (a CUDA graph captures them). CPU tensors run on Host: each call
finishes before it returns.

**Groups.** :class:`EpGroup` is collective: every rank makes it with the
same arguments, in the same order. It lives in an xcall shmem world of
the ranks (:class:`EpWorld`; one host: Unix-socket bootstrap, then CUDA
IPC between the processes' GPUs, or shared memory on Host) made from the
process group's ranks, or from the launcher's ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK`` (the socket's name from ``MASTER_ADDR``,
``MASTER_PORT`` and the run's id). ``close()`` (collective) frees it;
groups and worlds still open at exit are closed then, last made first.

**One group per layer.** Combine and the backward calls act on the
group's last dispatch: each MoE layer of a model has its own group
(a second dispatch on a group before the first one's backward makes that
backward wrong). A device takes part in one world at a time, so several
groups share one: ``w = EpWorld(heap_bytes)`` with the sum of their
:func:`group_heap_bytes`, then ``EpGroup(..., world=w)``. A group made
without a world starts its own, for itself alone.

**Rows.** ``d.rows`` has the worst-case rows of the group
(``group.expert_rows``). Rows no route fills are zero (``zero_unused=True``,
the default; False skips that write when the experts work row by row);
the rows' gradient is zero there always.

**Tokens written where dispatch sends them from.** Peers read a rank's
tokens from the group's send rows, into which dispatch copies ``x``;
``x = group.send_rows(T)`` is that memory as a tensor, and an ``x``
written there (``torch.add(a, b, out=x)``, ``x.copy_(...)``) is sent with
no copy.

Bad input (a wrong dtype or device, shapes that disagree with the group,
non-contiguous tensors) raises ``TypeError`` or ``ValueError`` before
anything is written; an error of xcall raises :class:`XcallError` with
xcall's message (a config xcall refuses, ``k > E`` included, when the
group is made).
"""

import atexit
import ctypes
import hashlib
import itertools
import os
import sys
import tempfile
import threading
from typing import NamedTuple

import torch

from . import load_library
from ._ep_abi import EpConfig as _Config
from ._ep_abi import EpSizes as _Sizes

__all__ = [
    "EpDispatch",
    "EpGroup",
    "EpWorld",
    "XcallError",
    "close_all",
    "ep_combine",
    "ep_dispatch",
    "group_heap_bytes",
]

_PLATFORM_HOST, _PLATFORM_CUDA = 0, 1
_BOOTSTRAP_UNIX_SOCKET = 1
_PRECISION = {torch.float32: 0, torch.bfloat16: 1}
# Heap a world takes for itself beside its groups.
_WORLD_SLACK_BYTES = 4 << 20


class XcallError(RuntimeError):
    """An xcall call failed: ``status`` is its ``xcall_status`` name,
    the message xcall's own."""

    def __init__(self, what: str, status: str, message: str):
        super().__init__(f"xcall.torch: {what}: {status}: {message}")
        self.status = status
        self.message = message


class _ExpertMajor(ctypes.Structure):
    """``xcall_ep_expert_major``."""

    _fields_ = [
        ("rows", ctypes.c_void_p),
        ("rows_bytes", ctypes.c_uint64),
        ("scales", ctypes.c_void_p),
        ("scales_bytes", ctypes.c_uint64),
        ("rows_bf16", ctypes.c_void_p),
        ("rows_bf16_bytes", ctypes.c_uint64),
        ("tokens_per_expert", ctypes.c_void_p),
        ("tokens_per_expert_bytes", ctypes.c_uint64),
        ("padded_per_expert", ctypes.c_void_p),
        ("padded_per_expert_bytes", ctypes.c_uint64),
        ("offsets", ctypes.c_void_p),
        ("offsets_bytes", ctypes.c_uint64),
    ]


class _Target(ctypes.Structure):
    """``xcall_target``."""

    _fields_ = [
        ("platform", ctypes.c_uint32),
        ("ordinal", ctypes.c_uint32),
        ("stream", ctypes.c_void_p),
    ]


class _WorldConfig(ctypes.Structure):
    """``xcall_shmem_config``."""

    _fields_ = [
        ("rank", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("target", _Target),
        ("bootstrap", ctypes.c_uint32),
        ("address", ctypes.c_char_p),
        ("heap_bytes", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_uint64),
        ("pairs", ctypes.c_uint32),
    ]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _library() -> ctypes.CDLL:
    """libxcall with the signatures of the calls this module makes."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        lib = load_library()
        p, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
        pu64 = ctypes.POINTER(ctypes.c_uint64)
        signatures = {
            "xcall_status_name": ([u32], ctypes.c_char_p),
            "xcall_last_error_message": ([], ctypes.c_char_p),
            "xcall_ep_layout": ([ctypes.POINTER(_Config), u32, ctypes.POINTER(_Sizes)], u32),
            "xcall_shmem_world_new": ([ctypes.POINTER(p)], u32),
            "xcall_shmem_init": ([p, ctypes.POINTER(_WorldConfig)], u32),
            "xcall_shmem_finalize": ([p, pu64], u32),
            "xcall_shmem_world_free": ([p], None),
            "xcall_ep_group_new": ([p, ctypes.POINTER(_Config), ctypes.POINTER(p)], u32),
            "xcall_ep_group_free": ([p, p], u32),
            "xcall_ep_dispatch": (
                [p, p, u64, p, u64, p, u64, u64, ctypes.POINTER(_ExpertMajor), p],
                u32,
            ),
            "xcall_ep_combine": ([p, p, u64, p, u64, p], u32),
            "xcall_ep_dispatch_backward": ([p, p, u64, p, u64, p], u32),
            "xcall_ep_combine_backward": ([p, p, u64, p, u64, p, u64, p, u64, p], u32),
            "xcall_ep_dropped_routes": ([p, pu64], u32),
            "xcall_ep_send_rows": ([p, ctypes.POINTER(p), pu64], u32),
            "xcall_ep_check": ([p], u32),
        }
        for name, (args, res) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = res
        _lib = lib
        return lib


def _check(status: int, what: str) -> None:
    """Raises :class:`XcallError` with xcall's message for a failed call
    (read on the calling thread, right after the call)."""
    if status != 0:
        lib = _library()
        message = lib.xcall_last_error_message().decode(errors="replace")
        raise XcallError(what, lib.xcall_status_name(status).decode(), message)


# Live groups by id: the ops name their group by this integer (a custom
# op's arguments are tensors and scalars).
_groups = {}
_worlds = {}
_group_ids = itertools.count(1)
_groups_lock = threading.Lock()
# Groups made from the launcher's variables in this process, in order:
# part of their socket's name, the same on every rank.
_env_groups = itertools.count()


def _socket_path(key: str, n: int) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"xcall-ep-{digest}-{n}.sock")


class EpWorld:
    """The ranks' shmem world on this rank's device, which the groups live
    in (collective: every rank makes it with the same arguments). A device
    takes part in one world at a time: make one, sized for every group
    (one per MoE layer) with :func:`group_heap_bytes`, before the groups
    (``EpGroup(..., world=w)``). Without one, a group starts a world of its
    own, closed with it.

    ``heap_bytes``: the symmetric heap of each rank (0: xcall's default,
    ``XCALL_SHMEM_HEAP_BYTES`` else 64 MiB on Host and 1 GiB on a GPU).
    The ranks: ``process_group`` (a ``torch.distributed`` group of ranks of
    this host), else the default process group when one is initialized,
    else ``RANK`` and ``WORLD_SIZE``. ``device``: the rank's device
    (default: ``cuda:LOCAL_RANK`` when CUDA is available, modulo the
    visible GPUs: with more processes than GPUs, processes share a GPU and
    take turns on it, which checks a layer of many ranks on one GPU but
    times the turns; else ``cpu``).
    ``address``: the Unix socket the ranks meet at (default: agreed through
    the process group, or named from ``MASTER_ADDR``, ``MASTER_PORT`` and
    the launcher's run id). ``timeout_s``: how long any wait on a peer may
    take before it fails naming the peer (0: xcall's 60 s).
    """

    def __init__(
        self,
        heap_bytes: int = 0,
        *,
        device=None,
        process_group=None,
        address: str | None = None,
        timeout_s: float = 0,
    ):
        self._world = None
        self._groups: list[EpGroup] = []
        if not isinstance(heap_bytes, int) or heap_bytes < 0:
            raise ValueError(
                f"xcall.torch.EpWorld: heap_bytes must be an int >= 0, got {heap_bytes!r}"
            )
        if timeout_s < 0:
            raise ValueError(f"xcall.torch.EpWorld: timeout_s must be >= 0, got {timeout_s}")
        self.rank, self.size, key = _ranks(process_group)
        self.device = _device(device)
        if address is None:
            address = _agree_address(process_group, key, self.rank)
        self.address = address
        cuda = self.device.type == "cuda"
        wc = _WorldConfig()
        wc.rank, wc.size = self.rank, self.size
        wc.target = _Target(
            _PLATFORM_CUDA if cuda else _PLATFORM_HOST,
            self.device.index if cuda else self.rank,
            None,
        )
        wc.bootstrap = _BOOTSTRAP_UNIX_SOCKET
        wc.address = address.encode()
        wc.heap_bytes = heap_bytes
        wc.timeout_ms = int(timeout_s * 1000)
        lib = _library()
        world = ctypes.c_void_p()
        _check(lib.xcall_shmem_world_new(ctypes.byref(world)), "making the world")
        try:
            _check(
                lib.xcall_shmem_init(world, ctypes.byref(wc)),
                f"starting the world of {self.size} ranks at {address} (rank {self.rank})",
            )
        except BaseException:
            lib.xcall_shmem_world_free(world)
            raise
        self._world = world
        with _groups_lock:
            self.id = next(_group_ids)
            _worlds[self.id] = self

    def __repr__(self) -> str:
        return f"EpWorld(rank {self.rank} of {self.size}, {self.device}{'' if self._world else ', closed'})"

    @property
    def closed(self) -> bool:
        return self._world is None

    def close(self) -> None:
        """Closes the world's open groups (last made first), then the world
        (collective). Closing twice does nothing."""
        if self._world is None:
            return
        for g in reversed(list(self._groups)):
            g.close()
        with _groups_lock:
            _worlds.pop(self.id, None)
        lib = _library()
        world, self._world = self._world, None
        try:
            _check(lib.xcall_shmem_finalize(world, None), "finalizing the world")
        finally:
            lib.xcall_shmem_world_free(world)

    def __enter__(self) -> "EpWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _config(tokens, hidden, topk, experts, dtype, align, capacity, num_sms) -> _Config:
    if dtype not in _PRECISION:
        raise TypeError(
            f"xcall.torch.EpGroup: dtype must be torch.float32 or torch.bfloat16, got {dtype}"
        )
    if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
        raise ValueError(
            f"xcall.torch.EpGroup: capacity must be None (dropless) or an int above 0, got {capacity!r}"
        )
    for name, value in (
        ("tokens", tokens),
        ("hidden", hidden),
        ("topk", topk),
        ("experts", experts),
        ("align", align),
        ("num_sms", num_sms),
    ):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"xcall.torch.EpGroup: {name} must be an int >= 0, got {value!r}")
    return _Config(tokens, hidden, topk, experts, align, capacity or 0, _PRECISION[dtype], num_sms)


def _layout(config: _Config, ranks: int) -> _Sizes:
    sizes = _Sizes()
    _check(
        _library().xcall_ep_layout(ctypes.byref(config), ranks, ctypes.byref(sizes)),
        f"the group's config on {ranks} ranks",
    )
    return sizes


def group_heap_bytes(
    ranks: int,
    tokens: int,
    hidden: int,
    topk: int,
    experts: int,
    dtype: torch.dtype = torch.bfloat16,
    align: int = 1,
    capacity: int | None = None,
) -> int:
    """Bytes of symmetric heap a group of this shape on ``ranks`` ranks
    takes on each rank, with the world's own share: size an
    :class:`EpWorld` with the sum over its groups. Nothing is made."""
    sizes = _layout(_config(tokens, hidden, topk, experts, dtype, align, capacity, 0), ranks)
    return sizes.heap_bytes + _WORLD_SLACK_BYTES


class EpGroup:
    """One rank's part of an expert-parallel group (collective: every rank
    makes it with the same arguments, in the same order).

    ``tokens`` (``T``): most tokens a rank dispatches at once; ``hidden``
    (``H``): a token row's elements (whole 16-byte vectors); ``topk``
    (``k``, at most 32 and at most ``experts``); ``experts`` (``E``, a
    multiple of the rank count); ``dtype``: ``torch.float32`` or
    ``torch.bfloat16`` (tokens and expert rows; probs are float32, ids
    int32); ``align``: each expert's rows start on a multiple of it (128
    suits grouped GEMMs); ``capacity``: ``None`` for dropless, else the
    rows each local expert may receive (the rest dropped and counted,
    :meth:`dropped_routes`); ``num_sms``: SMs the exchange kernels may
    occupy on a GPU (0: as many as help).

    ``world``: the :class:`EpWorld` it lives in (one per device; needed
    for several groups at once). Without it the group starts a world of
    its own, with the keyword arguments of :class:`EpWorld` (``device``,
    ``process_group``, ``address``, ``timeout_s``) and the heap it needs,
    and closes it with the group.
    """

    def __init__(
        self,
        tokens: int,
        hidden: int,
        topk: int,
        experts: int,
        dtype: torch.dtype = torch.bfloat16,
        align: int = 1,
        capacity: int | None = None,
        num_sms: int = 0,
        *,
        world: EpWorld | None = None,
        **world_args,
    ):
        self._group = None
        self._own_world = None
        self._config = _config(tokens, hidden, topk, experts, dtype, align, capacity, num_sms)
        if world is not None:
            if world_args:
                raise ValueError(
                    f"xcall.torch.EpGroup: {sorted(world_args)} belong to the world given"
                )
            if world.closed:
                raise ValueError(f"xcall.torch.EpGroup: {world!r} is closed")
            sizes = _layout(self._config, world.size)
        else:
            unknown = set(world_args) - {"device", "process_group", "address", "timeout_s"}
            if unknown:
                raise TypeError(f"xcall.torch.EpGroup: unknown arguments {sorted(unknown)}")
            # The config is checked before any rank waits for another.
            size = _ranks(world_args.get("process_group"))[1]
            sizes = _layout(self._config, size)
            world = self._own_world = EpWorld(sizes.heap_bytes + _WORLD_SLACK_BYTES, **world_args)
        self.world = world
        self.rank, self.size, self.device = world.rank, world.size, world.device
        self.dtype = dtype
        self.tokens, self.hidden, self.topk, self.experts = tokens, hidden, topk, experts
        self.align, self.capacity, self.num_sms = align, capacity, num_sms
        self._sizes = sizes
        self.local_experts = sizes.local_experts
        self.expert_rows = sizes.expert_rows
        group = ctypes.c_void_p()
        try:
            _check(
                _library().xcall_ep_group_new(
                    world._world, ctypes.byref(self._config), ctypes.byref(group)
                ),
                "making the expert-parallel group",
            )
        except BaseException:
            if self._own_world is not None:
                self._own_world.close()
            raise
        self._group = group
        world._groups.append(self)
        with _groups_lock:
            self.id = next(_group_ids)
            _groups[self.id] = self

    def __repr__(self) -> str:
        return (
            f"EpGroup(rank {self.rank} of {self.size}, T={self.tokens}, H={self.hidden}, "
            f"k={self.topk}, E={self.experts}, {self.dtype}, align={self.align}, "
            f"capacity={self.capacity}, {self.device}{'' if self._group else ', closed'})"
        )

    @property
    def closed(self) -> bool:
        return self._group is None

    def _handle(self) -> ctypes.c_void_p:
        if self._group is None:
            raise ValueError(f"xcall.torch: {self!r} is closed")
        return self._group

    def _stream(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device).cuda_stream
        return None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self) -> None:
        """Waits for this rank's stream, then raises :class:`XcallError`
        for the first error the group's GPU calls met since the last check
        (a peer that timed out, ids that were not routed). Host calls
        raise their errors themselves."""
        g = self._handle()
        self._sync()
        _check(_library().xcall_ep_check(g), "a GPU call of the group")

    def send_rows(self, tokens: int | None = None) -> torch.Tensor:
        """``[tokens, H]`` (default: the group's ``T``) of this rank's send
        rows, the group's dtype on its device: the group's own memory, from
        which its peers read what this rank dispatches. Tokens written here
        and passed as ``x`` to :func:`ep_dispatch` are sent from where they
        are, saving dispatch its copy of ``x`` (one read and one write of
        ``x``). The rows are the group's: write them after the calls that
        read the previous ones (on the same stream, any later call of the
        group), and expect them overwritten by the group's next dispatch of
        another ``x`` and by a backward pass through :func:`ep_combine`
        (it sends its gradient from here). The tensor is valid while the
        group is open. ``x`` must start at the first row: a slice further
        in raises :class:`XcallError`."""
        g = self._handle()
        if tokens is None:
            tokens = self.tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= self.tokens:
            raise ValueError(
                f"xcall.torch.EpGroup.send_rows: tokens must be an int in 0..{self.tokens}, "
                f"got {tokens!r}"
            )
        addr, nbytes = ctypes.c_void_p(), ctypes.c_uint64()
        _check(
            _library().xcall_ep_send_rows(g, ctypes.byref(addr), ctypes.byref(nbytes)),
            "the group's send rows",
        )
        elem = torch.empty((), dtype=self.dtype).element_size()
        if nbytes.value != self.tokens * self.hidden * elem:
            raise XcallError(
                "the group's send rows",
                "INTERNAL",
                f"{nbytes.value} bytes, not the [{self.tokens}, {self.hidden}] rows of {self.dtype}",
            )
        return _rows_at(addr.value, tokens, self.hidden, self.dtype, self.device, self)

    def dropped_routes(self) -> int:
        """Routes this rank's experts dropped by the capacity, summed over
        every dispatch so far (waits for this rank's stream)."""
        g = self._handle()
        self._sync()
        out = ctypes.c_uint64()
        _check(_library().xcall_ep_dropped_routes(g, ctypes.byref(out)), "dropped routes")
        return out.value

    def close(self) -> None:
        """Frees the group, and the world it started (collective: every
        rank closes its groups in the same order). Closing twice does
        nothing."""
        if self._group is None:
            return
        with _groups_lock:
            _groups.pop(self.id, None)
        group, self._group = self._group, None
        self.world._groups.remove(self)
        try:
            self._sync()
            _check(_library().xcall_ep_group_free(group, self.world._world), "freeing the group")
        finally:
            if self._own_world is not None:
                self._own_world.close()

    def __enter__(self) -> "EpGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _DeviceRows:
    """A CUDA array interface over rows xcall owns; the tensor made from it
    keeps it, and through it the group, alive."""

    def __init__(self, addr: int, shape: tuple[int, int], typestr: str, owner):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (addr, False),
            "strides": None,
            "version": 2,
        }
        self._owner = owner


def _rows_at(addr: int, rows: int, hidden: int, dtype: torch.dtype, device, owner) -> torch.Tensor:
    """A ``[rows, hidden]`` tensor of ``dtype`` over memory at ``addr`` (no
    copy): bf16, which the array interfaces cannot name, as 2-byte ints
    viewed as bf16."""
    if rows == 0:
        return torch.empty((0, hidden), dtype=dtype, device=device)
    raw, typestr = (torch.int16, "<i2") if dtype == torch.bfloat16 else (torch.float32, "<f4")
    if device.type == "cuda":
        t = torch.as_tensor(_DeviceRows(addr, (rows, hidden), typestr, owner), device=device)
    else:
        count = rows * hidden
        buf = (ctypes.c_byte * (count * raw.itemsize)).from_address(addr)
        t = torch.frombuffer(buf, dtype=raw, count=count).view(rows, hidden)
    if t.data_ptr() != addr:
        raise XcallError("the group's send rows", "INTERNAL", "torch copied them instead of viewing")
    return t.view(dtype)


def close_all() -> None:
    """Closes every open group and world of this process, last made first
    (run at exit; collective like :meth:`EpGroup.close`)."""
    with _groups_lock:
        live = sorted(list(_groups.values()) + list(_worlds.values()), key=lambda g: -g.id)
    for g in live:
        try:
            g.close()
        except Exception as e:  # noqa: BLE001 - at exit: report, go on
            print(f"xcall.torch: closing {g!r} at exit: {e}", file=sys.stderr)


atexit.register(close_all)


def _ranks(process_group) -> tuple[int, int, str]:
    """(rank, size, key naming the launch) from the process group, or the
    launcher's variables."""
    import torch.distributed as dist

    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("xcall.torch.EpWorld: this process is not a rank of process_group")
        return rank, dist.get_world_size(process_group), ""
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise ValueError(
            "xcall.torch.EpGroup: no process group and no launcher variables "
            f"({', '.join(missing)} unset): run under torchrun, initialize torch.distributed "
            "or pass process_group="
        )
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    key = "|".join(
        os.environ.get(v, "")
        for v in (
            "TORCHELASTIC_RUN_ID",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT",
            "WORLD_SIZE",
        )
    )
    return rank, size, key


def _device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            index = os.environ.get("LOCAL_RANK")
            if index is None:
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cuda", int(index) % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"xcall.torch.EpGroup: device must be cuda or cpu, got {device}")
    return device


def _agree_address(process_group, key: str, rank: int) -> str:
    """The socket every rank of the group meets at: rank 0's choice, sent
    through the process group, or a name made from the launch's key."""
    if key:
        return _socket_path(key, next(_env_groups))
    import torch.distributed as dist

    box: list[str | None] = [None]
    if rank == 0:
        box[0] = _socket_path(os.urandom(16).hex(), 0)
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=process_group)
    return box[0]


def _group(group_id: int) -> EpGroup:
    g = _groups.get(group_id)
    if g is None:
        raise ValueError(f"xcall.torch: no open expert-parallel group {group_id} (closed?)")
    return g


def _need(
    op: str, name: str, t: torch.Tensor, g: EpGroup, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """Raises before any work when ``t`` is not what the op takes."""
    if t.dtype != dtype:
        raise TypeError(f"xcall.torch.{op}: {name} must be {dtype}, got {t.dtype}")
    if t.device != g.device:
        raise ValueError(f"xcall.torch.{op}: {name} is on {t.device}, the group on {g.device}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"xcall.torch.{op}: {name} must be {list(shape)} for {g!r}, got {list(t.shape)}"
        )
    if not t.is_contiguous():
        raise ValueError(f"xcall.torch.{op}: {name} must be contiguous (strides {t.stride()})")


def _tokens_of(op: str, x: torch.Tensor, g: EpGroup) -> int:
    if x.dim() != 2:
        raise ValueError(f"xcall.torch.{op}: x must be [tokens, {g.hidden}], got {list(x.shape)}")
    tokens = x.shape[0]
    if tokens > g.tokens:
        raise ValueError(f"xcall.torch.{op}: {tokens} tokens, the group takes at most {g.tokens}")
    return tokens


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- the ops


def _check_dispatch(g: EpGroup, x, ids, probs) -> int:
    tokens = _tokens_of("ep_dispatch", x, g)
    _need("ep_dispatch", "x", x, g, g.dtype, (tokens, g.hidden))
    _need("ep_dispatch", "ids", ids, g, torch.int32, (tokens, g.topk))
    _need("ep_dispatch", "probs", probs, g, torch.float32, (tokens, g.topk))
    return tokens


def _dispatch_outputs(g: EpGroup, like: torch.Tensor, zero_unused: bool):
    rows_shape = (g.expert_rows, g.hidden)
    rows = (like.new_zeros if zero_unused else like.new_empty)(rows_shape)
    tpe = like.new_empty((g.local_experts,), dtype=torch.int64)
    offsets = like.new_empty((g.local_experts + 1,), dtype=torch.int64)
    return rows, tpe, offsets


@torch.library.custom_op("xcall::ep_dispatch", mutates_args=())
def _dispatch_op(
    group: int, x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, zero_unused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _group(group)
    tokens = _check_dispatch(g, x, ids, probs)
    rows, tpe, offsets = _dispatch_outputs(g, x, zero_unused)
    out = _ExpertMajor()
    out.rows, out.rows_bytes = rows.data_ptr(), _bytes(rows)
    out.tokens_per_expert, out.tokens_per_expert_bytes = tpe.data_ptr(), _bytes(tpe)
    out.offsets, out.offsets_bytes = offsets.data_ptr(), _bytes(offsets)
    _check(
        _library().xcall_ep_dispatch(
            g._handle(),
            _ptr(x),
            _bytes(x),
            _ptr(ids),
            _bytes(ids),
            _ptr(probs),
            _bytes(probs),
            tokens,
            ctypes.byref(out),
            g._stream(),
        ),
        f"dispatch (rank {g.rank})",
    )
    return rows, tpe, offsets


@_dispatch_op.register_fake
def _(group, x, ids, probs, zero_unused):
    g = _group(group)
    _check_dispatch(g, x, ids, probs)
    return _dispatch_outputs(g, x, zero_unused)


def _check_combine(g: EpGroup, expert_out, probs) -> int:
    if probs.dim() != 2:
        raise ValueError(
            f"xcall.torch.ep_combine: probs must be [tokens, {g.topk}], got {list(probs.shape)}"
        )
    tokens = probs.shape[0]
    if tokens > g.tokens:
        raise ValueError(
            f"xcall.torch.ep_combine: {tokens} tokens, the group takes at most {g.tokens}"
        )
    _need("ep_combine", "probs", probs, g, torch.float32, (tokens, g.topk))
    _need("ep_combine", "expert_out", expert_out, g, g.dtype, (g.expert_rows, g.hidden))
    return tokens


@torch.library.custom_op("xcall::ep_combine", mutates_args=())
def _combine_op(group: int, expert_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    g = _group(group)
    tokens = _check_combine(g, expert_out, probs)
    y = expert_out.new_empty((tokens, g.hidden))
    _check(
        _library().xcall_ep_combine(
            g._handle(), _ptr(expert_out), _bytes(expert_out), _ptr(y), _bytes(y), g._stream()
        ),
        f"combine (rank {g.rank})",
    )
    return y


@_combine_op.register_fake
def _(group, expert_out, probs):
    g = _group(group)
    tokens = _check_combine(g, expert_out, probs)
    return expert_out.new_empty((tokens, g.hidden))


@torch.library.custom_op("xcall::ep_dispatch_backward", mutates_args=())
def _dispatch_backward_op(group: int, grad_rows: torch.Tensor, tokens: int) -> torch.Tensor:
    g = _group(group)
    _need("ep_dispatch_backward", "grad_rows", grad_rows, g, g.dtype, (g.expert_rows, g.hidden))
    grad_x = grad_rows.new_empty((tokens, g.hidden))
    _check(
        _library().xcall_ep_dispatch_backward(
            g._handle(),
            _ptr(grad_rows),
            _bytes(grad_rows),
            _ptr(grad_x),
            _bytes(grad_x),
            g._stream(),
        ),
        f"dispatch backward (rank {g.rank})",
    )
    return grad_x


@_dispatch_backward_op.register_fake
def _(group, grad_rows, tokens):
    g = _group(group)
    return grad_rows.new_empty((tokens, g.hidden))


@torch.library.custom_op("xcall::ep_combine_backward", mutates_args=())
def _combine_backward_op(
    group: int, grad_y: torch.Tensor, expert_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = _group(group)
    tokens = grad_y.shape[0]
    _need("ep_combine_backward", "grad_y", grad_y, g, g.dtype, (tokens, g.hidden))
    _need("ep_combine_backward", "expert_out", expert_out, g, g.dtype, (g.expert_rows, g.hidden))
    # Padding and unused rows are not written: zero, so they add nothing
    # to the experts' weight gradients.
    grad_out = torch.zeros_like(expert_out)
    grad_probs = grad_y.new_empty((tokens, g.topk), dtype=torch.float32)
    _check(
        _library().xcall_ep_combine_backward(
            g._handle(),
            _ptr(grad_y),
            _bytes(grad_y),
            _ptr(expert_out),
            _bytes(expert_out),
            _ptr(grad_out),
            _bytes(grad_out),
            _ptr(grad_probs),
            _bytes(grad_probs),
            g._stream(),
        ),
        f"combine backward (rank {g.rank})",
    )
    return grad_out, grad_probs


@_combine_backward_op.register_fake
def _(group, grad_y, expert_out):
    g = _group(group)
    return torch.empty_like(expert_out), grad_y.new_empty(
        (grad_y.shape[0], g.topk), dtype=torch.float32
    )


def _dispatch_setup(ctx, inputs, output):
    ctx.group = inputs[0]
    ctx.tokens = inputs[1].shape[0]
    ctx.dtype = inputs[1].dtype


def _dispatch_backward(ctx, grad_rows, grad_tpe, grad_offsets):
    grad_x = None
    if grad_rows is not None and ctx.needs_input_grad[1]:
        grad_x = _dispatch_backward_op(ctx.group, grad_rows.to(ctx.dtype).contiguous(), ctx.tokens)
    return None, grad_x, None, None, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


def _combine_setup(ctx, inputs, output):
    ctx.group = inputs[0]
    ctx.save_for_backward(inputs[1])


def _combine_backward(ctx, grad_y):
    (expert_out,) = ctx.saved_tensors
    grad_out, grad_probs = _combine_backward_op(
        ctx.group, grad_y.to(expert_out.dtype).contiguous(), expert_out
    )
    return (
        None,
        grad_out if ctx.needs_input_grad[1] else None,
        grad_probs if ctx.needs_input_grad[2] else None,
    )


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# ------------------------------------------------------------ the API


class EpDispatch(NamedTuple):
    """What :func:`ep_dispatch` returns on each rank."""

    rows: torch.Tensor
    """``[group.expert_rows, H]``: the rows every rank sent to this rank's
    experts, grouped by local expert (in sender rank, token, top-k slot
    order within an expert)."""
    tokens_per_expert: torch.Tensor
    """``[L]`` int64: rows each local expert received (after the capacity)."""
    offsets: torch.Tensor
    """``[L + 1]`` int64: each local expert's first row (a multiple of the
    group's ``align``), then the end of the last one's."""

    def row_experts(self) -> torch.Tensor:
        """``[group.expert_rows]`` int64: each row's local expert, -1 for a
        row no route filled (padding, the unused tail). Computed on the
        device from the counts, with no wait on the host."""
        rows = torch.arange(self.rows.shape[0], device=self.offsets.device)
        local = self.tokens_per_expert.shape[0]
        # The last expert whose first row is at or before the row: the
        # offsets searched whole (offsets[0] is 0), not a slice of them,
        # which torch.compile's CUDA code searched from the slice's base
        # (torch 2.11: every row of expert 0 given expert 1).
        expert = (torch.searchsorted(self.offsets, rows, right=True) - 1).clamp(0, local - 1)
        filled = rows < self.offsets[expert] + self.tokens_per_expert[expert]
        return torch.where(filled, expert, torch.full_like(expert, -1))


def ep_dispatch(
    group: EpGroup,
    x: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    zero_unused: bool = True,
) -> EpDispatch:
    """Sends this rank's tokens ``x`` (``[tokens, H]``, the group's dtype,
    ``tokens <= group.tokens``) to the ranks hosting their experts ``ids``
    (``[tokens, k]`` int32, or int64 as ``torch.topk`` gives, -1: no
    route); ``probs`` (``[tokens, k]`` float32) weight the combine that
    follows (pass the same tensor to :func:`ep_combine`, which gives its
    gradient). Collective: every rank calls it. Differentiable in ``x``."""
    if not isinstance(group, EpGroup):
        raise TypeError(
            f"xcall.torch.ep_dispatch: group must be an EpGroup, got {type(group).__name__}"
        )
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.int64:
        ids = ids.to(torch.int32)
    rows, tpe, offsets = _dispatch_op(group.id, x, ids, probs.detach(), bool(zero_unused))
    return EpDispatch(rows, tpe, offsets)


def ep_combine(group: EpGroup, expert_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Each of this rank's tokens of the group's last dispatch becomes the
    sum of its experts' output rows (``expert_out``, ``[group.expert_rows,
    H]`` in the dispatch's layout) times its probs, ``[tokens, H]``.
    ``probs`` is the tensor given to that dispatch: its values are the ones
    dispatch sent; it carries their gradient. Collective. Differentiable
    in ``expert_out`` and ``probs``."""
    if not isinstance(group, EpGroup):
        raise TypeError(
            f"xcall.torch.ep_combine: group must be an EpGroup, got {type(group).__name__}"
        )
    return _combine_op(group.id, expert_out, probs)
