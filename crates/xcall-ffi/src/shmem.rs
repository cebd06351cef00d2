//! Long because each of the 20 C entry points of symmetric memory carries its whole C contract (the header text, "Bad input:" included) beside a short translating body.
//!
//! C ABI of symmetric memory (xcall-shmem).

use std::ffi::{c_char, c_void, CStr};
use std::sync::{MutexGuard, TryLockError};
use std::time::Duration;

use static_assertions::{assert_eq_align, assert_eq_size};
use xcall_core::{Device, Status};
use xcall_shmem::{
    BootstrapKind, Cmp, Incoming, Outgoing, Pairs, ShmemError, SignalOp, Transport, World,
    WorldConfig,
};

use crate::guard::{c_code, code_arg, ffi_call, out_ptr, FfiError};
use crate::handle::{self, Handle};
use crate::target::xcall_target;

assert_eq_size!(Cmp, u32);
assert_eq_align!(Cmp, u32);
assert_eq_size!(SignalOp, u32);
assert_eq_size!(xcall_shmem_config, [u64; 8]);
assert_eq_size!(xcall_shmem_outgoing, [u64; 4]);
assert_eq_size!(xcall_shmem_incoming, [u64; 3]);
assert_eq_align!(xcall_shmem_config, u64);

impl From<ShmemError> for FfiError {
    fn from(e: ShmemError) -> Self {
        FfiError::new(e.status(), e.to_string())
    }
}

/// One PE's handle on a world of symmetric memory. Owned by one PE (each
/// PE thread has its own).
///
/// What every call taking a world may return besides its own errors:
/// - `XCALL_STATUS_NULL_ARGUMENT` (NULL world), `XCALL_STATUS_INVALID_HANDLE`
///   (a world freed already, or not made by `xcall_shmem_world_new`);
/// - `XCALL_STATUS_BUSY`: another thread is inside a call on this handle
///   at that moment; nothing was done;
/// - `XCALL_STATUS_PEER_FAILED`: a PE of the world freed its handle while
///   live, or failed in finalize; transfers, signals, waits, barriers,
///   malloc and free refuse without touching memory, and finalize releases
///   this PE locally (returning this status once);
/// - `XCALL_STATUS_INVALID_ARGUMENT` for a transfer or signal whose range
///   is not inside one live allocation (freed already, or spanning two).
///
/// Freeing a handle while another thread is inside a call on it is not
/// detected.
pub struct xcall_shmem_world {
    inner: std::sync::Mutex<World>,
}

impl Handle for xcall_shmem_world {
    const TYPE: &'static str = "xcall_shmem_world";
}

/// How the PEs of a world find each other (`xcall_shmem_config.bootstrap`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bootstrap {
    /// PEs are threads of one process meeting by group name (`address`).
    InProcess = 0,
    /// PEs are processes of one host meeting at the Unix socket `address`.
    UnixSocket = 1,
    /// PEs are processes (or threads) meeting at the TCP `address`,
    /// `host:port`, where rank 0 listens: what a launcher exports as
    /// `MASTER_ADDR` and `MASTER_PORT`. A connection is admitted when it
    /// speaks xcall's hello for a world of the same size: use a trusted
    /// network. PEs on other hosts are reached through NCCL (CUDA worlds)
    /// or TCP connections (Host worlds), with `xcall_shmem_exchange`.
    Tcp = 2,
}

xcall_core::c_enum!(Bootstrap, "bootstrap kind", [InProcess, UnixSocket, Tcp]);

/// Which transport the pairs of a world take (`xcall_shmem_config.pairs`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairPolicy {
    /// `XCALL_SHMEM_TRANSPORT` (`auto`, `nccl` or `tcp`), else auto.
    Default = 0,
    /// The most direct transport per pair: a PE of this process by its
    /// address, of this host by shared memory or a CUDA IPC handle, of
    /// another host through NCCL (CUDA) or TCP connections (Host).
    Auto = 1,
    /// NCCL for every pair, a PE with itself included (CUDA only): one
    /// host runs the path of peers on other hosts.
    Nccl = 2,
    /// TCP connections for every pair but a PE with itself (Host only):
    /// one host runs the path of Host peers on other hosts.
    Tcp = 3,
}

xcall_core::c_enum!(PairPolicy, "transport policy", [Default, Auto, Nccl, Tcp]);

/// How this PE reaches a peer (`xcall_shmem_peer_transport`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerTransport {
    /// This PE, or a PE of this process: its address as is.
    SameProcess = 0,
    /// A Host heap of another process, in POSIX shared memory.
    HostSharedMemory = 1,
    /// A CUDA heap of another process, through its IPC handle.
    CudaIpc = 2,
    /// NCCL: not addressable (`xcall_shmem_ptr` gives NULL); data moves
    /// with `xcall_shmem_exchange` only.
    Nccl = 3,
    /// A TCP connection (Host): not addressable; data moves with
    /// `xcall_shmem_exchange` only.
    Tcp = 4,
    /// NCCL with one-sided puts (NCCL 2.29 and newer, where it can run
    /// them among the world's PEs): not addressable; `xcall_shmem_put`
    /// and `xcall_shmem_put_signal` with `XCALL_SHMEM_SIGNAL_OP_SET` reach
    /// the PE with no call on its side; gets and signal adds need
    /// `xcall_shmem_exchange`.
    NcclOneSided = 5,
}

/// One segment this PE sends in `xcall_shmem_exchange`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_shmem_outgoing {
    /// The receiving PE.
    pub pe: u64,
    /// This PE's data (on CUDA: device memory of this PE's device).
    pub src: *const c_void,
    /// Where it lands: a symmetric address (this PE's address of the
    /// object).
    pub dest: *mut c_void,
    /// Bytes.
    pub bytes: u64,
}

/// One segment this PE receives in `xcall_shmem_exchange`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_shmem_incoming {
    /// The sending PE.
    pub pe: u64,
    /// Where it lands in this PE's heap: the sender's `dest`.
    pub dest: *mut c_void,
    /// Bytes.
    pub bytes: u64,
}

/// The most segments one `xcall_shmem_exchange` takes on each side.
pub const XCALL_SHMEM_MAX_SEGMENTS: u64 = 1 << 20;

/// How a world starts. The device is explicit (never the calling thread's
/// current device): a CUDA ordinal, or on Host any ordinal naming the PE's
/// per-device slot (use the rank).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_shmem_config {
    /// This PE's rank in [0, size).
    pub rank: u32,
    /// Number of PEs.
    pub size: u32,
    /// The PE's device (its stream is ignored: the calls that enqueue
    /// take a stream of their own).
    pub target: xcall_target,
    /// An `xcall_shmem_bootstrap` value.
    pub bootstrap: BootstrapCode,
    /// Group name or socket path (NUL-terminated).
    pub address: *const c_char,
    /// Heap bytes per PE; 0: `XCALL_SHMEM_HEAP_BYTES`, else 64 MiB on Host
    /// and 1 GiB on CUDA.
    pub heap_bytes: u64,
    /// Timeout of every wait on other PEs in ms; 0: 60000.
    pub timeout_ms: u64,
    /// An `xcall_shmem_pairs` value; 0 (`XCALL_SHMEM_PAIRS_DEFAULT`):
    /// `XCALL_SHMEM_TRANSPORT`, else auto.
    pub pairs: PairPolicyCode,
}

/// The world behind a handle, held for this call: a handle another thread
/// is using right now is `Busy` (a PE's handle is not shared; this turns
/// the misuse into an error instead of a data race).
pub(crate) fn world<'a>(w: *mut xcall_shmem_world) -> Result<MutexGuard<'a, World>, FfiError> {
    let w = handle::get(w, "world")?;
    match w.inner.try_lock() {
        Ok(g) => Ok(g),
        // A panic caught inside an earlier call on this handle: the world's
        // own state is what that call left; later calls report its errors.
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => Err(FfiError::new(
            Status::Busy,
            "world is in use by another thread (a world handle belongs to one PE thread)",
        )),
    }
}

/// Creates a world handle in phase New into `*out_world`.
///
/// Bad input: NULL `out_world`: `XCALL_STATUS_NULL_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_shmem_world_new(out_world: *mut *mut xcall_shmem_world) -> Status {
    ffi_call!({
        let out = out_ptr(out_world, "out_world")?;
        *out = handle::publish(xcall_shmem_world {
            inner: std::sync::Mutex::new(World::new()),
        })?;
        Ok(())
    })
}

/// Frees a handle (NULL: no-op; a handle that is not live is left alone
/// and `xcall_last_error_message()` says so). A live world is released
/// without the collective steps of finalize: the world is marked failed, so
/// every other PE's later transfers, signals, waits and collectives return
/// `XCALL_STATUS_PEER_FAILED`, and this PE's heap stays mapped until no
/// peer of this process can reach it. Call `xcall_shmem_finalize` first.
/// A live world with NCCL pairs whose exchanges CUDA graphs still hold has
/// its communicator aborted on a thread of its own (the abort ends those
/// graphs' running kernels at once; NCCL frees the communicator once the
/// graphs are destroyed): destroy them, then call
/// `xcall_shmem_settle_aborts` before the process exits.
///
/// Bad input: NULL, a freed or foreign handle: left alone (the function
/// returns nothing; the last error message says what was ignored).
#[no_mangle]
pub extern "C" fn xcall_shmem_world_free(w: *mut xcall_shmem_world) {
    let _ = ffi_call!({
        drop(handle::release(w, "world")?);
        Ok(())
    });
}

/// Waits up to `timeout_ms` milliseconds for the NCCL communicators that
/// freed worlds left aborting (see `xcall_shmem_world_free`) to be freed,
/// and writes how many remain to `*out_left` (may be NULL); 0 at once when
/// none is. Call it before the process exits, once the graphs that held
/// them are destroyed: NCCL must not be torn down under an abort.
///
/// Bad input: a timeout above one hour: `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_shmem_settle_aborts(timeout_ms: u64, out_left: *mut u64) -> Status {
    ffi_call!({
        if timeout_ms > 3_600_000 {
            return Err(FfiError::new(
                Status::InvalidArgument,
                format!("timeout_ms {timeout_ms} is above one hour (3600000)"),
            ));
        }
        let left = xcall_shmem::nccl::settle_aborts(std::time::Duration::from_millis(timeout_ms));
        // SAFETY: NULL or a writable u64.
        if let Some(l) = unsafe { out_left.as_mut() } {
            *l = left as u64;
        }
        Ok(())
    })
}

/// Joins the world (collective). Errors: `XCALL_STATUS_INVALID_STATE`
/// (already live), `XCALL_STATUS_TIMEOUT` (a PE never arrived; names it),
/// `XCALL_STATUS_COLLECTIVE_MISMATCH` (PEs disagree on sizes),
/// `XCALL_STATUS_UNSUPPORTED` (a peer not directly reachable: names the
/// pair), `XCALL_STATUS_SYSTEM`, CUDA errors.
///
/// Bad input: the world rules of `xcall_shmem_world`; NULL config or config
/// strings: `XCALL_STATUS_NULL_ARGUMENT`; an unknown platform or bootstrap
/// kind, rank not below size, size 0 or above 65536, a heap size that
/// overflows when rounded: `XCALL_STATUS_INVALID_ARGUMENT`, before anything
/// is allocated.
#[no_mangle]
pub extern "C" fn xcall_shmem_init(
    w: *mut xcall_shmem_world,
    config: *const xcall_shmem_config,
) -> Status {
    ffi_call!({
        let mut w = world(w)?;
        // SAFETY: NULL or a valid config, per the documentation.
        let c = unsafe { config.as_ref() }
            .ok_or_else(|| FfiError::new(Status::NullArgument, "config is NULL"))?;
        if c.address.is_null() {
            return Err(FfiError::new(
                Status::NullArgument,
                "config->address is NULL",
            ));
        }
        // SAFETY: a NUL-terminated string, per the documentation.
        let address = unsafe { CStr::from_ptr(c.address) }
            .to_str()
            .map_err(|_| FfiError::new(Status::InvalidArgument, "config->address is not UTF-8"))?
            .to_string();
        let bootstrap = match c.bootstrap.get()? {
            Bootstrap::InProcess => BootstrapKind::InProcess { group: address },
            Bootstrap::UnixSocket => BootstrapKind::UnixSocket {
                path: address.into(),
            },
            Bootstrap::Tcp => BootstrapKind::Tcp { address },
        };
        let config = WorldConfig {
            rank: c.rank as usize,
            size: c.size as usize,
            device: Device::new(c.target.platform.get()?, c.target.ordinal),
            bootstrap,
            heap_bytes: (c.heap_bytes > 0).then_some(c.heap_bytes as usize),
            timeout: if c.timeout_ms == 0 {
                xcall_shmem::world::DEFAULT_TIMEOUT
            } else {
                Duration::from_millis(c.timeout_ms)
            },
            pairs: match c.pairs.get()? {
                PairPolicy::Default => None,
                PairPolicy::Auto => Some(Pairs::Auto),
                PairPolicy::Nccl => Some(Pairs::Nccl),
                PairPolicy::Tcp => Some(Pairs::Tcp),
            },
        };
        w.init(&config)?;
        Ok(())
    })
}

/// Leaves the world (collective); allocations still live are freed and
/// their count written to `*out_leaked` (may be NULL). The world is finalized
/// even when a step fails; `xcall_shmem_init` may start it again.
///
/// With NCCL pairs, destroy every CUDA graph (and executable graph) that
/// captured this world's exchanges first: NCCL does not finish a
/// communicator while one lives, so this PE is refused with
/// `XCALL_STATUS_INVALID_STATE` naming how many, its world left live
/// (destroy them, `xcall_graph_cache_clear` for an xcall graph cache's,
/// and finalize again before its peers time out).
///
/// Bad input: the world rules of `xcall_shmem_world`; a world that is not
/// live: `XCALL_STATUS_INVALID_STATE`.
#[no_mangle]
pub extern "C" fn xcall_shmem_finalize(w: *mut xcall_shmem_world, out_leaked: *mut u64) -> Status {
    ffi_call!({
        let report = world(w)?.finalize()?;
        // SAFETY: NULL or a writable u64.
        if let Some(l) = unsafe { out_leaked.as_mut() } {
            *l = report.leaked.len() as u64;
        }
        Ok(())
    })
}

/// This PE's rank in `*out_rank` and the world size in `*out_size`.
///
/// Bad input: the world rules of `xcall_shmem_world`; NULL outputs:
/// `XCALL_STATUS_NULL_ARGUMENT`; a world that is not live:
/// `XCALL_STATUS_INVALID_STATE`.
#[no_mangle]
pub extern "C" fn xcall_shmem_rank(
    w: *mut xcall_shmem_world,
    out_rank: *mut u32,
    out_size: *mut u32,
) -> Status {
    ffi_call!({
        let w = world(w)?;
        let (r, n) = (w.rank()? as u32, w.size()? as u32);
        let rank = out_ptr(out_rank, "out_rank")?;
        let size = out_ptr(out_size, "out_size")?;
        *rank = r;
        *size = n;
        Ok(())
    })
}

/// Allocates `bytes` on every PE (collective: same order, same sizes;
/// `XCALL_STATUS_COLLECTIVE_MISMATCH` on every PE otherwise); this PE's
/// address in `*out_ptr` (device memory on CUDA). `XCALL_STATUS_OUT_OF_MEMORY`
/// says whether the heap is exhausted or fragmented.
///
/// Bad input: the world rules of `xcall_shmem_world`; a size that overflows
/// when aligned: `XCALL_STATUS_INVALID_ARGUMENT` (0 bytes gets one minimal
/// block); a heap too small: `XCALL_STATUS_OUT_OF_MEMORY`; a world that is
/// not live: `XCALL_STATUS_INVALID_STATE`.
#[no_mangle]
pub extern "C" fn xcall_shmem_malloc(
    w: *mut xcall_shmem_world,
    bytes: u64,
    out_ptr: *mut *mut c_void,
) -> Status {
    ffi_call!({
        let mut w = world(w)?;
        let out = crate::guard::out_ptr(out_ptr, "out_ptr")?;
        *out = w.malloc(bytes as usize)? as *mut c_void;
        Ok(())
    })
}

/// Frees an object of `xcall_shmem_malloc` on every PE (collective).
///
/// Bad input: the world rules of `xcall_shmem_world`; an address that is
/// not the start of a live object: `XCALL_STATUS_INVALID_ARGUMENT` on this
/// PE (the peers then report `XCALL_STATUS_COLLECTIVE_MISMATCH` or a
/// timeout).
#[no_mangle]
pub extern "C" fn xcall_shmem_free(w: *mut xcall_shmem_world, ptr: *mut c_void) -> Status {
    ffi_call!({ Ok(world(w)?.free(ptr as u64)?) })
}

/// PE `pe`'s address of the object at `local` (this PE's address), or
/// NULL when `local` is not in the heap, `pe` is not a PE, or the world is
/// not live.
///
/// Bad input: NULL, never an error status (a NULL world or a handle that is
/// not live also gets NULL).
#[no_mangle]
pub extern "C" fn xcall_shmem_ptr(
    w: *mut xcall_shmem_world,
    pe: u32,
    local: *const c_void,
) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    let _ = ffi_call!({
        out = world(w)?
            .ptr(pe as usize, local as u64)
            .map_or(std::ptr::null_mut(), |a| a as *mut c_void);
        Ok(())
    });
    out
}

/// Copies `bytes` from `src` (this PE's memory) to the object at `dest` (a
/// symmetric address of this PE) on PE `pe`. Blocking.
///
/// A PE whose transport (`xcall_shmem_peer_transport`) is
/// `XCALL_SHMEM_TRANSPORT_NCCL_ONE_SIDED` is written with NCCL's one-sided
/// put (`src`: device memory; across hosts keep it in the symmetric heap,
/// which NCCL has registered), though not on a stream capturing a CUDA
/// graph (`XCALL_STATUS_UNSUPPORTED`: NCCL's captured one-sided puts need a
/// call on the receiving side); a PE reached through NCCL without it, or
/// through TCP, takes data only through `xcall_shmem_exchange`:
/// `XCALL_STATUS_UNSUPPORTED`.
///
/// Bad input: the world rules of `xcall_shmem_world`; a NULL `src` with
/// bytes > 0: `XCALL_STATUS_NULL_ARGUMENT`; `pe` not a PE or a destination
/// range not inside one live object: `XCALL_STATUS_INVALID_ARGUMENT`,
/// nothing copied.
#[no_mangle]
pub extern "C" fn xcall_shmem_put(
    w: *mut xcall_shmem_world,
    dest: *mut c_void,
    src: *const c_void,
    bytes: u64,
    pe: u32,
) -> Status {
    ffi_call!({
        check_src(src, bytes)?;
        // SAFETY: `src` readable for `bytes`, per the documentation.
        Ok(unsafe { world(w)?.put(dest as u64, src as u64, bytes as usize, pe as usize) }?)
    })
}

/// Copies `bytes` from the object at `src` (a symmetric address of this
/// PE) on PE `pe` to `dest` (this PE's memory). Blocking.
///
/// Bad input: as `xcall_shmem_put` (source range on the peer, NULL `dest`).
#[no_mangle]
pub extern "C" fn xcall_shmem_get(
    w: *mut xcall_shmem_world,
    dest: *mut c_void,
    src: *const c_void,
    bytes: u64,
    pe: u32,
) -> Status {
    ffi_call!({
        check_src(dest, bytes)?;
        // SAFETY: `dest` writable for `bytes`, per the documentation.
        Ok(unsafe { world(w)?.get(dest as u64, src as u64, bytes as usize, pe as usize) }?)
    })
}

/// `xcall_shmem_put` ordered on `stream` (a `CUstream` of this PE's
/// device); returns before the copy completes. On Host: blocking.
///
/// Bad input: as `xcall_shmem_put`; a stream of another device:
/// `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_shmem_put_nbi(
    w: *mut xcall_shmem_world,
    dest: *mut c_void,
    src: *const c_void,
    bytes: u64,
    pe: u32,
    stream: *mut c_void,
) -> Status {
    ffi_call!({
        check_src(src, bytes)?;
        // SAFETY: `src` readable until the stream ran the copy.
        Ok(unsafe {
            world(w)?.put_nbi(dest as u64, src as u64, bytes as usize, pe as usize, stream)
        }?)
    })
}

fn check_src(p: *const c_void, bytes: u64) -> Result<(), FfiError> {
    if p.is_null() && bytes > 0 {
        return Err(FfiError::new(
            Status::NullArgument,
            "a local buffer is NULL",
        ));
    }
    Ok(())
}

/// Completes this PE's outstanding operations; reports a wait on a CUDA
/// stream that timed out since the last quiet (`barrier_on_stream`, an
/// exchange's wait for a sender): `XCALL_STATUS_TIMEOUT`, naming what did
/// not come. Stream waits are kernels that give up after the world's
/// timeout, so a peer that never signals cannot hang a stream; an
/// exchange that timed out also fails the world.
///
/// Bad input: the world rules of `xcall_shmem_world`.
#[no_mangle]
pub extern "C" fn xcall_shmem_quiet(w: *mut xcall_shmem_world) -> Status {
    ffi_call!({ Ok(world(w)?.quiet()?) })
}

/// Returns once every PE called it (after quiet). Collective.
///
/// Bad input: the world rules of `xcall_shmem_world`; a peer in another
/// collective: `XCALL_STATUS_COLLECTIVE_MISMATCH` on every PE, naming each
/// PE's call.
#[no_mangle]
pub extern "C" fn xcall_shmem_barrier_all(w: *mut xcall_shmem_world) -> Status {
    ffi_call!({ Ok(world(w)?.barrier_all()?) })
}

/// The most bytes one PE may offer to `xcall_shmem_allgather` (16 MiB).
pub const XCALL_SHMEM_MAX_GATHER_BYTES: u64 = 16 << 20;
const _: () = assert!(XCALL_SHMEM_MAX_GATHER_BYTES == xcall_shmem::MAX_GATHER_BYTES as u64);

/// Every PE's `bytes` at `data` (host memory), by rank, through the
/// world's bootstrap: PE r's bytes land at `out + r * slot_bytes` and
/// their count in `out_lengths[r]`. For small host-side messages (sizes,
/// offsets, results to report), not the data path. Collective: every PE
/// calls it, in the same order as its other collectives, with the same
/// `slot_bytes`; the PEs' `bytes` may differ. `out` must hold `size *
/// slot_bytes` bytes and `out_lengths` `size` entries (`size` from
/// `xcall_shmem_rank`). Over a TCP or Unix socket bootstrap, every PE's
/// bytes together must fit in 1 GiB.
///
/// Bad input: refused before the collective (the peers then wait out
/// their timeout, as for a PE that never calls): the world rules of
/// `xcall_shmem_world`; NULL `data` with `bytes` above 0, NULL `out` with
/// `slot_bytes` above 0, NULL `out_lengths`: `XCALL_STATUS_NULL_ARGUMENT`;
/// `size * slot_bytes` past the address space:
/// `XCALL_STATUS_INVALID_ARGUMENT`. Refused on every PE after it, with
/// nothing written: a PE offering more than `XCALL_SHMEM_MAX_GATHER_BYTES`
/// or more than `slot_bytes`: `XCALL_STATUS_INVALID_ARGUMENT` naming it; a
/// peer in another collective: `XCALL_STATUS_COLLECTIVE_MISMATCH`.
#[no_mangle]
pub extern "C" fn xcall_shmem_allgather(
    w: *mut xcall_shmem_world,
    data: *const c_void,
    bytes: u64,
    out: *mut c_void,
    slot_bytes: u64,
    out_lengths: *mut u64,
) -> Status {
    // SAFETY: the caller's contract, as documented above.
    ffi_call!({ unsafe { allgather(w, data, bytes, out, slot_bytes, out_lengths) } })
}

/// The body of `xcall_shmem_allgather`.
///
/// # Safety
/// `data` holds `bytes` bytes (at most the first
/// `XCALL_SHMEM_MAX_GATHER_BYTES` are read), `out` `size * slot_bytes`
/// writable bytes and `out_lengths` `size` writable entries.
unsafe fn allgather(
    w: *mut xcall_shmem_world,
    data: *const c_void,
    bytes: u64,
    out: *mut c_void,
    slot_bytes: u64,
    out_lengths: *mut u64,
) -> Result<(), FfiError> {
    let mut w = world(w)?;
    let size = w.size()?;
    let total = allgather_args(data, bytes, out, slot_bytes, out_lengths, size)?;
    // Only what fits the limit is ever read; above it the call fails
    // on every PE without reading `data`.
    let readable = bytes.min(XCALL_SHMEM_MAX_GATHER_BYTES) as usize;
    let mine: &[u8] = if readable == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract: `data` holds `bytes` bytes,
        // of which this reads at most the first `readable`.
        unsafe { std::slice::from_raw_parts(data.cast(), readable) }
    };
    let all = w.allgather_offered(bytes, mine)?;
    // SAFETY: the caller's contract: `out_lengths` holds `size`
    // entries and `out` `size * slot_bytes` bytes (`total`, checked
    // to be a valid length); neither overlaps what was read.
    let lengths = unsafe { std::slice::from_raw_parts_mut(out_lengths, size) };
    let slots: &mut [u8] = if total == 0 {
        &mut []
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(out.cast(), total) }
    };
    place(&all, slot_bytes, slots, lengths)
}

/// `xcall_shmem_allgather`'s checks before the collective; the bytes of
/// `size` slots.
fn allgather_args(
    data: *const c_void,
    bytes: u64,
    out: *mut c_void,
    slot_bytes: u64,
    out_lengths: *mut u64,
    size: usize,
) -> Result<usize, FfiError> {
    check_src(data, bytes)?;
    if out.is_null() && slot_bytes > 0 {
        return Err(FfiError::new(Status::NullArgument, "out is NULL"));
    }
    if out_lengths.is_null() {
        return Err(FfiError::new(Status::NullArgument, "out_lengths is NULL"));
    }
    (size as u64)
        .checked_mul(slot_bytes)
        .and_then(|t| usize::try_from(t).ok())
        .filter(|&t| t <= isize::MAX as usize)
        .ok_or_else(|| {
            FfiError::new(
                Status::InvalidArgument,
                format!("{size} slots of {slot_bytes} bytes do not fit an address space"),
            )
        })
}

/// Every PE's bytes into its slot of `slot_bytes` and its length, or,
/// when some PE offered more than a slot, an error naming it and nothing
/// written.
fn place(
    all: &[Vec<u8>],
    slot_bytes: u64,
    slots: &mut [u8],
    lengths: &mut [u64],
) -> Result<(), FfiError> {
    if let Some((r, a)) = all
        .iter()
        .enumerate()
        .find(|(_, a)| a.len() as u64 > slot_bytes)
    {
        return Err(FfiError::new(
            Status::InvalidArgument,
            format!(
                "rank {r} offered {} bytes to allgather; the slots hold {slot_bytes}",
                a.len()
            ),
        ));
    }
    for (r, a) in all.iter().enumerate() {
        let at = r * slot_bytes as usize;
        slots[at..at + a.len()].copy_from_slice(a);
        lengths[r] = a.len() as u64;
    }
    Ok(())
}

/// A barrier of all PEs as a kernel on `stream` (CUDA worlds; capturable).
///
/// Bad input: the world rules of `xcall_shmem_world`; a Host world:
/// `XCALL_STATUS_UNSUPPORTED`.
#[no_mangle]
pub extern "C" fn xcall_shmem_barrier_on_stream(
    w: *mut xcall_shmem_world,
    stream: *mut c_void,
) -> Status {
    ffi_call!({ Ok(world(w)?.barrier_on_stream(stream)?) })
}

/// Puts like `xcall_shmem_put`, then updates the 64-bit word `signal` (a
/// symmetric address) on PE `pe` with `sig_op` (`XCALL_SHMEM_SIGNAL_OP_SET`
/// or `_ADD`) once the data is visible there. Blocking.
///
/// To a PE reached through NCCL's one-sided puts
/// (`XCALL_SHMEM_TRANSPORT_NCCL_ONE_SIDED`), `XCALL_SHMEM_SIGNAL_OP_SET`
/// only: the data and then the word are two puts that NCCL lands in that
/// order, so the peer that sees the value with `xcall_shmem_wait_until`
/// sees the data; the value is staged in one of 64 words of this PE's
/// heap, taken in turn (`_nbi` calls on different streams: at most 64 in
/// flight). `_ADD` there: `XCALL_STATUS_UNSUPPORTED`, nothing moved.
///
/// Bad input: as `xcall_shmem_put`; a signal word not inside a live object
/// or not 8-byte aligned, an unknown `sig_op`:
/// `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_shmem_put_signal(
    w: *mut xcall_shmem_world,
    dest: *mut c_void,
    src: *const c_void,
    bytes: u64,
    signal: *mut u64,
    value: u64,
    sig_op: SignalOpCode,
    pe: u32,
) -> Status {
    ffi_call!({
        check_src(src, bytes)?;
        let op = sig_op.get()?;
        // SAFETY: `src` readable for `bytes`.
        Ok(unsafe {
            world(w)?.put_signal(
                dest as u64,
                src as u64,
                bytes as usize,
                signal as u64,
                value,
                op,
                pe as usize,
            )
        }?)
    })
}

/// Waits until this PE's signal word `signal` compares `cmp`
/// (`XCALL_SHMEM_CMP_EQ`, ...) to `value`; the value seen goes to
/// `*out_observed` (may be NULL). `XCALL_STATUS_TIMEOUT` after the world's
/// timeout.
///
/// Bad input: the world rules of `xcall_shmem_world`; a signal word not
/// inside a live object or not 8-byte aligned, an unknown `cmp`:
/// `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_shmem_wait_until(
    w: *mut xcall_shmem_world,
    signal: *mut u64,
    cmp: CmpCode,
    value: u64,
    out_observed: *mut u64,
) -> Status {
    ffi_call!({
        let cmp = cmp.get()?;
        let seen = world(w)?.wait_until(signal as u64, cmp, value)?;
        // SAFETY: NULL or a writable u64.
        if let Some(o) = unsafe { out_observed.as_mut() } {
            *o = seen;
        }
        Ok(())
    })
}

/// How this PE reaches PE `pe`, as an `xcall_shmem_transport` value in
/// `*out_transport`.
///
/// Bad input: the world rules of `xcall_shmem_world`; NULL
/// `out_transport`: `XCALL_STATUS_NULL_ARGUMENT`; `pe` not a PE:
/// `XCALL_STATUS_INVALID_ARGUMENT`; a world that is not live:
/// `XCALL_STATUS_INVALID_STATE`.
#[no_mangle]
pub extern "C" fn xcall_shmem_peer_transport(
    w: *mut xcall_shmem_world,
    pe: u32,
    out_transport: *mut u32,
) -> Status {
    ffi_call!({
        let t = match world(w)?.transport(pe as usize)? {
            Transport::SameProcess => PeerTransport::SameProcess,
            Transport::HostSharedMemory => PeerTransport::HostSharedMemory,
            Transport::CudaIpc => PeerTransport::CudaIpc,
            Transport::Nccl => PeerTransport::Nccl,
            Transport::NcclOneSided => PeerTransport::NcclOneSided,
            Transport::Tcp => PeerTransport::Tcp,
        };
        *out_ptr(out_transport, "out_transport")? = t as u32;
        Ok(())
    })
}

/// Moves data between PEs in one collective step, on every transport (the
/// only way to a PE reached through NCCL): each outgoing segment copies
/// `bytes` from this PE's `src` to the object at `dest` on PE `pe`; each
/// incoming one is this PE's side of a peer's outgoing segment. PE `a`
/// lists an outgoing segment to `b` exactly when `b` lists an incoming one
/// from `a`, with the same bytes and `dest`, in the same order per pair.
/// With a NULL `stream`: blocking (every incoming segment landed). With a
/// `CUstream` of this PE's device: every copy, signal, wait and NCCL call
/// is enqueued there (capturable); on Host the stream is ignored.
///
/// Bad input: the world rules of `xcall_shmem_world`; NULL segment arrays
/// with counts above 0, a NULL `src` with bytes above 0:
/// `XCALL_STATUS_NULL_ARGUMENT`; more than `XCALL_SHMEM_MAX_SEGMENTS` on
/// a side, `pe` not a PE, a destination not inside one live object of the
/// heap: `XCALL_STATUS_INVALID_ARGUMENT`; every segment is checked before
/// anything moves. The PEs' lists meet before any data moves (the call
/// waits on the host for every PE, with a stream too): lists that
/// disagree (a segment only one side lists, other sizes, destinations or
/// order) give `XCALL_STATUS_COLLECTIVE_MISMATCH` on every PE, naming the
/// ranks and sizes; a segment one PE refuses fails the call on every PE
/// with that PE's status; either way nothing is written and nothing
/// carries over to a later exchange.
#[no_mangle]
pub extern "C" fn xcall_shmem_exchange(
    w: *mut xcall_shmem_world,
    outgoing: *const xcall_shmem_outgoing,
    outgoing_count: u64,
    incoming: *const xcall_shmem_incoming,
    incoming_count: u64,
    stream: *mut c_void,
) -> Status {
    ffi_call!({
        let out = segments(outgoing, outgoing_count, "outgoing")?;
        let inc = segments(incoming, incoming_count, "incoming")?;
        let pe = |p: u64| usize::try_from(p).unwrap_or(usize::MAX);
        let mut o = Vec::with_capacity(out.len());
        for s in out {
            check_src(s.src, s.bytes)?;
            o.push(Outgoing {
                pe: pe(s.pe),
                src: s.src as u64,
                dest: s.dest as u64,
                bytes: bytes_arg(s.bytes)?,
            });
        }
        let mut i = Vec::with_capacity(inc.len());
        for s in inc {
            i.push(Incoming {
                pe: pe(s.pe),
                dest: s.dest as u64,
                bytes: bytes_arg(s.bytes)?,
            });
        }
        let mut w = world(w)?;
        // SAFETY: every `src` readable for its bytes until the exchange
        // completes, per the documentation.
        Ok(unsafe {
            if stream.is_null() {
                w.exchange(&o, &i)
            } else {
                w.exchange_on_stream(&o, &i, stream)
            }
        }?)
    })
}

/// `count` segments at `p`, checked: NULL only when empty, at most
/// `XCALL_SHMEM_MAX_SEGMENTS`.
fn segments<'a, T>(p: *const T, count: u64, what: &str) -> Result<&'a [T], FfiError> {
    if count == 0 {
        return Ok(&[]);
    }
    if count > XCALL_SHMEM_MAX_SEGMENTS {
        return Err(FfiError::new(
            Status::InvalidArgument,
            format!("{count} {what} segments; at most {XCALL_SHMEM_MAX_SEGMENTS}"),
        ));
    }
    if p.is_null() {
        return Err(FfiError::new(
            Status::NullArgument,
            format!("{what} is NULL with {count} segments"),
        ));
    }
    // SAFETY: `count` (bounded above) readable segments at `p`, per the
    // documentation.
    Ok(unsafe { std::slice::from_raw_parts(p, count as usize) })
}

fn bytes_arg(b: u64) -> Result<usize, FfiError> {
    usize::try_from(b).map_err(|_| {
        FfiError::new(
            Status::InvalidArgument,
            format!("{b} bytes do not fit an address space"),
        )
    })
}

c_code!(
    /// An `xcall_shmem_pairs` as passed.
    PairPolicyCode => PairPolicy
);
c_code!(
    /// An `xcall_shmem_bootstrap` as passed.
    BootstrapCode => Bootstrap
);
c_code!(
    /// An `xcall_shmem_signal_op` as passed.
    SignalOpCode => SignalOp
);
c_code!(
    /// An `xcall_shmem_cmp` as passed.
    CmpCode => Cmp
);
