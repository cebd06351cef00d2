//! A PE's step through the graph cache, timed; the copy rate the phases
//! are measured against; the memory in use.

use std::time::Instant;

use xcall_core::cuda::Event;
use xcall_core::{Device, Platform};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{Attributes, Buffer, Call, CallKey, GraphCache, Outcome};

use super::step::Waits;
use super::Pe;
use crate::layer::{Context, Res};

/// The graph-cache target id of the MoE step.
const TARGET: u64 = 0x6d6f_655f_7374_6570; // "moe_step"

impl Pe {
    /// The graph-cache key of this PE's step: its device, the shape and
    /// the peers' addresses as attributes (their bytes, compared in full),
    /// every buffer it touches.
    pub(super) fn key(&self) -> CallKey {
        let s = &self.shape;
        let mut bytes = Vec::with_capacity(8 * (9 + 2 * s.pes));
        for v in [
            s.pes, s.tokens, s.hidden, s.experts, s.topk, s.capacity, self.rank,
        ] {
            bytes.extend_from_slice(&(v as u64).to_le_bytes());
        }
        bytes.extend_from_slice(&[u8::from(s.dropless), u8::from(s.fused)]);
        if let Some(ep) = s.ep {
            for v in [
                u64::from(ep.fp8),
                ep.align as u64,
                ep.sms as u64,
                ep.kernels as u64,
                ep.microbatches as u64,
                u64::from(self.ep.as_ref().is_some_and(|t| t.in_turn)),
            ] {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        bytes.extend_from_slice(format!("{:?}", s.dtype).as_bytes());
        bytes.push(0);
        for pe in 0..s.pes {
            for local in [self.b.rows, self.b.results] {
                let ptr = self.world.ptr(pe, local).map_or(u64::MAX, |p| p);
                bytes.extend_from_slice(&ptr.to_le_bytes());
            }
        }
        CallKey {
            device: match self.device.platform {
                Platform::Host => Device::HOST,
                Platform::Cuda => self.device,
            },
            target: TARGET,
            attributes: Attributes::from_bytes(bytes),
            buffers: self
                .sizes
                .iter()
                .map(|&(a, bytes, role)| Buffer::new(a, bytes as u64, role))
                .collect(),
        }
    }

    /// Runs one step through the graph cache and returns what the cache
    /// did with the step's time: the host clock's on Host (the step ran),
    /// on CUDA events on the PE's stream, read once the stream drained
    /// past them ([`Queued::ms`]), so that the host runs ahead of the
    /// GPUs and its own delays stay out of the steps' times.
    pub fn queue_step(&mut self, cache: &GraphCache<CudaGraphs>) -> Res<Queued> {
        let key = self.key();
        let Some(stream) = self.gpu.as_ref().map(|g| g.stream.stream()) else {
            let start = Instant::now();
            let outcome = cache
                .execute(&Call::new(key, None), |_| self.step(Waits::Host))
                .context("graph cache")?;
            return Ok(Queued {
                outcome,
                ms: Some(start.elapsed().as_secs_f64() * 1e3),
                marks: None,
            });
        };
        let a = Event::new(self.device).context("CUDA event")?;
        let z = Event::new(self.device).context("CUDA event")?;
        // The step's clock starts once every PE's stream reached it (an
        // untimed barrier on the streams): a PE whose host enqueued late
        // would otherwise add its delay to its peers' steps, which wait
        // for it on the device. Worlds with NCCL pairs have no such
        // barrier; there the delay stays in.
        self.stream_barrier(stream)?;
        a.record_on(&stream).context("CUDA event")?;
        let handle = CudaStreamHandle(stream.raw());
        let outcome = cache
            .execute(&Call::new(key, Some(handle)), |_| self.step(Waits::Stream))
            .context("graph cache")?;
        z.record_on(&stream).context("CUDA event")?;
        Ok(Queued {
            outcome,
            ms: None,
            marks: Some((a, z)),
        })
    }

    /// A barrier of every PE's stream, enqueued on `stream`; nothing for
    /// one PE, nor in worlds with NCCL pairs, which have none.
    pub(super) fn stream_barrier(&mut self, stream: xcall_core::cuda::Stream) -> Res<()> {
        if self.shape.pes < 2 {
            return Ok(());
        }
        match self
            .world
            .barrier_on_stream(stream.raw() as *mut std::ffi::c_void)
        {
            Err(e) if e.status() == xcall_core::Status::Unsupported => Ok(()),
            r => r.context("shmem barrier on the stream"),
        }
    }

    /// With micro-batches on CUDA: the forked step and the same step in
    /// turn (every dispatch, then every micro-batch's experts on every SM,
    /// then every combine, one stream), each replayed
    /// from its graph `rounds` times, alternated, after one untimed round;
    /// the medians (forked, in turn). Each replay starts after a barrier
    /// of the PEs' streams and drains before the next. `None` where steps
    /// do not fork.
    pub fn fork_against_in_turn(
        &mut self,
        cache: &GraphCache<CudaGraphs>,
        rounds: usize,
    ) -> Res<Option<(f64, f64)>> {
        if rounds == 0 || self.ep.as_ref().is_none_or(|t| t.fork.is_none()) || self.gpu.is_none() {
            return Ok(None);
        }
        let (mut forked, mut in_turn) = (Vec::new(), Vec::new());
        for round in 0..=rounds {
            for turn in [false, true] {
                self.token_mut()?.in_turn = turn;
                let step = self.queue_step(cache);
                self.token_mut()?.in_turn = false;
                let step = step?;
                self.drain()?;
                if round > 0 {
                    let ms = step.ms()?;
                    if turn {
                        in_turn.push(ms)
                    } else {
                        forked.push(ms)
                    }
                }
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Ok(Some((median(&mut forked), median(&mut in_turn))))
    }

    /// The median ms of a device-to-device copy of `P` slots (the size of
    /// the permuted tensor), the first `P` of `rows` into the first `P` of
    /// `results` (token-once: the expert-major rows into the experts'
    /// outputs), on the PE's stream: the bandwidth the
    /// phases' byte floors are measured against. Each timing spans
    /// back-to-back copies of about 64 MiB in all (at most 64 copies),
    /// since one small copy's time is mostly its launch and would put the
    /// floors above what the phases reach. A tensor that fits in L2 is
    /// copied at L2's rate then, as small shapes' phases read theirs.
    /// `None` on Host.
    pub fn copy_ms(&mut self) -> Res<Option<f64>> {
        let Some(g) = &self.gpu else {
            return Ok(None);
        };
        // The expert-major rows into the experts' outputs (token-once), or
        // the first P slots of `rows` into those of `results`.
        // The summary divides these bytes by the time (`Pe::copy_bytes`).
        let bytes = Self::copy_bytes(&self.shape);
        let (dst, src) = match &self.ep {
            Some(t) => {
                let m = t.micro.first().ok_or("no micro-batch")?;
                // FP8 dispatch writes the bf16 rows alone.
                let rows = if self.shape.ep.is_some_and(|e| e.fp8) {
                    m.out.rows_bf16
                } else {
                    m.out.rows
                };
                if bytes > rows.bytes.min(m.expert_out.bytes) {
                    return Err(format!(
                        "the copy's {bytes} bytes exceed micro-batch 0's rows ({} bytes) or outputs ({} bytes)",
                        rows.bytes, m.expert_out.bytes
                    ));
                }
                (m.expert_out.addr, rows.addr)
            }
            None => (self.b.results, self.b.rows),
        };
        let stream = g.stream.stream();
        let repeats = (64usize << 20).div_ceil(bytes.max(1)).clamp(1, 64);
        let mut ms = Vec::new();
        for _ in 0..5 {
            let a = Event::new(self.device).context("CUDA event")?;
            let z = Event::new(self.device).context("CUDA event")?;
            a.record_on(&stream).context("CUDA event")?;
            for _ in 0..repeats {
                stream
                    .in_context(|s| {
                        // SAFETY: `rows` and `results` are distinct device
                        // allocations of this PE's heap, each holding at
                        // least P slots; neither is read or written by
                        // anyone else between steps.
                        unsafe { s.copy_dtod(dst, src, bytes) }
                    })
                    .context("cuMemcpyDtoDAsync")?;
            }
            z.record_on(&stream).context("CUDA event")?;
            self.drain()?;
            ms.push(z.elapsed_ms_since(&a).context("CUDA event")? as f64 / repeats as f64);
        }
        ms.sort_by(|x, y| x.total_cmp(y));
        Ok(Some(ms[ms.len() / 2]))
    }

    /// Bytes of memory in use: the device's (every context on it) on
    /// CUDA, the process's resident set on Host; `None` where the system
    /// does not say.
    pub fn memory_in_use(&self) -> Res<Option<u64>> {
        match &self.gpu {
            Some(_) => {
                let (free, total) =
                    xcall_core::cuda::mem_get_info(self.device).context("cuMemGetInfo")?;
                Ok(Some(total.saturating_sub(free) as u64))
            }
            None => Ok(resident_bytes()),
        }
    }
}

/// The process's resident set in bytes (Linux's `/proc/self/statm`).
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok()?.checked_mul(pages)
}

/// A step enqueued by [`Pe::queue_step`].
pub struct Queued {
    /// What the graph cache did.
    pub outcome: Outcome,
    ms: Option<f64>,
    marks: Option<(Event, Event)>,
}

impl Queued {
    /// The step's time in ms; on CUDA only once the PE's stream drained
    /// past it ([`Pe::drain`]).
    pub fn ms(&self) -> Res<f64> {
        match (&self.ms, &self.marks) {
            (Some(ms), _) => Ok(*ms),
            (None, Some((a, z))) => Ok(z.elapsed_ms_since(a).context("CUDA event")? as f64),
            (None, None) => Err("a step with neither a time nor events".into()),
        }
    }
}
