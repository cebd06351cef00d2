//! A dispatch's routing saved into a caller's buffer and put back later,
//! for callers that make several dispatches before the combines and
//! backward calls of the first (a framework running many layers, then
//! their gradients in reverse order), and an empty phase that makes a
//! call safe whatever ran before it (a recorded call replayed after
//! calls its recording never saw).
//!
//! What combine, `dispatch_backward` and `combine_backward` read of a
//! dispatch is this PE's own: its published ids (`[T, k]`), the tokens
//! each sender published (`[P]`), and per received route its local
//! expert, prob and row (`[P, T, k]` each). Peers read the ids of it
//! while counting a dispatch, and (Host PEs of one process) the probs
//! and rows while summing a combine or `dispatch_backward` (which ends
//! with an empty phase), so after an empty phase a PE may put them back
//! with no peer in the middle of reading them.

use std::ffi::c_void;

use crate::args::{need, Buf};
use crate::cuda::Step;
use crate::error::{EpError, Result};
use crate::group::EpGroup;

/// (offset in the group's allocation, offset in the saved buffer, bytes)
/// of each part a saved routing holds.
type Parts = [(usize, usize, usize); 3];

impl EpGroup {
    fn saved_parts(&self) -> Parts {
        let (c, l, at) = (&self.config, &self.layout, &self.layout.at);
        // Checked by the layout: P * T * k routes fit i32.
        let ids = c.tokens * c.topk * 4;
        let sent = l.pes * 4;
        let routes = l.pes * c.tokens * c.topk * 4;
        // local, recv_probs and route_row follow one another (each on
        // 256 bytes): one span from the first to the end of the last.
        let span = at.route_row + routes - at.local;
        let sent_at = ids.div_ceil(256) * 256;
        let span_at = sent_at + sent.div_ceil(256) * 256;
        [
            (at.ids, 0, ids),
            (at.sent, sent_at, sent),
            (at.local, span_at, span),
        ]
    }

    /// Bytes of the buffer [`EpGroup::save_routing`] fills.
    pub fn routing_bytes(&self) -> usize {
        let [.., (_, at, bytes)] = self.saved_parts();
        at + bytes
    }

    /// Copies this PE's routing of the last dispatch into `dst`
    /// ([`EpGroup::routing_bytes`], 16-byte aligned; this PE's memory),
    /// enqueued on `stream` after the dispatch (Host: now). Not
    /// collective.
    ///
    /// # Safety
    /// `dst` is this PE's memory of at least its given size, valid until
    /// the stream has run the copy, not read or written meanwhile.
    pub unsafe fn save_routing(&self, dst: Buf, stream: *mut c_void) -> Result<()> {
        self.not_pending_save()?;
        self.dispatched.ok_or_else(|| {
            EpError::State("save_routing needs a dispatch first; call dispatch".into())
        })?;
        need("routing", dst, self.routing_bytes(), 16)?;
        for (group_at, saved_at, bytes) in self.saved_parts() {
            // SAFETY: the group's part and `dst` (checked above) hold
            // `bytes` from these offsets.
            unsafe {
                self.copy(
                    dst.addr + saved_at as u64,
                    self.base + group_at as u64,
                    bytes,
                    stream,
                )
            }?;
        }
        Ok(())
    }

    /// An empty phase on every PE (collective), then this PE's routing put
    /// back from `src` (filled by [`EpGroup::save_routing`] after a
    /// dispatch of `tokens` tokens of this group): the combine and backward
    /// calls after it use that dispatch's layout. Enqueued on `stream`
    /// (Host: run now, waiting for the peers).
    ///
    /// # Safety
    /// `src` is this PE's memory of at least its given size, holding what
    /// `save_routing` wrote, valid and unwritten until the stream has run
    /// the copy.
    pub unsafe fn restore_routing(
        &mut self,
        src: Buf,
        tokens: usize,
        stream: *mut c_void,
    ) -> Result<()> {
        self.not_pending_save()?;
        if tokens > self.config.tokens {
            return Err(EpError::InvalidArgument(format!(
                "{tokens} tokens is more than the group's {}",
                self.config.tokens
            )));
        }
        need("routing", src, self.routing_bytes(), 16)?;
        // SAFETY: `src` was checked; the copies go to this PE's own parts.
        unsafe {
            self.phase_barrier(stream)?;
            for (group_at, saved_at, bytes) in self.saved_parts() {
                self.copy(
                    self.base + group_at as u64,
                    src.addr + saved_at as u64,
                    bytes,
                    stream,
                )?;
            }
        }
        self.dispatched = Some(tokens);
        Ok(())
    }

    /// An empty phase on every PE (collective, enqueued on `stream`; Host:
    /// run now): once it has passed, no peer still reads anything this PE
    /// published before it, whatever the calls before it were. A call
    /// recorded into a graph after it is safe however the graph is
    /// replayed.
    ///
    /// # Safety
    /// `stream` is a live stream of this PE's device (CUDA) or ignored
    /// (Host).
    pub unsafe fn phase_barrier(&mut self, stream: *mut c_void) -> Result<()> {
        self.not_pending_save()?;
        if self.layout.pes > 1 {
            // SAFETY: signal and wait touch only the group's allocation.
            unsafe { self.run(&[Step::Signal, Step::Wait], &self.params(), stream) }?;
        }
        self.last = None;
        Ok(())
    }

    fn not_pending_save(&self) -> Result<()> {
        match self.pending {
            Some(_) => Err(EpError::State(
                "a dispatch_send waits for its dispatch_recv; call dispatch_recv first".into(),
            )),
            None => Ok(()),
        }
    }

    /// Copies `bytes` from `src` to `dst`, both this PE's memory: on Host
    /// now, on CUDA enqueued on `stream`.
    ///
    /// # Safety
    /// Both ranges hold `bytes`, valid until the copy has run.
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, stream: *mut c_void) -> Result<()> {
        match &self.kernels {
            // SAFETY: the caller's contract; host memory.
            None => unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes)
            },
            Some(_) => {
                // SAFETY: the caller's stream of this PE's device.
                let s = unsafe {
                    xcall_core::cuda::Stream::from_raw(
                        self.device,
                        stream as xcall_core::cuda::RawStream,
                    )
                };
                // SAFETY: the caller's contract; device memory of the
                // stream's device.
                s.in_context(|s| unsafe { s.copy_dtod(dst, src, bytes) })?;
            }
        }
        Ok(())
    }
}
