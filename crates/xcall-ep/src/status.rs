//! What a group reports: its words (the dropped-route counter, the first
//! error a kernel met) and, when asked, each step kernel's time.

use crate::config::word;
use crate::cuda;
use crate::error::{EpError, Result};
use crate::group::EpGroup;
use std::ffi::c_void;

impl EpGroup {
    /// Records an event after `what` on `stream` when profiling.
    pub(crate) fn mark(&self, what: &'static str, stream: *mut c_void) -> Result<()> {
        let mut marks = self.marks.borrow_mut();
        let Some(marks) = marks.as_mut() else {
            return Ok(());
        };
        let e = xcall_core::cuda::Event::new(self.device)?;
        // SAFETY: the caller's stream, live while the call runs.
        unsafe { e.record(stream as xcall_core::cuda::RawStream) }?;
        marks.push((what, e));
        Ok(())
    }

    /// Turns per-step timing on (CUDA, eager calls only: not while a
    /// stream captures): every step kernel is followed by an event; see
    /// [`EpGroup::take_profile`].
    pub fn profile(&mut self, on: bool) {
        *self.marks.get_mut() = on.then(Vec::new);
    }

    /// Each step's time in ms since the profile was turned on or last
    /// taken, in order (synchronize the stream first); profiling stays on.
    pub fn take_profile(&mut self) -> Result<Vec<(&'static str, f32)>> {
        let Some(marks) = self.marks.get_mut().as_mut() else {
            return Ok(Vec::new());
        };
        let taken = std::mem::take(marks);
        let mut out = Vec::with_capacity(taken.len());
        for w in taken.windows(2) {
            out.push((w[1].0, w[1].1.elapsed_ms_since(&w[0].1)?));
        }
        Ok(out)
    }

    fn words(&self) -> Result<[u64; word::COUNT]> {
        let mut w = [0u64; word::COUNT];
        let addr = self.base + self.layout.at.words as u64;
        match &self.kernels {
            // SAFETY: the group's words part.
            Some(_) => unsafe { cuda::read_words(self.device, addr, &mut w) }?,
            None => {
                for (i, v) in w.iter_mut().enumerate() {
                    // SAFETY: as above; atomics, as peers read them.
                    *v = unsafe {
                        std::sync::atomic::AtomicU64::from_ptr((addr as *mut u64).add(i))
                    }
                    .load(std::sync::atomic::Ordering::Acquire);
                }
            }
        }
        Ok(w)
    }

    /// Routes dropped by the capacity on this PE, summed over every
    /// dispatch so far. On CUDA, synchronize the calls' streams first.
    pub fn dropped_routes(&self) -> Result<u64> {
        Ok(self.words()?[word::DROPPED])
    }

    /// The first error a CUDA kernel of this PE met since the last check
    /// (a peer that did not reach a phase in time, or routing this PE
    /// published that was not taken), then clears it. Synchronize the
    /// calls' streams first. Host calls report their errors themselves.
    pub fn check(&self) -> Result<()> {
        let w = self.words()?[word::ERROR];
        if w == 0 {
            return Ok(());
        }
        let addr = self.base + (self.layout.at.words + word::ERROR * 8) as u64;
        match self.kernels.is_some() {
            // SAFETY: the group's error word.
            true => unsafe { cuda::write_words(self.device, addr, &[0]) }?,
            // SAFETY: as above, host memory; atomics, as peers' steps may
            // run.
            false => unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) }
                .store(0, std::sync::atomic::Ordering::Release),
        }
        let who = (w & 0xffff_ffff).saturating_sub(1);
        Err(match w >> 32 {
            1 => EpError::Timeout(format!(
                "PE {} waited {:?} for PE {who} to reach a phase",
                self.rank, self.timeout
            )),
            3 => EpError::Timeout(format!(
                "PE {}: the low-latency kernel's blocks waited {:?} for each other at a \
                 grid-wide barrier (not all resident: SMs held by other work, or an SM \
                 limit below the group's budget); the group's state is lost, make it again",
                self.rank, self.timeout
            )),
            _ => EpError::BadRouting(format!(
                "PE {}: expert id(s) outside -1..{} or repeated within a token; \
                 those routes were not taken",
                self.rank, self.config.experts
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EpConfig;
    use xcall_core::{Device, Platform};
    use xcall_shmem::{World, WorldConfig};

    /// The error word's two codes, as the kernels write them, read back
    /// by `check` (naming the peer or the routing) and cleared.
    #[test]
    fn check_reads_the_kernels_error_codes_and_clears_them() {
        let c = EpConfig {
            kernels: crate::EpKernels::LowLatency,
            ..EpConfig::new(8, 8, 2, 4)
        };
        let mut wc = WorldConfig::in_process(
            &format!("ep-check-{}", std::process::id()),
            0,
            1,
            Device::new(Platform::Host, 0),
        );
        wc.heap_bytes = Some(c.layout(1).unwrap().heap_bytes + (1 << 20));
        let mut w = World::new();
        w.init(&wc).unwrap();
        let g = EpGroup::new(&mut w, c).unwrap();
        // Host groups run the steps, whatever the config asks of CUDA.
        assert!(!g.low_latency());
        let at = (g.base + (g.layout.at.words + word::ERROR * 8) as u64) as *mut u64;
        assert_eq!(g.check(), Ok(()));
        // kind << 32 | (1 + rank): 1 a wait on PE 3 that timed out, 2
        // routing this PE published that was not taken.
        for (value, want) in [
            ((1u64 << 32) | 4, "for PE 3"),
            ((2 << 32) | 1, "outside -1..4"),
            ((3 << 32) | 1, "grid-wide barrier"),
        ] {
            // SAFETY: the group's error word, host memory.
            unsafe { at.write_volatile(value) };
            let e = g.check().unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
            let status = if value >> 32 != 2 {
                xcall_core::Status::Timeout
            } else {
                xcall_core::Status::InvalidArgument
            };
            assert_eq!(e.status(), status);
            assert_eq!(g.check(), Ok(()), "cleared");
        }
        // The dropped-route counter is the word after it.
        // SAFETY: as above.
        unsafe { at.add(1).write_volatile(17) };
        assert_eq!(g.dropped_routes(), Ok(17));
        g.destroy(&mut w).unwrap();
        w.finalize().unwrap();
    }
}
