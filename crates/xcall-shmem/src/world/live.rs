//! A live world: what one PE holds (its heap, its peers, its bootstrap,
//! its stream) and the internals every transfer, signal and wait uses.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use xcall_core::{Device, Platform};

use super::config::SignalOp;
use super::layout::{staged_word, STAGED_WORDS};
use super::state::{StatePage, EXCHANGE_TIMED_OUT, NCCL_FAILED};
use crate::bootstrap::Bootstrap;
use crate::cuda::WaitCode;
use crate::error::{Result, ShmemError};
use crate::heap::Allocator;
use crate::registry::Binding;
use crate::transport::host_shared_memory::{HostHeap, HostMapping};
use crate::transport::Transport;

pub(super) enum Memory {
    Host(HostHeap),
    Cuda(crate::transport::cuda_ipc::DeviceHeap),
}

pub(super) enum PeerMap {
    /// Nothing held (finalize dropped it).
    Released,
    /// A PE of this process (this PE included): its heap, held so that it
    /// stays mapped while this PE can reach it.
    SameProcess(#[allow(dead_code)] Arc<Memory>),
    /// A PE reached through NCCL or TCP only: nothing mapped.
    Unmapped,
    Host(#[allow(dead_code)] HostMapping),
    Cuda(#[allow(dead_code)] crate::transport::cuda_ipc::IpcMapping),
}

pub(super) struct Peer {
    pub(super) device: Device,
    /// Its heap's base in this process; 0 when it is not mapped (NCCL,
    /// TCP).
    pub(super) base: u64,
    pub(super) map: PeerMap,
    pub(super) transport: Transport,
}

pub(super) struct Live {
    // Dropped first: an aborted communicator ends its kernels before the
    // memory they use goes.
    pub(super) nccl: Option<crate::transport::nccl::Comm>,
    /// The TCP connections of a Host PE's unmapped pairs.
    pub(super) mesh: Option<crate::transport::tcp::Mesh>,
    pub(super) state: StatePage,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) device: Device,
    pub(super) name: String,
    pub(super) timeout: Duration,
    pub(super) boot: Box<dyn Bootstrap>,
    pub(super) base: u64,
    pub(super) len: usize,
    pub(super) alloc: Allocator,
    pub(super) internal: usize,
    pub(super) seq: u64,
    /// Signal values staged so far ([`Live::stage_word`]).
    pub(super) staged: u64,
    pub(super) peers: Vec<Peer>,
    pub(super) stream: Option<crate::cuda::OwnStream>,
    // Dropped last, in this order (fields drop in declaration order).
    pub(super) memory: Arc<Memory>,
    pub(super) _binding: Binding,
    /// A Host PE counted among the process's live ones.
    pub(super) _host_pe: Option<xcall_core::host_pool::HostPe>,
}

/// Refuses a signal word that is not 8-byte aligned.
pub(super) fn aligned_signal(signal: u64) -> Result<()> {
    if signal % 8 != 0 {
        return Err(ShmemError::InvalidArgument(format!(
            "signal {signal:#x} is not 8-byte aligned"
        )));
    }
    Ok(())
}

impl Live {
    pub(super) fn check_pe(&self, pe: usize) -> Result<()> {
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
    pub(super) fn remote(&self, local: u64, bytes: usize, pe: usize, what: &str) -> Result<u64> {
        let o = self.offset(local, bytes, pe, what, true)?;
        Ok(self.peers[pe].base + o as u64)
    }

    /// The heap offset of `[local, local + bytes)`, checked as
    /// [`Live::remote`] checks it, for a put into PE `pe`'s NCCL window.
    pub(super) fn window_offset(
        &self,
        local: u64,
        bytes: usize,
        pe: usize,
        what: &str,
    ) -> Result<usize> {
        self.offset(local, bytes, pe, what, false)
    }

    /// [`Live::remote`]'s checks, the peer's heap mapped when `mapped`.
    fn offset(
        &self,
        local: u64,
        bytes: usize,
        pe: usize,
        what: &str,
        mapped: bool,
    ) -> Result<usize> {
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
        if mapped && matches!(self.peers[pe].map, PeerMap::Unmapped) {
            return Err(ShmemError::Unsupported(match self.peers[pe].transport {
                Transport::NcclOneSided => format!(
                    "{what}: PE {pe} is reached through NCCL, whose one-sided operations are puts: move data from it with World::exchange"
                ),
                t => format!(
                    "{what}: PE {pe} is reached through {} (two-sided): move data to it with World::exchange",
                    match t {
                        Transport::Tcp => "TCP",
                        _ => "NCCL",
                    }
                ),
            }));
        }
        // Allocations are symmetric: a block live here is live on every PE.
        if self.alloc.containing(o, bytes).is_none() {
            return Err(ShmemError::InvalidArgument(format!(
                "{what} [{local:#x}, +{bytes}) is not inside one live allocation of rank {} (freed already, or spans two objects)",
                self.rank
            )));
        }
        Ok(o)
    }

    /// Whether puts reach PE `pe` through NCCL's one-sided operations.
    pub(super) fn puts_through_nccl(&self, pe: usize) -> bool {
        self.peers.get(pe).is_some_and(|p| {
            p.transport == Transport::NcclOneSided && matches!(p.map, PeerMap::Unmapped)
        })
    }

    /// The world's NCCL communicator, unless a failure aborted it.
    pub(super) fn comm(&self) -> Result<&crate::transport::nccl::Comm> {
        self.nccl.as_ref().ok_or_else(|| {
            ShmemError::State(
                "the world's NCCL communicator was aborted after a failure; only finalize remains"
                    .into(),
            )
        })
    }

    /// Refuses a put through NCCL on a stream that captures a CUDA graph:
    /// NCCL's captured one-sided puts wait for their receiver's
    /// `ncclWaitSignal`, a call xcall's receivers never make (they poll the
    /// signal word), so a replay would wait for ever.
    pub(super) fn refuse_captured_put(
        &self,
        pe: usize,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        // SAFETY: the caller's stream or this PE's own, live.
        if unsafe { crate::cuda::capturing(self.device, self.stream_or(stream)) }? {
            return Err(ShmemError::Unsupported(format!(
                "a put to PE {pe}, which is reached through NCCL, on a stream capturing a CUDA graph: NCCL's captured one-sided puts need a call on the receiving side; capture World::exchange instead"
            )));
        }
        Ok(())
    }

    /// One-sided puts to PE `pe` through NCCL, in order, on `stream`.
    ///
    /// # Safety
    /// Every source readable for its bytes until the stream ran the puts;
    /// every destination offset checked ([`Live::window_offset`]); the
    /// stream not capturing ([`Live::refuse_captured_put`]).
    pub(super) unsafe fn nccl_put(
        &self,
        pe: usize,
        puts: &[(u64, usize, usize)],
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        let comm = self.comm()?;
        let s = self.stream_or(stream);
        let state = &self.state;
        // SAFETY: the caller's contract; the stream is the caller's or
        // this PE's own.
        unsafe { comm.put(pe, puts, s.cast(), self.timeout, &|| state.check()) }
    }

    /// A word of this PE's internal region holding `value` once `stream`
    /// gets there: the source of a signal word put through NCCL. One of
    /// [`STAGED_WORDS`] in turn.
    pub(super) fn stage_word(
        &mut self,
        value: u64,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<u64> {
        let slot = self.staged % STAGED_WORDS as u64;
        self.staged = self.staged.wrapping_add(1);
        let word = self.base + staged_word(self.size, slot as usize);
        self.update_word(word, value, SignalOp::Set, stream)?;
        Ok(word)
    }

    pub(super) fn signal_word(&self, signal: u64, pe: usize) -> Result<u64> {
        aligned_signal(signal)?;
        self.remote(signal, 8, pe, "signal word")
    }

    /// This PE's error word: where its stream kernels (barrier, waits)
    /// leave a timeout for the next quiet.
    pub(super) fn error_word(&self) -> u64 {
        self.base + 8 * self.size as u64 + 8
    }

    /// The parameters of a wait on this PE's stream that reports `code`
    /// after the world's timeout.
    pub(super) fn wait_params(
        &self,
        signal: u64,
        value: u64,
        eq: bool,
        take: u64,
        code: WaitCode,
    ) -> crate::cuda::WaitParams {
        crate::cuda::WaitParams {
            signal,
            value,
            eq: eq as u64,
            take,
            error_word: self.error_word(),
            code: code.word(),
            timeout_ns: self.timeout_ns(),
        }
    }

    /// The world's timeout for the stream kernels that wait.
    pub(super) fn timeout_ns(&self) -> u64 {
        self.timeout.as_nanos().min(u64::MAX as u128) as u64
    }

    pub(super) fn stream_or(
        &self,
        stream: Option<*mut std::ffi::c_void>,
    ) -> xcall_core::cuda::RawStream {
        match stream {
            Some(s) => s.cast(),
            None => self
                .stream
                .as_ref()
                .map_or(std::ptr::null_mut(), |s| s.raw()),
        }
    }

    /// # Safety
    /// Both ranges valid for `bytes`.
    pub(super) unsafe fn copy(
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

    pub(super) fn read_word(&self, addr: u64) -> Result<u64> {
        match self.device.platform {
            // SAFETY: an aligned word of a mapped heap, accessed atomically.
            Platform::Host => Ok(unsafe { &*(addr as *const AtomicU64) }.load(Ordering::Acquire)),
            Platform::Cuda => {
                // SAFETY: an aligned word of this PE's heap.
                unsafe { crate::cuda::read_word(self.device, addr) }
            }
        }
    }

    /// Sets the signal word at `word` (an aligned word of a mapped heap) to
    /// `value`, or adds `value` to it (wrapping: `u64::MAX` takes one
    /// back); on CUDA a kernel ordered on the stream.
    pub(super) fn update_word(
        &self,
        word: u64,
        value: u64,
        op: SignalOp,
        stream: Option<*mut std::ffi::c_void>,
    ) -> Result<()> {
        match self.device.platform {
            Platform::Host => {
                // SAFETY: an aligned word of a mapped heap; every access
                // to signal words is atomic.
                let w = unsafe { &*(word as *const AtomicU64) };
                match op {
                    SignalOp::Set => w.store(value, Ordering::Release),
                    SignalOp::Add => {
                        w.fetch_add(value, Ordering::AcqRel);
                    }
                }
                Ok(())
            }
            Platform::Cuda => {
                let k = crate::cuda::kernels(self.device)?;
                let params = crate::cuda::SignalParams {
                    signal: word,
                    value,
                    op: op as u64,
                };
                // SAFETY: xcall_shmem_signal takes SignalParams; `word` is
                // an aligned word of a mapped heap.
                unsafe {
                    crate::cuda::launch(self.device, &k.signal, 1, self.stream_or(stream), &params)
                }
            }
        }
    }

    pub(super) fn quiet(&mut self) -> Result<()> {
        match &self.stream {
            None => {
                fence(Ordering::SeqCst);
                Ok(())
            }
            Some(s) => {
                if let Some(comm) = &self.nccl {
                    // NCCL's kernels wait for their peers: poll, so that a
                    // failed or silent peer ends in an error, not a hang.
                    let state = &self.state;
                    let polled = crate::error::poll(self.timeout, || {
                        let idle = crate::cuda::idle(s)?;
                        comm.progress("a transfer")?;
                        state.check()?;
                        Ok(idle)
                    })
                    .and_then(|idle| match idle {
                        true => Ok(()),
                        false => Err(ShmemError::Timeout(format!(
                            "rank {}: this PE's transfers did not complete within {:?} (a peer of an NCCL pair did not take part)",
                            self.rank, self.timeout
                        ))),
                    });
                    if let Err(e) = polled {
                        // Aborting the communicator ends its kernels; the
                        // world is failed for every PE of this host.
                        self.nccl = None;
                        self.state.fail(NCCL_FAILED, self.rank);
                        tracing::warn!(rank = self.rank, error = %e, "NCCL transfers failed; communicator aborted");
                        return Err(e);
                    }
                }
                crate::cuda::sync(s)?;
                let err_word = self.error_word();
                let word = self.read_word(err_word)?;
                if word == 0 {
                    return Ok(());
                }
                // Clear it so the report comes once.
                // SAFETY: this PE's error word.
                unsafe { crate::cuda::write_device(self.device, err_word, &0u64.to_ne_bytes()) }?;
                let (me, t) = (self.rank, self.timeout);
                let e = ShmemError::Timeout(match WaitCode::from_word(word) {
                    Some(WaitCode::Barrier { rank }) => format!(
                        "barrier_on_stream on rank {me}: rank {rank} did not arrive within {t:?}"
                    ),
                    Some(WaitCode::Signal { .. }) => format!(
                        "wait_until_on_stream on rank {me}: the signal did not hold within {t:?}"
                    ),
                    Some(WaitCode::Exchange { sender }) => {
                        // The exchange counts are off: a later exchange
                        // could take stale data for new. Nothing more
                        // crosses this world.
                        self.state.fail(EXCHANGE_TIMED_OUT, me);
                        format!(
                            "an exchange on rank {me}'s stream: PE {sender}'s segments did not land within {t:?}; only finalize remains"
                        )
                    }
                    None => format!(
                        "rank {me}'s error word holds {word:#x}, which no xcall kernel writes"
                    ),
                });
                tracing::warn!(rank = me, error = %e, "a wait on the stream timed out");
                Err(e)
            }
        }
    }
}
