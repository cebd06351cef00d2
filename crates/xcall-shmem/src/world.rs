//! A world of processing elements, its lifecycle and peer transports.
//!
//! Lifecycle: `World::new()` is New; [`World::init`] makes it Live;
//! [`World::finalize`] makes it Finalized, and `init` may run again. Any
//! other call outside Live, and `init` on a Live world, is an
//! [`ShmemError::State`] that says what to do.
//!
//! Init, step by step (every step that can fail on one PE is agreed on, so
//! a failure is reported on every PE, never a hang):
//! 1. bind the device in this process's registry (one live PE per device);
//! 2. bootstrap (in-process group or Unix socket);
//! 3. exchange identities (host, pid, device, heap size): mismatched heap
//!    sizes or platforms, two PEs of one process on one device, and peers on
//!    other hosts are refused;
//! 4. allocate the heap: Host, one process: anonymous memory; Host, some
//!    peer in another process: POSIX shared memory; CUDA: `cuMemAlloc`
//!    (plus an IPC handle when some peer is in another process);
//! 5. map every peer: same process: its address as is (CUDA: after
//!    enabling peer access; never IPC inside one process); other process:
//!    `shm_open` + `mmap` / `cuIpcOpenMemHandle`;
//! 6. barrier, then remove the shared-memory names (nothing is left in
//!    /dev/shm even if a process dies later);
//! 7. reserve the internal region at offset 0 (barrier words) and zero it.
//!
//! Finalize mirrors it: quiet and barrier; free what is still allocated
//! (reported as leaks); close the mappings of other processes' heaps
//! (same-process peers are never "closed"); barrier; release the heap,
//! the stream and the device binding; leave the bootstrap.
//!
//! A PE that leaves without finalize (its `World` dropped while live), or
//! whose finalize fails (a peer never arrived), marks the world failed in
//! the world's state page, a small page of host memory every PE maps. Every
//! transfer, signal, wait and collective reads it first and returns
//! [`ShmemError::PeerFailed`] instead of touching memory. Heaps stay
//! mapped while a peer can still reach them: a same-process peer holds a
//! reference to each heap (the memory goes with the last PE of the process
//! that holds it), and another process's heap stays mapped in this process
//! until this PE leaves.

use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xcall_core::{Device, Platform};

use crate::bootstrap::{Bootstrap, InProcess, UnixSocket};
use crate::error::{Result, ShmemError};
use crate::handoff::{self, Offer};
use crate::heap::{Allocator, ALIGN};
use crate::host::{host_identity, HostHeap, HostMapping};
use crate::registry::{self, Binding};

/// Environment variable with the heap size in bytes (when the config gives
/// none).
pub const HEAP_ENV: &str = "XCALL_SHMEM_HEAP_BYTES";
/// Default Host heap: 64 MiB per PE.
pub const DEFAULT_HOST_HEAP: usize = 64 << 20;
/// Default CUDA heap: 1 GiB per PE (NVSHMEM's default too).
pub const DEFAULT_CUDA_HEAP: usize = 1 << 30;
/// Default timeout of every wait on other PEs.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// The most PEs a world may have. Rack-scale systems have 72 GPUs and CPU
/// partitions more; the bound keeps the per-PE tables of init (O(PEs) on
/// every PE) from growing without limit on a wrong size.
pub const MAX_PES: usize = 1 << 16;
/// Bytes of a world's state page.
const STATE_PAGE: usize = 4096;

/// How the PEs find each other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BootstrapKind {
    /// Threads of this process, meeting by group name (SPMT).
    InProcess {
        /// The group's name; unique per live world.
        group: String,
    },
    /// Processes of this host, meeting at a Unix domain socket (rank 0
    /// listens at `path`).
    UnixSocket {
        /// Socket path; rank 0 removes it once every PE connected.
        path: PathBuf,
    },
}

/// What `init` needs. The device is explicit: never inferred from the
/// calling thread.
#[derive(Clone, Debug)]
pub struct Config {
    /// This PE's rank in `[0, size)`.
    pub rank: usize,
    /// Number of PEs.
    pub size: usize,
    /// The PE's device: a CUDA device, or on Host any ordinal, which names
    /// the PE's slot in this process's registry (use the rank).
    pub device: Device,
    /// How the PEs meet.
    pub bootstrap: BootstrapKind,
    /// Heap bytes per PE; `None`: [`HEAP_ENV`], else the platform default.
    pub heap_bytes: Option<usize>,
    /// Timeout of every wait on other PEs.
    pub timeout: Duration,
}

impl Config {
    /// An SPMT config: PEs are threads meeting in group `group`.
    pub fn in_process(group: &str, rank: usize, size: usize, device: Device) -> Config {
        Config {
            rank,
            size,
            device,
            bootstrap: BootstrapKind::InProcess {
                group: group.to_string(),
            },
            heap_bytes: None,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// A multi-process config: PEs meet at the Unix socket `path`.
    pub fn unix_socket(
        path: impl Into<PathBuf>,
        rank: usize,
        size: usize,
        device: Device,
    ) -> Config {
        Config {
            bootstrap: BootstrapKind::UnixSocket { path: path.into() },
            ..Config::in_process("", rank, size, device)
        }
    }

    fn heap(&self) -> Result<usize> {
        let requested = match self.heap_bytes {
            Some(b) => b,
            None => match std::env::var(HEAP_ENV) {
                Ok(v) => v.trim().parse().map_err(|_| {
                    ShmemError::InvalidArgument(format!("{HEAP_ENV}={v:?} is not a byte count"))
                })?,
                Err(_) if self.device.platform == Platform::Cuda => DEFAULT_CUDA_HEAP,
                Err(_) => DEFAULT_HOST_HEAP,
            },
        };
        let bytes = requested;
        let internal = internal_bytes(self.size);
        if bytes < internal + ALIGN {
            return Err(ShmemError::InvalidArgument(format!(
                "a heap of {bytes} bytes is too small for {} PEs (at least {} bytes)",
                self.size,
                internal + ALIGN
            )));
        }
        // The heap's end must stay an address: a size near 2^64 cannot be
        // mapped anywhere, and rounding it up must not wrap.
        bytes
            .checked_next_multiple_of(ALIGN)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                ShmemError::InvalidArgument(format!(
                    "a heap of {bytes} bytes is larger than an address space"
                ))
            })
    }
}

/// Lifecycle phase of a [`World`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Created, never initialised.
    New,
    /// Initialised and usable.
    Live,
    /// Finalized; `init` may start it again.
    Finalized,
}

/// How `put_signal` updates a signal word.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOp {
    /// `*signal = value`.
    Set = 0,
    /// `*signal += value`.
    Add = 1,
}

/// The comparison `wait_until` waits for.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    /// `*signal == value`.
    Eq = 0,
    /// `*signal != value`.
    Ne = 1,
    /// `*signal >= value`.
    Ge = 2,
    /// `*signal > value`.
    Gt = 3,
    /// `*signal <= value`.
    Le = 4,
    /// `*signal < value`.
    Lt = 5,
}

impl Cmp {
    fn holds(self, x: u64, v: u64) -> bool {
        match self {
            Cmp::Eq => x == v,
            Cmp::Ne => x != v,
            Cmp::Ge => x >= v,
            Cmp::Gt => x > v,
            Cmp::Le => x <= v,
            Cmp::Lt => x < v,
        }
    }
}

/// What finalize found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FinalizeReport {
    /// Allocations still live at finalize (offset in the heap, bytes),
    /// freed by it: leaks of the program.
    pub leaked: Vec<(usize, usize)>,
}

/// Bytes reserved at offset 0 of every heap: `n` arrival words, the epoch
/// word, the error word, `n` peer pointers. `n` is at most [`MAX_PES`].
fn internal_bytes(n: usize) -> usize {
    (8 * n + 16 + 8 * n).next_multiple_of(ALIGN)
}

enum Memory {
    Host(HostHeap),
    Cuda(crate::cuda::DeviceHeap),
}

/// How this PE reaches a peer's heap (a read-only fact for tests and
/// diagnostics: [`World::transport`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// This PE itself, or a PE of this process: the peer's address as is
    /// (on CUDA with peer access enabled), never IPC.
    SameProcess,
    /// Host heap of another process, mapped from POSIX shared memory.
    HostSharedMemory,
    /// CUDA heap of another process, opened from its IPC handle.
    CudaIpc,
}

enum PeerMap {
    /// Nothing held (finalize dropped it).
    Released,
    /// A PE of this process (this PE included): its heap, held so that it
    /// stays mapped while this PE can reach it.
    SameProcess(#[allow(dead_code)] Arc<Memory>),
    Host(#[allow(dead_code)] HostMapping),
    Cuda(#[allow(dead_code)] crate::cuda::IpcMapping),
}

/// A step of [`World::finalize`] a test may observe
/// ([`set_finalize_hook`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalizeStep {
    /// This PE let go of its mappings of every peer's heap.
    PeersReleased,
    /// This PE is about to release its own heap.
    HeapReleasing,
}

/// A finalize hook: `hook(rank, step)`.
#[doc(hidden)]
pub type FinalizeHook = fn(usize, FinalizeStep);

thread_local! {
    static FINALIZE_HOOK: std::cell::Cell<Option<FinalizeHook>> = const { std::cell::Cell::new(None) };
}

/// Test hook: `hook(rank, step)` runs on this thread at each
/// [`FinalizeStep`] of a finalize it calls (`None` removes it). Tests use
/// it to check that no PE releases its heap before every peer released
/// its mappings of it.
#[doc(hidden)]
pub fn set_finalize_hook(hook: Option<FinalizeHook>) {
    FINALIZE_HOOK.with(|h| h.set(hook));
}

fn finalize_step(rank: usize, step: FinalizeStep) {
    if let Some(hook) = FINALIZE_HOOK.with(|h| h.get()) {
        hook(rank, step);
    }
}

/// Why a world failed, in its state word: `reason << 32 | (rank + 1)`.
const LEFT_WITHOUT_FINALIZE: u64 = 1;
const FINALIZE_FAILED: u64 = 2;

/// The world's state page: host memory every PE of the world maps (its
/// first word is 0 while the world is healthy).
enum StatePage {
    SameProcess(Arc<HostHeap>),
    Mapped(HostMapping),
}

impl StatePage {
    fn word(&self) -> &AtomicU64 {
        let base = match self {
            StatePage::SameProcess(h) => h.base,
            StatePage::Mapped(m) => m.base,
        };
        // SAFETY: the first 8 bytes of a page-aligned mapping this PE holds
        // for as long as `self` lives; every access is atomic.
        unsafe { &*(base as *const AtomicU64) }
    }

    fn fail(&self, reason: u64, rank: usize) {
        let code = (reason << 32) | (rank as u64 + 1);
        // The first failure is the one reported.
        let _ = self
            .word()
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }

    fn check(&self) -> Result<()> {
        let code = self.word().load(Ordering::Acquire);
        if code == 0 {
            return Ok(());
        }
        let rank = (code & 0xffff_ffff).saturating_sub(1);
        let why = match code >> 32 {
            LEFT_WITHOUT_FINALIZE => "left the world without finalize",
            FINALIZE_FAILED => "failed in finalize",
            _ => "failed",
        };
        Err(ShmemError::PeerFailed(format!(
            "rank {rank} {why}; nothing more crosses this world, only finalize remains"
        )))
    }
}

struct Peer {
    device: Device,
    base: u64,
    map: PeerMap,
}

struct Live {
    state: StatePage,
    rank: usize,
    size: usize,
    device: Device,
    name: String,
    timeout: Duration,
    boot: Box<dyn Bootstrap>,
    base: u64,
    len: usize,
    alloc: Allocator,
    internal: usize,
    seq: u64,
    peers: Vec<Peer>,
    stream: Option<crate::cuda::Stream>,
    // Dropped last, in this order (fields drop in declaration order).
    memory: Arc<Memory>,
    _binding: Binding,
}

/// One PE's handle on a world of symmetric memory. Not shared between
/// threads: each PE (thread or process) owns its own `World`.
pub struct World {
    phase: Phase,
    live: Option<Live>,
}

impl Default for World {
    fn default() -> Self {
        World::new()
    }
}

/// Sends this PE's result to every PE; every PE returns the first failure
/// (its own first), so a step that fails anywhere fails everywhere.
fn agree<T>(boot: &mut dyn Bootstrap, local: Result<T>) -> Result<T> {
    let msg = match &local {
        Ok(_) => Vec::new(),
        Err(e) => e.encode(),
    };
    let all = boot.allgather(&msg)?;
    let local = local?;
    match all.iter().position(|m| !m.is_empty()) {
        Some(r) => Err(ShmemError::decode(r, &all[r])),
        None => Ok(local),
    }
}

fn fields(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .split('\n')
        .map(str::to_string)
        .collect()
}

impl World {
    /// A world in phase New.
    pub fn new() -> World {
        World {
            phase: Phase::New,
            live: None,
        }
    }

    /// The lifecycle phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    fn live(&self) -> Result<&Live> {
        match (self.phase, &self.live) {
            (Phase::Live, Some(l)) => Ok(l),
            (Phase::Finalized, _) => Err(ShmemError::State(
                "the world is finalized; call init to start it again".into(),
            )),
            _ => Err(ShmemError::State(
                "the world is not initialised; call init first".into(),
            )),
        }
    }

    fn live_mut(&mut self) -> Result<&mut Live> {
        self.live()?;
        Ok(self.live.as_mut().expect("checked live"))
    }

    /// This PE's rank.
    pub fn rank(&self) -> Result<usize> {
        Ok(self.live()?.rank)
    }

    /// The number of PEs.
    pub fn size(&self) -> Result<usize> {
        Ok(self.live()?.size)
    }

    /// The device of PE `pe` (the rank -> device registry).
    pub fn device_of(&self, pe: usize) -> Result<Device> {
        let l = self.live()?;
        l.check_pe(pe)?;
        Ok(l.peers[pe].device)
    }

    /// How this PE reaches PE `pe`'s heap.
    pub fn transport(&self, pe: usize) -> Result<Transport> {
        let l = self.live()?;
        l.check_pe(pe)?;
        Ok(match l.peers[pe].map {
            PeerMap::SameProcess(_) | PeerMap::Released => Transport::SameProcess,
            PeerMap::Host(_) => Transport::HostSharedMemory,
            PeerMap::Cuda(_) => Transport::CudaIpc,
        })
    }

    /// This PE's heap: (base address, bytes). User allocations start after
    /// the internal region.
    pub fn heap(&self) -> Result<(u64, usize)> {
        let l = self.live()?;
        Ok((l.base, l.len))
    }

    /// Joins the world described by `config`; collective over all PEs.
    pub fn init(&mut self, config: &Config) -> Result<()> {
        if self.phase == Phase::Live {
            let l = self.live()?;
            return Err(ShmemError::State(format!(
                "init on a live world (rank {} of {:?}); finalize it first",
                l.rank, l.name
            )));
        }
        let live =
            Live::init(config).map_err(|e| e.context(format!("init of rank {}", config.rank)))?;
        self.live = Some(live);
        self.phase = Phase::Live;
        Ok(())
    }

    /// Leaves the world (collective); see the module docs for the order.
    /// Allocations still live are freed and reported. The world is
    /// Finalized afterwards even when a step failed (the first failure is
    /// returned).
    ///
    /// On a failed world (a peer left or failed) the collective steps are
    /// skipped: this PE releases what it holds and the error is
    /// [`ShmemError::PeerFailed`].
    pub fn finalize(&mut self) -> Result<FinalizeReport> {
        self.live()?;
        let live = self.live.take().expect("checked live");
        self.phase = Phase::Finalized;
        live.finalize()
    }

    /// Allocates `bytes` on every PE (collective: same order and sizes on
    /// every PE, checked); returns this PE's address of the object. Device
    /// memory on CUDA, contents unspecified.
    pub fn malloc(&mut self, bytes: usize) -> Result<u64> {
        let l = self.live_mut()?;
        l.collective("malloc", bytes as u64)?;
        let offset = l.alloc.alloc(bytes)?;
        Ok(l.base + offset as u64)
    }

    /// Frees an object of [`World::malloc`] on every PE (collective).
    pub fn free(&mut self, address: u64) -> Result<()> {
        let l = self.live_mut()?;
        let offset = address
            .checked_sub(l.base)
            .filter(|&o| (o as usize) < l.len && o as usize >= l.internal)
            .unwrap_or(u64::MAX);
        l.collective("free", offset)?;
        if offset == u64::MAX {
            return Err(ShmemError::InvalidArgument(format!(
                "{address:#x} is not in this PE's symmetric heap"
            )));
        }
        l.alloc.free(offset as usize).map(|_| ())
    }

    /// PE `pe`'s address of the object at `local` (an address in this
    /// PE's heap), or `None` when `local` is outside the heap or `pe` is
    /// not a PE. Every PE of a world is directly addressable (init refuses
    /// a world where one is not).
    ///
    /// The address stays mapped while this PE is live, even after PE `pe`
    /// left; xcall checks nothing done through it.
    pub fn ptr(&self, pe: usize, local: u64) -> Option<u64> {
        let l = self.live().ok()?;
        let offset = local
            .checked_sub(l.base)
            .filter(|&o| (o as usize) < l.len)?;
        l.peers.get(pe).map(|p| p.base + offset)
    }

    /// Copies `bytes` from `src` (this PE's memory: Host memory, or on
    /// CUDA any address the device can read) to the object at `dest` (a
    /// symmetric address of this PE) on PE `pe`. Blocking.
    ///
    /// # Safety
    /// `src` must be readable for `bytes` bytes.
    pub unsafe fn put(&mut self, dest: u64, src: u64, bytes: usize, pe: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.transfer(Dir::Put, src, dest, bytes, pe, None) }?;
        self.quiet()
    }

    /// Copies `bytes` from the object at `src` (a symmetric address of
    /// this PE) on PE `pe` to `dest` (this PE's memory). Blocking.
    ///
    /// # Safety
    /// `dest` must be writable for `bytes` bytes.
    pub unsafe fn get(&mut self, dest: u64, src: u64, bytes: usize, pe: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.transfer(Dir::Get, dest, src, bytes, pe, None) }?;
        self.quiet()
    }

    /// [`World::put`] ordered on the caller's CUDA `stream` (a
    /// `CUstream` of this PE's device), returning before it completes; on
    /// Host it is the blocking put. Complete it with the stream (or
    /// [`World::quiet`] for this PE's own stream).
    ///
    /// # Safety
    /// As [`World::put`], for as long as the stream runs the copy.
    pub unsafe fn put_nbi(
        &mut self,
        dest: u64,
        src: u64,
        bytes: usize,
        pe: usize,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.transfer(Dir::Put, src, dest, bytes, pe, Some(stream)) }
    }

    /// [`World::get`] ordered on the caller's CUDA `stream`.
    ///
    /// # Safety
    /// As [`World::get`], for as long as the stream runs the copy.
    pub unsafe fn get_nbi(
        &mut self,
        dest: u64,
        src: u64,
        bytes: usize,
        pe: usize,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.transfer(Dir::Get, dest, src, bytes, pe, Some(stream)) }
    }

    /// Copies between `local` (this PE's memory) and the object at the
    /// symmetric address `symmetric` on PE `pe`, checked to lie in the heap.
    ///
    /// # Safety
    /// `local` valid for `bytes` (readable for a put, writable for a get)
    /// as long as the copy runs.
    unsafe fn transfer(
        &mut self,
        dir: Dir,
        local: u64,
        symmetric: u64,
        bytes: usize,
        pe: usize,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        let l = self.live_mut()?;
        match dir {
            Dir::Put => {
                let remote = l.remote(symmetric, bytes, pe, "put destination")?;
                // SAFETY: `remote` was just checked to lie in one live
                // allocation of the peer's heap; `local` is the caller's
                // contract.
                unsafe { l.copy(remote, local, bytes, stream) }
            }
            Dir::Get => {
                let remote = l.remote(symmetric, bytes, pe, "get source")?;
                // SAFETY: as for a put, with the roles of the ranges swapped.
                unsafe { l.copy(local, remote, bytes, stream) }
            }
        }
    }

    /// Completes every operation this PE issued on its own stream, and
    /// reports a `barrier_on_stream` that timed out.
    pub fn quiet(&mut self) -> Result<()> {
        self.live_mut()?.quiet()
    }

    /// Waits until every PE called it (after [`World::quiet`]); collective.
    pub fn barrier_all(&mut self) -> Result<()> {
        let l = self.live_mut()?;
        l.quiet()?;
        l.collective("barrier_all", 0)
    }

    /// A barrier of all PEs as a kernel on the caller's CUDA `stream`:
    /// work after it on the stream starts once every PE's stream reached
    /// its own barrier. Capturable into a graph (the epoch lives in device
    /// memory). A PE that never arrives makes the kernel give up after the
    /// world's timeout; the next quiet or barrier_all reports it.
    pub fn barrier_on_stream(&mut self, stream: *mut std::ffi::c_void) -> Result<()> {
        let l = self.live_mut()?;
        if l.device.platform != Platform::Cuda {
            return Err(ShmemError::Unsupported(
                "barrier_on_stream needs a CUDA world; use barrier_all on Host".into(),
            ));
        }
        l.state.check()?;
        let k = crate::cuda::kernels(l.device)?;
        let n = l.size as u64;
        let params = [
            l.base + 8 * n + 16,
            l.base,
            l.base + 8 * n,
            l.base + 8 * n + 8,
            l.rank as u64,
            n,
            l.timeout.as_nanos().min(u64::MAX as u128) as u64,
        ];
        // SAFETY: the parameters match xcall_shmem_barrier's signature; the
        // addresses are this PE's internal region (pointer table filled at
        // init).
        unsafe {
            crate::cuda::launch(
                l.device,
                &k.barrier,
                n.next_multiple_of(32).min(1024) as u32,
                stream.cast(),
                &params,
            )
        }
    }

    /// Copies like [`World::put`], then updates the 64-bit signal word at
    /// `signal` (a symmetric address, 8-byte aligned) on PE `pe` with
    /// `op`, once the data is visible there. Blocking.
    ///
    /// # Safety
    /// As [`World::put`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn put_signal(
        &mut self,
        dest: u64,
        src: u64,
        bytes: usize,
        signal: u64,
        value: u64,
        op: SignalOp,
        pe: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.put_signal_on(dest, src, bytes, signal, value, op, pe, None) }?;
        self.quiet()
    }

    /// [`World::put_signal`] ordered on the caller's CUDA `stream`.
    ///
    /// # Safety
    /// As [`World::put_nbi`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn put_signal_nbi(
        &mut self,
        dest: u64,
        src: u64,
        bytes: usize,
        signal: u64,
        value: u64,
        op: SignalOp,
        pe: usize,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.put_signal_on(dest, src, bytes, signal, value, op, pe, Some(stream)) }
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn put_signal_on(
        &mut self,
        dest: u64,
        src: u64,
        bytes: usize,
        signal: u64,
        value: u64,
        op: SignalOp,
        pe: usize,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        let sig = self.live()?.signal_word(signal, pe)?;
        // SAFETY: the caller's contract.
        unsafe { self.transfer(Dir::Put, src, dest, bytes, pe, stream) }?;
        let l = self.live_mut()?;
        match l.device.platform {
            Platform::Host => {
                // SAFETY: an aligned 8-byte word of a mapped heap; every
                // access to signal words is atomic.
                let word = unsafe { &*(sig as *const AtomicU64) };
                match op {
                    SignalOp::Set => word.store(value, Ordering::Release),
                    SignalOp::Add => {
                        word.fetch_add(value, Ordering::Release);
                    }
                }
                Ok(())
            }
            Platform::Cuda => {
                let k = crate::cuda::kernels(l.device)?;
                let s = l.stream_or(stream);
                // SAFETY: matches xcall_shmem_signal(u64*, u64, int).
                unsafe { crate::cuda::launch(l.device, &k.signal, 1, s, &[sig, value, op as u64]) }
            }
        }
    }

    /// Waits until the signal word at `signal` (a symmetric address of
    /// this PE) satisfies `cmp` against `value`; returns the value seen.
    /// Gives up after the world's timeout.
    pub fn wait_until(&mut self, signal: u64, cmp: Cmp, value: u64) -> Result<u64> {
        let l = self.live_mut()?;
        let rank = l.rank;
        let sig = l.signal_word(signal, rank)?;
        let deadline = Instant::now() + l.timeout;
        let mut spins = 0u32;
        loop {
            // A peer that left will never signal: say so now, not at the
            // timeout.
            l.state.check()?;
            let x = l.read_word(sig)?;
            if cmp.holds(x, value) {
                return Ok(x);
            }
            if Instant::now() >= deadline {
                return Err(ShmemError::Timeout(format!(
                    "rank {rank} waited {:?} for signal {signal:#x} {cmp:?} {value}; it holds {x}",
                    l.timeout
                )));
            }
            spins += 1;
            if spins > 64 {
                std::thread::yield_now();
            }
        }
    }

    /// Makes the caller's CUDA `stream` wait until the signal word at
    /// `signal` is `== value` ([`Cmp::Eq`]) or `>= value` ([`Cmp::Ge`]).
    pub fn wait_until_on_stream(
        &mut self,
        signal: u64,
        cmp: Cmp,
        value: u64,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        let l = self.live_mut()?;
        if l.device.platform != Platform::Cuda {
            return Err(ShmemError::Unsupported(
                "wait_until_on_stream needs a CUDA world".into(),
            ));
        }
        if !matches!(cmp, Cmp::Eq | Cmp::Ge) {
            return Err(ShmemError::Unsupported(format!(
                "wait_until_on_stream supports Eq and Ge, not {cmp:?}"
            )));
        }
        let rank = l.rank;
        let sig = l.signal_word(signal, rank)?;
        crate::cuda::wait_value(l.device, stream.cast(), sig, value, cmp == Cmp::Eq)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Dropping a live world releases this PE's resources without the
        // collective steps (peers may be gone); finalize is the clean way.
        // The peers learn of it from the state page, and this PE's heap
        // stays mapped while a same-process peer holds it.
        if let Some(live) = self.live.take() {
            live.state.fail(LEFT_WITHOUT_FINALIZE, live.rank);
            drop(live);
        }
    }
}

impl Live {
    fn init(c: &Config) -> Result<Live> {
        if c.size == 0 || c.rank >= c.size {
            return Err(ShmemError::InvalidArgument(format!(
                "rank {} is not in a world of {} PE(s)",
                c.rank, c.size
            )));
        }
        if c.size > MAX_PES {
            return Err(ShmemError::InvalidArgument(format!(
                "a world of {} PEs is larger than the limit of {MAX_PES}",
                c.size
            )));
        }
        if c.timeout.is_zero() {
            return Err(ShmemError::InvalidArgument(
                "timeout must be above zero".into(),
            ));
        }
        let len = c.heap()?;
        if c.device.platform == Platform::Cuda {
            c.device.validate()?;
        }
        let name = match &c.bootstrap {
            BootstrapKind::InProcess { group } => format!("group {group}"),
            BootstrapKind::UnixSocket { path } => format!("socket {}", path.display()),
        };
        let binding = registry::bind(c.device, &name, c.rank)?;
        let mut boot: Box<dyn Bootstrap> = match &c.bootstrap {
            BootstrapKind::InProcess { group } => {
                Box::new(InProcess::join(group, c.rank, c.size, c.timeout)?)
            }
            BootstrapKind::UnixSocket { path } => {
                Box::new(UnixSocket::connect(path, c.rank, c.size, c.timeout)?)
            }
        };

        // 3. identities.
        let me = format!(
            "{}\n{}\n{}\n{}\n{}",
            host_identity(),
            std::process::id(),
            c.device.platform as u32,
            c.device.ordinal,
            len
        );
        let ids: Vec<Vec<String>> = boot
            .allgather(me.as_bytes())?
            .iter()
            .map(|b| fields(b))
            .collect();
        let mut devices = Vec::with_capacity(c.size);
        let check = (|| {
            for (r, f) in ids.iter().enumerate() {
                if f.len() != 5 {
                    return Err(ShmemError::Mismatch(format!(
                        "rank {r} sent a malformed identity"
                    )));
                }
                let platform = f[2].parse().ok().and_then(Platform::from_code);
                let ordinal: Option<u32> = f[3].parse().ok();
                let (Some(platform), Some(ordinal)) = (platform, ordinal) else {
                    return Err(ShmemError::Mismatch(format!(
                        "rank {r} sent a malformed device"
                    )));
                };
                devices.push(Device::new(platform, ordinal));
                if platform != c.device.platform {
                    return Err(ShmemError::Mismatch(format!(
                        "rank {r} is on {} and rank {} on {}: one platform per world",
                        devices[r], c.rank, c.device
                    )));
                }
                if f[4] != len.to_string() {
                    return Err(ShmemError::Mismatch(format!(
                        "rank {r} has a heap of {} bytes, rank {} of {len}",
                        f[4], c.rank
                    )));
                }
                if f[0] != ids[c.rank][0] {
                    return Err(ShmemError::Unsupported(format!(
                        "rank {r} is on another host ({}); worlds span one host (see the crate docs for multi-node)",
                        f[0]
                    )));
                }
                for (q, g) in ids.iter().enumerate().take(r) {
                    if g[0] == f[0] && g[1] == f[1] && g[2] == f[2] && g[3] == f[3] {
                        return Err(ShmemError::Mismatch(format!(
                            "ranks {q} and {r} are one process on one device ({})",
                            devices[r]
                        )));
                    }
                }
            }
            Ok(())
        })();
        agree(boot.as_mut(), check)?;
        let same_process = |r: usize| ids[r][0] == ids[c.rank][0] && ids[r][1] == ids[c.rank][1];
        let cross = (0..c.size).any(|r| !same_process(r));

        // 4. the world's state page (rank 0 makes it), and the heap.
        let (state, _state_offer) = state_page(boot.as_mut(), c, cross, &same_process)?;
        let shm_name = format!("/xcall-{}-{}-{}", std::process::id(), c.rank, unique());
        let memory = match c.device.platform {
            Platform::Host if cross => HostHeap::shared(&shm_name, len).map(Memory::Host),
            Platform::Host => HostHeap::private(len).map(Memory::Host),
            Platform::Cuda => crate::cuda::DeviceHeap::new(c.device, len).map(Memory::Cuda),
        };
        let memory = Arc::new(agree(boot.as_mut(), memory)?);
        let heap_offer = handoff::offer(memory.clone());
        let (base, export) = match &*memory {
            Memory::Host(h) => (h.base, shm_name.clone()),
            Memory::Cuda(d) => {
                let handle = if cross {
                    agree(boot.as_mut(), d.ipc_handle())?
                } else {
                    agree(boot.as_mut(), Ok(Vec::new()))?
                };
                (d.base, handle.iter().map(|b| format!("{b:02x}")).collect())
            }
        };

        // 5. peers.
        let descs: Vec<Vec<String>> = boot
            .allgather(format!("{base}\n{export}\n{}", heap_offer.token).as_bytes())?
            .iter()
            .map(|b| fields(b))
            .collect();
        let peers = (|| {
            let mut peers = Vec::with_capacity(c.size);
            for (r, d) in descs.iter().enumerate() {
                let their_base: u64 = d.first().and_then(|b| b.parse().ok()).ok_or_else(|| {
                    ShmemError::Mismatch(format!("rank {r} sent a malformed heap descriptor"))
                })?;
                let export = d.get(1).cloned().unwrap_or_default();
                let device = devices[r];
                let held = || -> Result<PeerMap> {
                    let token = d.get(2).and_then(|t| t.parse().ok()).unwrap_or(0);
                    handoff::take::<Memory>(token)
                        .map(PeerMap::SameProcess)
                        .ok_or_else(|| {
                            ShmemError::Mismatch(format!(
                                "rank {r}'s heap is not on offer in this process"
                            ))
                        })
                };
                let (base, map) = match c.device.platform {
                    Platform::Host if same_process(r) => (their_base, held()?),
                    Platform::Host => {
                        let m = HostMapping::open(&export, len)?;
                        (m.base, PeerMap::Host(m))
                    }
                    Platform::Cuda if same_process(r) => {
                        crate::cuda::enable_peer_access(c.device, device, (c.rank, r))?;
                        (their_base, held()?)
                    }
                    Platform::Cuda => {
                        let bytes: Vec<u8> = (0..export.len() / 2)
                            .filter_map(|i| u8::from_str_radix(&export[2 * i..2 * i + 2], 16).ok())
                            .collect();
                        let m = crate::cuda::IpcMapping::open(c.device, &bytes)?;
                        (m.base, PeerMap::Cuda(m))
                    }
                };
                peers.push(Peer { device, base, map });
            }
            Ok(peers)
        })();
        let peers = agree(boot.as_mut(), peers)?;

        // 6. every peer mapped this heap: drop its name and the offers.
        boot.barrier()?;
        if let Memory::Host(h) = &*memory {
            h.unlink();
        }
        if let StatePage::SameProcess(h) = &state {
            h.unlink();
        }
        drop(heap_offer);
        drop(_state_offer);

        // 7. the internal region.
        let mut alloc = Allocator::new(len);
        let internal = alloc.alloc(internal_bytes(c.size))?;
        debug_assert_eq!(internal, 0);
        let stream = match c.device.platform {
            Platform::Cuda => Some(crate::cuda::Stream::new(c.device)),
            Platform::Host => None,
        }
        .transpose();
        let stream = agree(boot.as_mut(), stream)?;
        let mut live = Live {
            state,
            rank: c.rank,
            size: c.size,
            device: c.device,
            name,
            timeout: c.timeout,
            boot,
            base,
            len,
            alloc,
            internal: internal_bytes(c.size),
            seq: 0,
            peers,
            stream,
            memory,
            _binding: binding,
        };
        let zeroed = live.init_internal();
        agree(live.boot.as_mut(), zeroed)?;
        live.boot.barrier()?;
        Ok(live)
    }

    /// Zeroes the internal region and writes the peer arrival-pointer
    /// table; loads the kernels on CUDA.
    fn init_internal(&mut self) -> Result<()> {
        let n = self.size;
        let mut table = vec![0u8; self.internal];
        for (i, p) in self.peers.iter().enumerate() {
            // Peer i's arrival words, in this PE's address space.
            let at = 8 * n + 16 + 8 * i;
            table[at..at + 8].copy_from_slice(&p.base.to_le_bytes());
        }
        match &*self.memory {
            Memory::Host(_) => {
                // SAFETY: the first `internal` bytes of this PE's heap.
                unsafe {
                    std::ptr::copy_nonoverlapping(table.as_ptr(), self.base as *mut u8, table.len())
                };
                Ok(())
            }
            Memory::Cuda(_) => {
                crate::cuda::kernels(self.device)?;
                // SAFETY: the first `internal` bytes of this PE's heap.
                unsafe { crate::cuda::write_device(self.device, self.base, &table) }
            }
        }
    }

    fn finalize(mut self) -> Result<FinalizeReport> {
        if let Err(e) = self.state.check() {
            // The collective steps would wait for a PE that is gone.
            return Err(e.context(format!("finalize of rank {} (released locally)", self.rank)));
        }
        let mut first: Option<ShmemError> = None;
        let mut keep = |r: Result<()>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        keep(self.quiet());
        keep(self.collective("finalize", 0));
        let leaked: Vec<(usize, usize)> = self
            .alloc
            .live()
            .into_iter()
            .filter(|&(o, _)| o != 0)
            .collect();
        for &(o, _) in &leaked {
            keep(self.alloc.free(o).map(|_| ()));
        }
        // Close other processes' heaps and let go of same-process ones.
        for p in &mut self.peers {
            p.map = PeerMap::Released;
        }
        finalize_step(self.rank, FinalizeStep::PeersReleased);
        // No PE releases its heap before every peer let go of it.
        keep(self.boot.barrier());
        drop(self.stream.take());
        if first.is_some() {
            // A peer may not have arrived: it must not touch this heap.
            self.state.fail(FINALIZE_FAILED, self.rank);
        }
        finalize_step(self.rank, FinalizeStep::HeapReleasing);
        let Live {
            boot,
            memory,
            _binding,
            ..
        } = self;
        drop(memory);
        drop(_binding);
        drop(boot);
        match first {
            Some(e) => Err(e.context("finalize")),
            None => Ok(FinalizeReport { leaked }),
        }
    }

    fn check_pe(&self, pe: usize) -> Result<()> {
        if pe >= self.size {
            return Err(ShmemError::InvalidArgument(format!(
                "PE {pe} is not in a world of {} PEs",
                self.size
            )));
        }
        Ok(())
    }

    /// PE `pe`'s address of `[local, local + bytes)`, checked to lie in one
    /// live allocation of this PE's heap (allocations are symmetric), in a
    /// healthy world: the one gate every transfer and signal passes.
    fn remote(&self, local: u64, bytes: usize, pe: usize, what: &str) -> Result<u64> {
        self.state.check()?;
        self.check_pe(pe)?;
        let offset = local.checked_sub(self.base).map(|o| o as usize);
        let o = match offset {
            Some(o) if o >= self.internal && o.checked_add(bytes).is_some_and(|end| end <= self.len) => o,
            _ => return Err(ShmemError::InvalidArgument(format!(
                "{what} [{local:#x}, +{bytes}) is not inside the symmetric heap [{:#x}, {:#x}) of rank {}",
                self.base + self.internal as u64,
                self.base + self.len as u64,
                self.rank
            ))),
        };
        // Allocations are symmetric: a block live here is live on every PE.
        if self.alloc.containing(o, bytes).is_none() {
            return Err(ShmemError::InvalidArgument(format!(
                "{what} [{local:#x}, +{bytes}) is not inside one live allocation of rank {} (freed already, or spans two objects)",
                self.rank
            )));
        }
        Ok(self.peers[pe].base + o as u64)
    }

    fn signal_word(&self, signal: u64, pe: usize) -> Result<u64> {
        if signal % 8 != 0 {
            return Err(ShmemError::InvalidArgument(format!(
                "signal {signal:#x} is not 8-byte aligned"
            )));
        }
        self.remote(signal, 8, pe, "signal word")
    }

    fn stream_or(&self, stream: Option<*mut std::ffi::c_void>) -> cudarc::driver::sys::CUstream {
        match stream {
            Some(s) => s.cast(),
            None => self.stream.as_ref().map_or(std::ptr::null_mut(), |s| s.raw),
        }
    }

    /// # Safety
    /// Both ranges valid for `bytes`.
    unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        match self.device.platform {
            Platform::Host => {
                // SAFETY: the caller's contract; `copy` allows overlap (a
                // put to oneself).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                fence(Ordering::Release);
                Ok(())
            }
            // SAFETY: the caller's contract.
            Platform::Cuda => unsafe {
                crate::cuda::copy(self.device, dst, src, bytes, self.stream_or(stream))
            },
        }
    }

    fn read_word(&self, addr: u64) -> Result<u64> {
        match self.device.platform {
            // SAFETY: an aligned word of a mapped heap, accessed atomically.
            Platform::Host => Ok(unsafe { &*(addr as *const AtomicU64) }.load(Ordering::Acquire)),
            Platform::Cuda => {
                // SAFETY: an aligned word of this PE's heap.
                unsafe { crate::cuda::read_word(self.device, addr) }
            }
        }
    }

    fn quiet(&mut self) -> Result<()> {
        match &self.stream {
            None => {
                fence(Ordering::SeqCst);
                Ok(())
            }
            Some(s) => {
                s.sync()?;
                let err_word = self.base + 8 * self.size as u64 + 8;
                let e = self.read_word(err_word)?;
                if e != 0 {
                    // Clear it so the report comes once.
                    // SAFETY: this PE's error word.
                    unsafe {
                        crate::cuda::write_device(self.device, err_word, &0u64.to_ne_bytes())
                    }?;
                    return Err(ShmemError::Timeout(format!(
                        "barrier_on_stream on rank {}: rank {} did not arrive within {:?}",
                        self.rank,
                        e - 1,
                        self.timeout
                    )));
                }
                Ok(())
            }
        }
    }

    /// Checks that every PE makes the same collective call: (what, seq,
    /// argument) must be equal everywhere; a difference is reported on
    /// every PE with every PE's call.
    fn collective(&mut self, what: &str, arg: u64) -> Result<()> {
        // A failed world has a PE that will never come.
        self.state.check()?;
        let seq = self.seq;
        self.seq += 1;
        let mine = format!("{what}\n{seq}\n{arg}");
        let all = self.boot.allgather(mine.as_bytes())?;
        if all.iter().all(|a| a == mine.as_bytes()) {
            return Ok(());
        }
        let calls: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, a)| format!("rank {r}: {}", describe_call(a)))
            .collect();
        Err(ShmemError::Mismatch(format!(
            "PEs disagree in collective call #{seq} (malloc, free, barrier_all and finalize must be called in the same order with the same sizes on every PE): {}",
            calls.join("; ")
        )))
    }
}

/// One PE's collective call as the others see it ("malloc #3 of 4096
/// bytes"), from its `what\nseq\narg` record.
fn describe_call(record: &[u8]) -> String {
    let f = fields(record);
    let (what, seq, arg) = match f.as_slice() {
        [w, s, a] => (w.as_str(), s.as_str(), a.as_str()),
        _ => return "a call that is not malloc, free, barrier_all or finalize".into(),
    };
    match what {
        "malloc" => format!("malloc #{seq} of {arg} bytes"),
        "free" if arg == u64::MAX.to_string() => {
            format!("free #{seq} of an address outside the heap")
        }
        "free" => format!("free #{seq} of offset {arg}"),
        _ => format!("{what} #{seq}"),
    }
}

/// Rank 0 makes the world's state page (shared memory when some PE is in
/// another process); every PE maps it: same-process PEs by a handoff,
/// others by name. Returns the page and, on rank 0, its offer (withdrawn
/// once every PE mapped it).
fn state_page(
    boot: &mut dyn Bootstrap,
    c: &Config,
    cross: bool,
    same_process: &dyn Fn(usize) -> bool,
) -> Result<(StatePage, Option<Offer>)> {
    let made = if c.rank == 0 {
        let name = format!("/xcall-state-{}-{}", std::process::id(), unique());
        let page = if cross {
            HostHeap::shared(&name, STATE_PAGE)
        } else {
            HostHeap::private(STATE_PAGE)
        };
        page.map(|p| {
            let p = Arc::new(p);
            (p.clone(), handoff::offer(p), name)
        })
    } else {
        Err(ShmemError::State("not rank 0".into()))
    };
    let (announce, local) = match made {
        Ok((page, offer, name)) => (Ok(format!("{}\n{name}", offer.token)), Some((page, offer))),
        Err(e) if c.rank == 0 => (Err(e), None),
        Err(_) => (Ok(String::new()), None),
    };
    let announce = agree(boot, announce)?;
    let from_zero = fields(&boot.broadcast(0, announce.as_bytes())?);
    let mapped = match local {
        Some((page, offer)) => Ok((StatePage::SameProcess(page), Some(offer))),
        None if same_process(0) => from_zero
            .first()
            .and_then(|t| t.parse().ok())
            .and_then(handoff::take::<HostHeap>)
            .map(|p| (StatePage::SameProcess(p), None))
            .ok_or_else(|| {
                ShmemError::Mismatch("rank 0's state page is not on offer in this process".into())
            }),
        None => match from_zero.get(1) {
            Some(name) => HostMapping::open(name, STATE_PAGE).map(|m| (StatePage::Mapped(m), None)),
            None => Err(ShmemError::Mismatch(
                "rank 0 sent a malformed state page name".into(),
            )),
        },
    };
    agree(boot, mapped)
}

/// Direction of [`World::transfer`].
#[derive(Clone, Copy)]
enum Dir {
    Put,
    Get,
}

fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
