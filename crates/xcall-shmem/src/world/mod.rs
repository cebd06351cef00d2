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
//!    (plus an IPC handle when some peer is in another process), or
//!    `ncclMemAlloc` when NCCL pairs may take one-sided puts (no IPC pair,
//!    and every PE's NCCL has them; see [`Transport::NcclOneSided`]);
//! 5. map every peer: same process: its address as is (CUDA: after
//!    enabling peer access; never IPC inside one process); other process:
//!    `shm_open` + `mmap` / `cuIpcOpenMemHandle`;
//! 6. barrier, then remove the shared-memory names (nothing is left in
//!    /dev/shm even if a process dies later);
//! 7. reserve the internal region at offset 0 (barrier words) and zero it.
//!
//! The modules follow the steps: `init` runs them in order (1, 2, 4, 6,
//! 7), `identities` is step 3, `peers` step 5 for mapped pairs and
//! `connections` for the pairs NCCL or TCP carry; `finalize` mirrors
//! them. A live world's internals are in `live`, the internal region's
//! words in `layout`, the collectives in `collective` (on `agreement`),
//! and [`World::exchange`] in `exchange` (its lists agreed on in `lists`).
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

use xcall_core::{Device, Platform};

use crate::cuda::WaitCode;
use crate::error::{Result, ShmemError};
use live::{Live, PeerMap};
use state::LEFT_WITHOUT_FINALIZE;

pub use crate::limits::{MAX_GATHER_BYTES, MAX_PES};
pub use crate::transport::Transport;

mod agreement;
mod collective;
mod config;
mod connections;
mod exchange;
mod finalize;
mod identities;
mod init;
mod layout;
mod lists;
mod live;
mod peers;
mod state;

pub use config::{
    BootstrapKind, Cmp, FinalizeReport, Pairs, SignalOp, WorldConfig, DEFAULT_CUDA_HEAP,
    DEFAULT_HOST_HEAP, DEFAULT_TIMEOUT, HEAP_ENV, TRANSPORT_ENV,
};
pub use exchange::{Incoming, Outgoing};
pub use state::{set_finalize_hook, FinalizeHook, FinalizeStep};

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
        Ok(l.peers[pe].transport)
    }

    /// How long a wait on other PEs lasts before it fails (the
    /// [`WorldConfig::timeout`] the world started with).
    pub fn timeout(&self) -> Result<std::time::Duration> {
        Ok(self.live()?.timeout)
    }

    /// This PE's heap: (base address, bytes). User allocations start after
    /// the internal region.
    pub fn heap(&self) -> Result<(u64, usize)> {
        let l = self.live()?;
        Ok((l.base, l.len))
    }

    /// Joins the world described by `config`; collective over all PEs.
    pub fn init(&mut self, config: &WorldConfig) -> Result<()> {
        if self.phase == Phase::Live {
            let l = self.live()?;
            return Err(ShmemError::State(format!(
                "init on a live world (rank {} of {:?}); finalize it first",
                l.rank, l.name
            )));
        }
        let live = Live::init(config)
            .map_err(|e| e.context(format!("init of rank {}", config.rank)))
            .inspect_err(|e| {
                tracing::warn!(rank = config.rank, size = config.size, error = %e, "shmem init failed")
            })?;
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
    ///
    /// With NCCL pairs: destroy every CUDA graph (and executable graph)
    /// that captured this world's exchanges first. NCCL does not finish
    /// (nor abort) a communicator while such a graph lives, so a PE that
    /// still holds one is refused ([`ShmemError::State`], naming how many)
    /// before any collective step, and its world stays live: destroy them
    /// and finalize again, within the timeout its peers wait in finalize.
    /// A world dropped while such graphs live aborts its communicator on
    /// a thread of its own instead of waiting: the abort ends their
    /// running kernels at once, and NCCL frees the communicator once they
    /// are destroyed (see [`crate::transport::nccl::settle_aborts`]).
    pub fn finalize(&mut self) -> Result<FinalizeReport> {
        self.live()?.no_graphs_hold_nccl()?;
        let live = self.live.take().expect("checked live");
        self.phase = Phase::Finalized;
        let (rank, size) = (live.rank, live.size);
        let bootstrap = live.name.clone();
        let report = live.finalize();
        match &report {
            Ok(r) => tracing::info!(
                bootstrap,
                rank,
                size,
                leaked = r.leaked.len(),
                "shmem world finalized"
            ),
            Err(e) => {
                tracing::warn!(bootstrap, rank, size, error = %e, "shmem world finalize failed")
            }
        }
        report
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
    /// PE's heap), or `None` when `local` is outside the heap, `pe` is
    /// not a PE, or `pe` is reached through NCCL (not addressable; this PE
    /// itself always is).
    ///
    /// The address stays mapped while this PE is live, even after PE `pe`
    /// left; xcall checks nothing done through it.
    pub fn ptr(&self, pe: usize, local: u64) -> Option<u64> {
        let l = self.live().ok()?;
        let offset = local
            .checked_sub(l.base)
            .filter(|&o| (o as usize) < l.len)?;
        let p = l.peers.get(pe)?;
        (!matches!(p.map, PeerMap::Unmapped)).then_some(p.base + offset)
    }

    /// Copies `bytes` from `src` (this PE's memory: Host memory, or on
    /// CUDA any address the device can read) to the object at `dest` (a
    /// symmetric address of this PE) on PE `pe`. Blocking.
    ///
    /// A PE reached through NCCL takes puts only as
    /// [`Transport::NcclOneSided`] (an `ncclPutSignal`; `src` then device
    /// memory, in the heap across hosts; not on a stream capturing a
    /// graph); through [`Transport::Nccl`] or [`Transport::Tcp`] data
    /// moves with [`World::exchange`] alone.
    ///
    /// # Safety
    /// `src` must be readable for `bytes` bytes.
    pub unsafe fn put(&mut self, dest: u64, src: u64, bytes: usize, pe: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.transfer(Dir::Put, src, dest, bytes, pe, None) }?;
        self.quiet()
    }

    /// Copies `bytes` from the object at `src` (a symmetric address of
    /// this PE) on PE `pe` to `dest` (this PE's memory). Blocking. A PE
    /// reached through NCCL or TCP is refused ([`World::exchange`]).
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
        if l.puts_through_nccl(pe) && matches!(dir, Dir::Put) {
            let offset = l.window_offset(symmetric, bytes, pe, "put destination")?;
            l.refuse_captured_put(pe, stream)?;
            // SAFETY: the destination was checked to lie in one live
            // allocation of the peer's window, the stream does not
            // capture; `local` is the caller's contract.
            return unsafe { l.nccl_put(pe, &[(local, offset, bytes)], stream) };
        }
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
    /// reports a wait on a CUDA stream that timed out since the last
    /// quiet (`barrier_on_stream`, `wait_until_on_stream`, an exchange's;
    /// sync the stream that ran it first). An exchange that timed out
    /// also fails the world.
    pub fn quiet(&mut self) -> Result<()> {
        self.live_mut()?.quiet()
    }

    /// Waits until every PE called it (after [`World::quiet`]); collective.
    pub fn barrier_all(&mut self) -> Result<()> {
        let l = self.live_mut()?;
        l.quiet()?;
        l.collective("barrier_all", 0)
    }

    /// Every PE's `data`, indexed by rank: small host-side messages (sizes,
    /// offsets, results to report) through the world's bootstrap, never
    /// the data path. Collective: every PE calls it, in the same order as
    /// its other collectives, each with its own `data` (lengths may
    /// differ). At most [`MAX_GATHER_BYTES`] per PE; a PE offering more
    /// makes the call fail on every PE naming it. Over a TCP or Unix
    /// socket bootstrap every PE's data together must fit in
    /// [`crate::bootstrap::MAX_FRAME`] bytes. A PE that never calls makes
    /// the others time out; completes nothing on the stream (no quiet).
    pub fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.live_mut()?.allgather(data.len() as u64, data)
    }

    /// [`World::allgather`] of `offered` bytes, for callers (the C ABI)
    /// whose data need not be readable past the limit: above
    /// [`MAX_GATHER_BYTES`], `data` is not read and the call fails on
    /// every PE naming this one; otherwise `data` must hold exactly
    /// `offered` bytes (`InvalidArgument` before the collective if not).
    pub fn allgather_offered(&mut self, offered: u64, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.live_mut()?.allgather(offered, data)
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
        if l.nccl.is_some() {
            return Err(ShmemError::Unsupported(
                "barrier_on_stream needs every PE addressable; a world with NCCL pairs takes barrier_all".into(),
            ));
        }
        l.state.check()?;
        let k = crate::cuda::kernels(l.device)?;
        let n = l.size as u64;
        let params = crate::cuda::BarrierParams {
            peer_arrivals: l.base + 8 * n + 16,
            my_arrivals: l.base,
            epoch_word: l.base + 8 * n,
            error_word: l.error_word(),
            rank: l.rank as i64,
            n: n as i64,
            timeout_ns: l.timeout_ns(),
        };
        // SAFETY: xcall_shmem_barrier takes BarrierParams; the addresses
        // are this PE's internal region (pointer table filled at init).
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
        let l = self.live_mut()?;
        if l.puts_through_nccl(pe) {
            // The data, then the signal word (its value staged in this
            // PE's internal region): two puts NCCL lands in that order.
            if op != SignalOp::Set {
                return Err(ShmemError::Unsupported(format!(
                    "put_signal with {op:?} to PE {pe}, which is reached through NCCL: NCCL's one-sided puts cannot add to a word; signal with Set, or move data with World::exchange"
                )));
            }
            live::aligned_signal(signal)?;
            let sig = l.window_offset(signal, 8, pe, "signal word")?;
            let offset = l.window_offset(dest, bytes, pe, "put destination")?;
            l.refuse_captured_put(pe, stream)?;
            let staged = l.stage_word(value, stream)?;
            let puts = [(src, offset, bytes), (staged, sig, 8)];
            // SAFETY: both destinations were checked to lie in live
            // allocations of the peer's window, the stream does not
            // capture; `src` is the caller's contract and `staged` is this
            // PE's internal region.
            return unsafe { l.nccl_put(pe, &puts, stream) };
        }
        let sig = self.live()?.signal_word(signal, pe)?;
        // SAFETY: the caller's contract.
        unsafe { self.transfer(Dir::Put, src, dest, bytes, pe, stream) }?;
        self.live()?.update_word(sig, value, op, stream)
    }

    /// Moves data between PEs in one collective step, on every transport:
    /// each [`Outgoing`] copies `bytes` from this PE's `src` to the object
    /// at the symmetric address `dest` on PE `pe`; each [`Incoming`] is
    /// this PE's side of a peer's outgoing segment. Blocking: returns once
    /// every incoming segment has landed and every outgoing one was read.
    ///
    /// The one way to move data to a PE reached through NCCL (whose
    /// send/receive are two-sided): the NCCL pairs' segments go as one
    /// NCCL group, the others as copies (direct pointers, shared memory,
    /// IPC) each followed by a signal to its receiver, who waits for it.
    /// Every PE calls it; PE `a` lists an outgoing segment to `b` exactly
    /// when `b` lists an incoming one from `a`, with the same bytes and
    /// the same `dest`, in the same order per pair (NCCL's rule). A
    /// destination is written once its sender reaches the exchange: as
    /// with [`World::put`], a PE must not reuse one before its owner is
    /// done with the data there.
    ///
    /// Before anything moves, every PE's lists (summed per peer) meet
    /// through the bootstrap, as a collective call numbered with the
    /// others: lists that disagree fail the exchange on every PE with
    /// [`ShmemError::Mismatch`] naming the ranks and sizes, a segment one
    /// PE refuses (a bad PE or destination) fails it on every PE with that
    /// PE's error, and in both cases nothing is written and nothing
    /// counts toward a later exchange. So the call waits on the host
    /// until every PE reached it (with a stream too, also while a graph
    /// captures it), and a PE that never comes makes it time out.
    ///
    /// # Safety
    /// Every `src` readable for its bytes until the exchange completes
    /// (on CUDA: memory of this PE's device; NCCL reads it on the device).
    pub unsafe fn exchange(&mut self, outgoing: &[Outgoing], incoming: &[Incoming]) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.live_mut()?.exchange(outgoing, incoming, None) }?;
        self.quiet()
    }

    /// [`World::exchange`] ordered on the caller's CUDA `stream`: every
    /// copy, signal, wait and NCCL call is enqueued there (capturable into
    /// a graph); on Host it is the blocking exchange.
    ///
    /// # Safety
    /// As [`World::exchange`], for as long as the stream runs it.
    pub unsafe fn exchange_on_stream(
        &mut self,
        outgoing: &[Outgoing],
        incoming: &[Incoming],
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.live_mut()?.exchange(outgoing, incoming, Some(stream)) }
    }

    /// Waits until the signal word at `signal` (a symmetric address of
    /// this PE) satisfies `cmp` against `value`; returns the value seen.
    /// Gives up after the world's timeout.
    pub fn wait_until(&mut self, signal: u64, cmp: Cmp, value: u64) -> Result<u64> {
        let l = self.live_mut()?;
        let rank = l.rank;
        let sig = l.signal_word(signal, rank)?;
        let mut x = 0;
        // A peer that left will never signal: say so now, not at the
        // timeout.
        let held = crate::error::poll(l.timeout, || {
            l.state.check()?;
            x = l.read_word(sig)?;
            Ok(cmp.holds(x, value))
        })?;
        if held {
            return Ok(x);
        }
        let e = ShmemError::Timeout(format!(
            "rank {rank} waited {:?} for signal {signal:#x} {cmp:?} {value}; it holds {x}",
            l.timeout
        ));
        tracing::warn!(rank, error = %e, "wait_until timed out");
        Err(e)
    }

    /// Makes the caller's CUDA `stream` wait until the signal word at
    /// `signal` is `== value` ([`Cmp::Eq`]) or `>= value` ([`Cmp::Ge`],
    /// unsigned, as in [`World::wait_until`]). Capturable into a graph.
    /// The wait is a kernel that gives up after the world's timeout: the
    /// stream then goes on (without the data the signal guarded), and
    /// the next quiet or barrier_all reports the timeout.
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
        let params = l.wait_params(sig, value, cmp == Cmp::Eq, 0, WaitCode::Signal { rank });
        // SAFETY: `sig` is an aligned word of this PE's heap (checked) and
        // the error word is its internal region's, both mapped for the
        // world's life.
        unsafe { crate::cuda::wait_on_stream(l.device, stream.cast(), &params) }
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

/// Direction of [`World::transfer`].
#[derive(Clone, Copy)]
enum Dir {
    Put,
    Get,
}
