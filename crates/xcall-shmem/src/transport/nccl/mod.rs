//! NCCL, opened at run time: the transport of the pairs of a CUDA world
//! that are not directly addressable (peers on other hosts, or every pair
//! when `XCALL_SHMEM_TRANSPORT=nccl` forces it).
//!
//! Nothing links against NCCL: the library builds and runs without it, and
//! a world that needs it and cannot load it fails at init with the places
//! searched. The library is found, in this order:
//! 1. `XCALL_NCCL_LIB`: a file, or a folder holding `libnccl.so.2`
//!    (nothing else is tried when it is set);
//! 2. the dynamic loader's own search: `libnccl.so.2`, then `libnccl.so`
//!    (`LD_LIBRARY_PATH`, the ld.so cache);
//! 3. the NVIDIA Python wheels' `nvidia/nccl/lib/libnccl.so.2` (the NCCL
//!    that PyTorch and JAX install) under: the site-packages folder of
//!    xcall's own library when it was loaded from an installed `xcall`
//!    package, each `PYTHONPATH` entry, `$VIRTUAL_ENV` and
//!    `$CONDA_PREFIX`, `~/.local`, `/usr/local` and `/usr` (every
//!    `python3.*` folder of each).
//!
//! xcall needs NCCL 2.14 or newer: its communicators are non-blocking
//! (`blocking = 0`), so every wait on NCCL polls with the world's timeout
//! and a failed or silent peer aborts the communicator instead of hanging
//! the process. Data moves with two-sided `ncclSend`/`ncclRecv` groups on
//! every version (see `World::exchange`).
//!
//! NCCL 2.29 added host-initiated one-sided operations: memory windows
//! (`ncclCommWindowRegister` over memory from `ncclMemAlloc`) and
//! `ncclPutSignal`, whose writes to one peer land in the order they were
//! issued. When the loaded NCCL has them ([`Library::one_sided`]) and can
//! run them on a world's communicator, the world's heap is NCCL's memory,
//! registered as one window, and `World::put` and `World::put_signal` reach
//! a PE through NCCL with no call on its side (see `World::init`).
//!
//! NVLink SHARP stays off: before its first communicator xcall sets
//! `NCCL_NVLS_ENABLE=0` unless the caller set it (a multicast object can
//! take a shared host's GPUs out of service).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use xcall_core::cuda::ContextGuard;
use xcall_core::Device;

use crate::cuda::{sync, OwnStream};
use crate::error::{poll, Result, ShmemError};

mod library;
#[cfg(test)]
mod tests;

pub use library::{
    candidates, find, library, Library, Version, LIB_ENV, MIN_VERSION, UNIQUE_ID_BYTES,
};
use library::{
    nvls_off, CommConfig, NcclResult, RawComm, RawWindow, UniqueId, IN_PROGRESS, SUCCESS, UINT8,
    UNDEF_INT,
};

/// The target of the NCCL log lines: the module path they have always
/// had, so log filters keep selecting them.
const LOG_TARGET: &str = "xcall_shmem::nccl";

/// A new NCCL unique id (rank 0 makes it; the bootstrap spreads it).
pub fn unique_id(device: Device) -> Result<Vec<u8>> {
    let lib = library()?;
    nvls_off();
    let _ctx = ContextGuard::primary(device)?;
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: writes one ncclUniqueId.
    let r = unsafe { (lib.get_unique_id)(&mut id) };
    if r != SUCCESS {
        return Err(lib.error("ncclGetUniqueId", r, std::ptr::null_mut()));
    }
    Ok(id.internal.to_vec())
}

/// `ncclWindow_t` flags of a world's window: `NCCL_WIN_COLL_SYMMETRIC`
/// (every rank's heap has the same size and layout) and
/// `NCCL_WIN_STRICT_ORDERING` (over InfiniBand too, writes to a window land
/// in the order issued: a signal word after its data).
const WINDOW_FLAGS: c_int = 0x01 | 0x02;

/// `len` bytes of device memory on `device` from `ncclMemAlloc`: memory NCCL
/// can register as a window (and every GPU with peer access to `device`
/// may access). Freed with [`free`].
pub(crate) fn alloc(device: Device, len: usize) -> Result<u64> {
    let lib = library()?;
    let calls = lib.one_sided_calls()?;
    let _ctx = ContextGuard::primary(device)?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer; NCCL allocates on the current device,
    // which the guard made `device`.
    let r = unsafe { (calls.mem_alloc)(&mut p, len) };
    if r != SUCCESS || p.is_null() {
        return Err(lib
            .error("ncclMemAlloc", r, std::ptr::null_mut())
            .context(format!("symmetric heap of {len} bytes")));
    }
    Ok(p as u64)
}

/// Frees memory from [`alloc`].
pub(crate) fn free(device: Device, base: u64) {
    let Ok(lib) = library() else { return };
    let Ok(calls) = lib.one_sided_calls() else {
        return;
    };
    let ctx = ContextGuard::primary(device);
    // SAFETY: memory from `alloc`, freed once (its owner is dropped).
    let r = unsafe { (calls.mem_free)(base as *mut c_void) };
    drop(ctx);
    if r != SUCCESS {
        tracing::warn!(
            target: LOG_TARGET,
            device = %device,
            result = r,
            "ncclMemFree failed"
        );
    }
}

/// Memory from [`alloc`], freed on drop.
struct NcclMemory {
    device: Device,
    base: u64,
}

impl NcclMemory {
    fn new(device: Device, len: usize) -> Result<NcclMemory> {
        Ok(NcclMemory {
            device,
            base: alloc(device, len)?,
        })
    }
}

impl Drop for NcclMemory {
    fn drop(&mut self) {
        free(self.device, self.base);
    }
}

/// Bytes of the window of [`Comm::one_sided_works`].
const PROBE_BYTES: usize = 2 << 20;

/// One segment of a grouped transfer: `bytes` at `address` (device
/// memory of the communicator's device), to or from `peer`.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    /// The peer's rank in the communicator.
    pub peer: usize,
    /// Source (send) or destination (receive) address.
    pub address: u64,
    /// Bytes.
    pub bytes: usize,
}

/// One PE's NCCL communicator (non-blocking). Aborted when dropped
/// without [`Comm::finalize`]: at once, or, while CUDA graphs that captured
/// its work are alive, on a thread of its own that NCCL keeps until those
/// graphs are destroyed (the abort ends their running kernels first).
pub struct Comm {
    lib: &'static Library,
    raw: RawComm,
    device: Device,
    rank: usize,
    /// CUDA graphs alive that captured this communicator's work (see
    /// [`Comm::graphs`]).
    graphs: Arc<AtomicUsize>,
    /// The window over the world's heap ([`Comm::register_window`]), or
    /// null.
    window: RawWindow,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time; the world that owns it serialises its use (&mut self).
unsafe impl std::marker::Send for Comm {}

impl Comm {
    /// Joins the communicator of `id` as `rank` of `size` on `device`;
    /// waits at most `timeout`, and gives up early when `healthy` fails
    /// (a peer left).
    pub fn init(
        device: Device,
        id: &[u8],
        rank: usize,
        size: usize,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<Comm> {
        let lib = library()?;
        let id: [u8; UNIQUE_ID_BYTES] = id.try_into().map_err(|_| {
            ShmemError::Mismatch(format!(
                "an NCCL id of {} bytes; NCCL's are {UNIQUE_ID_BYTES}",
                id.len()
            ))
        })?;
        let (nranks, r) = match (c_int::try_from(size), c_int::try_from(rank)) {
            (Ok(n), Ok(r)) if r < n => (n, r),
            _ => {
                return Err(ShmemError::InvalidArgument(format!(
                    "rank {rank} of {size} does not fit an NCCL communicator"
                )))
            }
        };
        nvls_off();
        let ctx = ContextGuard::primary(device)?;
        let mut config = CommConfig {
            size: std::mem::size_of::<CommConfig>(),
            magic: 0xcafe_beef,
            version: MIN_VERSION.code(),
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
        };
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; `config` is NCCL 2.14's
        // layout with its `size`, `magic` and `version` set as
        // NCCL_CONFIG_INITIALIZER sets them.
        let res = unsafe {
            (lib.init_rank_config)(&mut raw, nranks, UniqueId { internal: id }, r, &mut config)
        };
        if raw.is_null() {
            return Err(lib.error("ncclCommInitRankConfig", res, raw));
        }
        let comm = Comm {
            lib,
            raw,
            device,
            rank,
            graphs: Arc::default(),
            window: std::ptr::null_mut(),
        };
        if res != SUCCESS && res != IN_PROGRESS {
            return Err(lib.error("ncclCommInitRankConfig", res, raw));
        }
        drop(ctx);
        comm.wait("ncclCommInitRankConfig", timeout, healthy)?;
        Ok(comm)
    }

    /// The count of CUDA graphs alive that captured this communicator's
    /// work, for whoever captures it to keep: NCCL neither finishes nor
    /// aborts a communicator before every such graph is destroyed.
    pub fn graphs(&self) -> &Arc<AtomicUsize> {
        &self.graphs
    }

    /// How many such graphs are alive, after waiting up to `grace` (at
    /// most 2 s) for it to reach 0: a destroyed graph releases its count
    /// on a driver thread, a moment later.
    pub fn graphs_alive(&self, grace: Duration) -> usize {
        settled_count(&self.graphs, grace)
    }

    /// Whether the communicator's pending work (init, a group, finalize)
    /// is done; its asynchronous error (a failed `call`, a peer that
    /// failed or left, a network error) if it has one. Never waits.
    pub fn progress(&self, call: &str) -> Result<bool> {
        let mut state: NcclResult = IN_PROGRESS;
        // SAFETY: a live communicator; writes one result.
        let r = unsafe { (self.lib.async_error)(self.raw, &mut state) };
        if r != SUCCESS {
            return Err(self.lib.error("ncclCommGetAsyncError", r, self.raw));
        }
        match state {
            SUCCESS => Ok(true),
            IN_PROGRESS => Ok(false),
            e => Err(self.lib.error(call, e, self.raw)),
        }
    }

    /// Polls the communicator until its pending work (init, a group) is
    /// enqueued: its error if it failed, a timeout after `timeout`, the
    /// error of `healthy` if it fails first.
    fn wait(&self, call: &str, timeout: Duration, healthy: &dyn Fn() -> Result<()>) -> Result<()> {
        let done = poll(timeout, || {
            if self.progress(call)? {
                return Ok(true);
            }
            healthy().map(|_| false)
        })?;
        if done {
            return Ok(());
        }
        Err(ShmemError::Timeout(format!(
            "rank {}: NCCL {call} did not complete within {timeout:?} (a peer did not join or stopped)",
            self.rank
        )))
    }

    /// Makes the NCCL call `call` (named `name`) with the communicator's
    /// device current, then waits up to `timeout` for it to complete (see
    /// [`Comm::wait`]).
    fn call_and_wait(
        &self,
        name: &str,
        call: impl FnOnce() -> NcclResult,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let ctx = ContextGuard::primary(self.device)?;
        let r = call();
        drop(ctx);
        if r != SUCCESS && r != IN_PROGRESS {
            return Err(self.lib.error(name, r, self.raw));
        }
        self.wait(name, timeout, healthy)
    }

    /// Enqueues every send and receive on `stream` as one NCCL group
    /// (segments with one peer are matched in order, as NCCL matches
    /// them); returns once NCCL has enqueued them.
    ///
    /// # Safety
    /// Every segment's range must be device memory valid for the whole
    /// transfer (readable for sends, writable for receives), and `stream`
    /// a live stream of the communicator's device.
    pub unsafe fn group(
        &self,
        sends: &[Segment],
        recvs: &[Segment],
        stream: *mut c_void,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let lib = self.lib;
        let posts = sends
            .iter()
            .map(|s| (true, s))
            .chain(recvs.iter().map(|s| (false, s)));
        let issue = || {
            let mut first = None;
            for (send, s) in posts {
                let (address, peer) = (s.address as *mut c_void, s.peer as c_int);
                // SAFETY: the caller's contract; `peer` is below the size
                // (checked by the world).
                let r = unsafe {
                    match send {
                        true => (lib.send)(address, s.bytes, UINT8, peer, self.raw, stream),
                        false => (lib.recv)(address, s.bytes, UINT8, peer, self.raw, stream),
                    }
                };
                if r != SUCCESS && r != IN_PROGRESS {
                    let call = if send { "ncclSend" } else { "ncclRecv" };
                    first.get_or_insert_with(|| lib.error(call, r, self.raw));
                }
            }
            first
        };
        self.in_group("ncclGroupEnd", issue, timeout, healthy)
    }

    /// Runs `issue` (NCCL calls on this communicator, returning the first
    /// that failed) inside one NCCL group, with the communicator's device
    /// current, then waits up to `timeout` for NCCL to enqueue the group
    /// (`what` names it in a timeout).
    fn in_group(
        &self,
        what: &str,
        issue: impl FnOnce() -> Option<ShmemError>,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let lib = self.lib;
        let ctx = ContextGuard::primary(self.device)?;
        // SAFETY: no arguments.
        let r = unsafe { (lib.group_start)() };
        if r != SUCCESS {
            return Err(lib.error("ncclGroupStart", r, self.raw));
        }
        let first = issue();
        // A group started is always ended, also after a failed call in it.
        // SAFETY: no arguments.
        let r = unsafe { (lib.group_end)() };
        drop(ctx);
        if let Some(e) = first {
            return Err(e);
        }
        if r != SUCCESS && r != IN_PROGRESS {
            return Err(lib.error("ncclGroupEnd", r, self.raw));
        }
        self.wait(what, timeout, healthy)
    }

    /// Registers `[base, base + len)` (memory from `ncclMemAlloc`) as the
    /// communicator's window, collectively: every rank registers its heap.
    /// Returns whether NCCL made one (it makes none, successfully, where
    /// the communicator has no symmetric-memory support).
    pub fn register_window(
        &mut self,
        base: u64,
        len: usize,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let calls = self.lib.one_sided_calls()?;
        // NCCL writes the handle when the registration completes, which on
        // a non-blocking communicator may be after the call returns: into
        // memory that outlives a wait that gives up (then leaked).
        let out: *mut RawWindow = Box::into_raw(Box::new(std::ptr::null_mut()));
        let register = || {
            // SAFETY: a live communicator; `base` is `len` bytes of NCCL's
            // memory; `out` stays valid until reclaimed below, once the
            // registration completed.
            unsafe { (calls.register)(self.raw, base as *mut c_void, len, out, WINDOW_FLAGS) }
        };
        self.call_and_wait("ncclCommWindowRegister", register, timeout, healthy)?;
        // SAFETY: from Box::into_raw above; the registration completed, so
        // NCCL no longer writes it.
        self.window = *unsafe { Box::from_raw(out) };
        Ok(!self.window.is_null())
    }

    /// Writes, one-sided, each `(src, offset, bytes)` of `puts` at `offset`
    /// of `peer`'s window, as one NCCL group on `stream`: the writes land
    /// in the order given (NCCL orders operations to one peer); returns
    /// once NCCL has enqueued them.
    ///
    /// # Safety
    /// Every `src` readable for its bytes until the stream has run the
    /// puts; every `[offset, offset + bytes)` inside the window; `stream` a
    /// live stream of the communicator's device.
    pub unsafe fn put(
        &self,
        peer: usize,
        puts: &[(u64, usize, usize)],
        stream: *mut c_void,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let lib = self.lib;
        let calls = lib.one_sided_calls()?;
        if self.window.is_null() {
            return Err(ShmemError::State(format!(
                "rank {}: this communicator has no window to put into",
                self.rank
            )));
        }
        let issue = || {
            let mut first = None;
            for &(src, offset, bytes) in puts {
                // SAFETY: the caller's contract; `peer` is below the size
                // (checked by the world); signal index, context and flags
                // 0.
                let r = unsafe {
                    (calls.put_signal)(
                        src as *const c_void,
                        bytes,
                        UINT8,
                        peer as c_int,
                        self.window,
                        offset,
                        0,
                        0,
                        0,
                        self.raw,
                        stream,
                    )
                };
                if r != SUCCESS && r != IN_PROGRESS {
                    first.get_or_insert_with(|| lib.error("ncclPutSignal", r, self.raw));
                }
            }
            first
        };
        self.in_group("ncclPutSignal", issue, timeout, healthy)
    }

    /// Whether NCCL runs host-initiated one-sided operations among this
    /// communicator's ranks: a window of its own (NCCL sets one-sided
    /// operations up with a communicator's first window), then a signal to
    /// itself, run to completion. NCCL refuses them among ranks it cannot
    /// reach that way and then fails the communicator: call it on a
    /// communicator made for the question, which it aborts. Collective.
    pub fn one_sided_works(
        self,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let stream = OwnStream::new(self.device)?;
        let buffer = NcclMemory::new(self.device, PROBE_BYTES)?;
        // Declared after the window's memory: dropped (aborted) before it.
        let mut comm = self;
        if comm.register_window(buffer.base, PROBE_BYTES, timeout, healthy)? {
            comm.signals_itself(&stream, timeout)
        } else {
            Ok(false)
        }
    }

    /// A signal to itself, run to completion on `stream` (see
    /// [`Comm::one_sided_works`]).
    fn signals_itself(self, stream: &OwnStream, timeout: Duration) -> Result<bool> {
        let calls = self.lib.one_sided_calls()?;
        let ctx = ContextGuard::primary(self.device)?;
        // SAFETY: a live communicator and stream of its device; signal
        // index, context and flags 0.
        let r =
            unsafe { (calls.signal)(self.rank as c_int, 0, 0, 0, self.raw, stream.raw().cast()) };
        drop(ctx);
        if r != SUCCESS && r != IN_PROGRESS {
            tracing::debug!(
                target: LOG_TARGET,
                rank = self.rank,
                error = %self.lib.describe(r, self.raw),
                "NCCL runs no one-sided operations on this world's communicator"
            );
            return Ok(false);
        }
        let ran = self
            .wait("ncclSignal", timeout, &|| Ok(()))
            .and_then(|_| sync(stream));
        Ok(ran.is_ok())
    }

    /// Finalizes and destroys the communicator (collective: NCCL flushes
    /// what is in flight); aborts it instead when that fails.
    pub fn finalize(self, timeout: Duration, healthy: &dyn Fn() -> Result<()>) -> Result<()> {
        if !self.window.is_null() {
            let calls = self.lib.one_sided_calls()?;
            // SAFETY: the window this communicator registered, released
            // once (finalize consumes the communicator); nothing is in
            // flight (the world's quiet came first).
            let deregister = || unsafe { (calls.deregister)(self.raw, self.window) };
            self.call_and_wait("ncclCommWindowDeregister", deregister, timeout, healthy)?;
        }
        // SAFETY: a live communicator.
        let finalize = || unsafe { (self.lib.finalize)(self.raw) };
        self.call_and_wait("ncclCommFinalize", finalize, timeout, healthy)?;
        let ctx = ContextGuard::primary(self.device)?;
        // SAFETY: a finalized communicator, destroyed once (`self` is
        // forgotten below so Drop does not abort it).
        let r = unsafe { (self.lib.destroy)(self.raw) };
        drop(ctx);
        let lib = self.lib;
        std::mem::forget(self);
        if r != SUCCESS {
            return Err(lib.error("ncclCommDestroy", r, std::ptr::null_mut()));
        }
        Ok(())
    }
}

/// `count` once it is 0, or after `timeout` has passed.
fn settled(count: &AtomicUsize, timeout: Duration) -> usize {
    // The poll ends at 0 or after the timeout; the count is read either way.
    let _ = poll(timeout, || Ok(count.load(Ordering::Acquire) == 0));
    count.load(Ordering::Acquire)
}

/// `count` once it is 0, or after `grace` (at most 2 s) has passed.
pub(super) fn settled_count(count: &AtomicUsize, grace: Duration) -> usize {
    settled(count, grace.min(Duration::from_secs(2)))
}

/// Communicators being aborted on threads of their own (see [`Comm`]'s
/// drop), not yet freed by NCCL.
pub(super) static ABORTS: AtomicUsize = AtomicUsize::new(0);

/// How many dropped communicators are still being aborted on threads of
/// their own: NCCL frees each once the CUDA graphs that captured its work
/// are destroyed.
pub fn aborts_in_flight() -> usize {
    ABORTS.load(Ordering::Acquire)
}

/// Waits up to `timeout` for [`aborts_in_flight`] to reach 0 and returns
/// what remains. A process that dropped a world while graphs held its
/// NCCL transfers calls it, once those graphs are destroyed, before it
/// exits: NCCL must not be torn down under an abort in progress.
pub fn settle_aborts(timeout: Duration) -> usize {
    settled(&ABORTS, timeout)
}

/// A raw communicator handed to the thread that aborts it.
struct Aborted(RawComm);

// SAFETY: the communicator is no longer used by anyone but the thread that
// aborts it (its `Comm` is gone).
unsafe impl std::marker::Send for Aborted {}

impl Drop for Comm {
    fn drop(&mut self) {
        let alive = self.graphs_alive(Duration::from_secs(2));
        let (lib, device, raw) = (self.lib, self.device, Aborted(self.raw));
        let abort = move || {
            let raw = raw;
            let ctx = ContextGuard::primary(device);
            // SAFETY: a live communicator, released once (its `Comm` is
            // being dropped); abort first raises NCCL's abort flag, which
            // ends the kernels of its pending work (a peer that never
            // comes), then frees the communicator.
            let _ = unsafe { (lib.abort)(raw.0) };
            drop(ctx);
        };
        if alive == 0 {
            abort();
            return;
        }
        // NCCL frees an aborted communicator only once every graph that
        // captured its work is destroyed, and waits for that inside its
        // abort. Such a graph may be running, its kernels waiting for a
        // peer that left, and they end only when the abort flag is up: so
        // the abort runs on a thread of its own (the flag goes up at once;
        // the thread finishes when the graphs are gone), never on the
        // thread that drops the world, which would wait forever.
        let (done, finished) = std::sync::mpsc::channel();
        ABORTS.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name("xcall-nccl-abort".into())
            .spawn(move || {
                abort();
                ABORTS.fetch_sub(1, Ordering::AcqRel);
                let _ = done.send(());
            });
        match spawned {
            Ok(_) => {
                // The graphs' kernels end once the flag is up; give the
                // abort the grace to finish when the graphs go meanwhile.
                let finished = finished.recv_timeout(Duration::from_secs(2)).is_ok();
                tracing::warn!(
                    target: LOG_TARGET,
                    rank = self.rank,
                    graphs = alive,
                    finished,
                    "an NCCL communicator dropped while CUDA graphs that captured its work are alive is aborted; NCCL frees it once those graphs are destroyed (their replays no longer move data)"
                );
            }
            Err(e) => {
                ABORTS.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(
                    target: LOG_TARGET,
                    rank = self.rank,
                    graphs = alive,
                    error = %e,
                    "an NCCL communicator dropped while CUDA graphs that captured its work are alive is left to them: no thread could be started to abort it"
                );
            }
        }
    }
}
