//! A PE's step (see the module docs of [`super`]): the row-id map, the
//! permute into the destinations' slots, dispatch, the experts, combine
//! and the unpermute, enqueued on the PE's stream on CUDA; and the step
//! with every phase's end marked.

use std::ffi::c_void;
use std::time::Instant;

use xcall_core::cuda::Event;
use xcall_core::{Device, Platform};
use xcall_permute::call::Target;
use xcall_permute::{ExpertGroups, RowIdMapOptions};
use xcall_shmem::{Cmp, Incoming, Outgoing, SignalOp};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::Variant;
use xcall_warpspec::ops::{GroupScales, RaggedGroups};
use xcall_warpspec::OpCall;

use super::super::data::Shape;
use super::{Buffers, Pe};
use crate::layer::{Context, Dims, Res};

/// Where the PE waits for its peers' signals.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Waits {
    /// The host thread polls (with the world's timeout): the eager
    /// warm-up step, where a failing peer must not hang the others.
    Host,
    /// The PE's CUDA stream waits (a kernel that gives up after the
    /// world's timeout; the barrier reports it): capturable.
    Stream,
}

/// The phases of a per-route step, in order (see the module docs).
const PHASES: [&str; 8] = [
    "map",
    "permute",
    "dispatch",
    "dispatch wait",
    "experts",
    "combine",
    "combine wait",
    "unpermute",
];

/// The phases of the token-once step (`pe::token`).
const TOKEN_PHASES: [&str; 3] = ["dispatch", "experts", "combine"];

/// The phases of a step of `shape`, in the order a step marks them.
pub fn phases(shape: &Shape) -> &'static [&'static str] {
    match shape.ep {
        Some(_) => &TOKEN_PHASES,
        None => &PHASES,
    }
}

/// The end of a phase: an event on the PE's stream, or the host clock (a
/// Host step runs synchronously).
pub(super) enum Mark {
    Event(Event),
    Clock(Instant),
}

/// The segments of the copy exchange on PE `me` as one
/// `World::exchange`: the dispatch (`combine == false`: dropless, each
/// slot's counts first, then the slot of `rows`) or the combine (the
/// results' slots), with the slot indices of the `put_signal` path (see
/// the module docs). PE `me + j` receives what `me` sends it, in order.
pub(super) fn copy_segments(
    shape: &Shape,
    b: &Buffers,
    me: usize,
    combine: bool,
) -> (Vec<Outgoing>, Vec<Incoming>) {
    let p = shape.pes;
    let slot = Pe::slot_bytes(shape) as u64;
    let l = shape.local_experts() as u64;
    let (mut out, mut inc) = (Vec::new(), Vec::new());
    for j in 1..p as u64 {
        let to = (me + j as usize) % p;
        let from = (me + p - j as usize) % p;
        if combine {
            out.push(Outgoing {
                pe: to,
                src: b.results + (j - 1) * slot,
                dest: b.results + (2 * p as u64 - 1 - j) * slot,
                bytes: slot as usize,
            });
            inc.push(Incoming {
                pe: from,
                dest: b.results + (2 * p as u64 - 1 - j) * slot,
                bytes: slot as usize,
            });
            continue;
        }
        let counts = b.counts + (p as u64 - 1 - j) * l * 8;
        let rows = b.rows + (p as u64 - 1 - j) * slot;
        if shape.dropless {
            out.push(Outgoing {
                pe: to,
                src: b.layer.tpe + j * l * 8,
                dest: counts,
                bytes: (l * 8) as usize,
            });
            inc.push(Incoming {
                pe: from,
                dest: counts,
                bytes: (l * 8) as usize,
            });
        }
        out.push(Outgoing {
            pe: to,
            src: b.rows + (p as u64 - 1 + j) * slot,
            dest: rows,
            bytes: slot as usize,
        });
        inc.push(Incoming {
            pe: from,
            dest: rows,
            bytes: slot as usize,
        });
    }
    (out, inc)
}

impl Pe {
    /// One step of the layer (see the module docs), enqueued on the PE's
    /// stream on CUDA.
    pub fn step(&mut self, waits: Waits) -> Res<()> {
        self.step_marked(waits, &mut None)
    }

    /// One eager step with the end of every phase marked; returns each
    /// phase's time in ms ([`phases`] order). On CUDA the whole step is
    /// enqueued before any mark is read, so a phase's time is device time
    /// (plus any wait for the host to enqueue it) and the waits are on the
    /// stream, as in a captured step; the step starts after a barrier of
    /// the PEs' streams.
    pub fn phase_step(&mut self) -> Res<Vec<f64>> {
        let mut marks = Some(Vec::with_capacity(phases(&self.shape).len() + 1));
        // The first phase starts once every PE's stream reached it (an
        // untimed barrier on the streams, as for the timed steps): a PE
        // whose host enqueued late would otherwise add its delay to its
        // peers' first phase, which waits for it on the device.
        if let Some(stream) = self.gpu.as_ref().map(|g| g.stream.stream()) {
            self.stream_barrier(stream)?;
        }
        self.mark(&mut marks)?;
        let waits = match self.gpu {
            Some(_) => Waits::Stream,
            None => Waits::Host,
        };
        self.step_marked(waits, &mut marks)?;
        let marks = marks.unwrap_or_default();
        // Every mark is enqueued: once the stream ran them all, each
        // phase's time is there to read.
        self.drain()?;
        marks
            .windows(2)
            .map(|w| match w {
                [Mark::Event(a), Mark::Event(b)] => {
                    Ok(b.elapsed_ms_since(a).context("CUDA event")? as f64)
                }
                [Mark::Clock(a), Mark::Clock(b)] => Ok((*b - *a).as_secs_f64() * 1e3),
                _ => Err("a step mixed event and clock marks".to_string()),
            })
            .collect()
    }

    /// Records the end of a phase into `marks` (nothing when `None`).
    pub(super) fn mark(&self, marks: &mut Option<Vec<Mark>>) -> Res<()> {
        let Some(marks) = marks else {
            return Ok(());
        };
        marks.push(match &self.gpu {
            None => Mark::Clock(Instant::now()),
            Some(g) => {
                let e = Event::new(self.device).context("CUDA event")?;
                e.record_on(&g.stream).context("CUDA event")?;
                Mark::Event(e)
            }
        });
        Ok(())
    }

    pub(super) fn step_marked(&mut self, waits: Waits, marks: &mut Option<Vec<Mark>>) -> Res<()> {
        if self.ep.is_some() {
            // The group's waits are on the stream (kernels that time out)
            // on CUDA, and on the host on Host.
            return self.token_step(marks);
        }
        let s = self.shape;
        let (b, stream) = (self.b, self.stream());
        let target = match self.device.platform {
            Platform::Host => Target::host(),
            Platform::Cuda => Target::cuda(self.device.ordinal, stream),
        };
        let d = Dims {
            tokens: s.tokens as u64,
            hidden: s.hidden as u64,
            experts: s.experts as u64,
            rows: (s.pes * s.slot_rows()) as u64,
            dtype: s.dtype,
        };
        let options = if s.dropless {
            RowIdMapOptions {
                groups: Some(ExpertGroups {
                    experts: s.local_experts(),
                    rows: s.slot_rows(),
                }),
                ..RowIdMapOptions::default()
            }
        } else {
            RowIdMapOptions {
                capacity: Some(s.capacity),
                ..RowIdMapOptions::default()
            }
        };
        let (p, slot) = (s.pes as u64, Self::slot_bytes(&s) as u64);
        // SAFETY: (this and the layer calls below) every buffer is this PE's
        // heap allocation for exactly these dims, alive for the world's life.
        unsafe { b.layer.make_row_id_map(&target, d, options) }?;
        self.mark(marks)?;
        if s.fused {
            // Destination j's rows go straight to PE me + j's receive slot
            // for me's rows, P - 1 - j (the own slot, P - 1, for j = 0).
            let bases = self.peer_slots(b.rows, |j| p - 1 - j)?;
            // SAFETY: as above; each base is a slot of [S, H] in a PE's
            // `rows` (a peer's through its mapping), none of which another
            // PE writes or the owner reads until this step's dispatch
            // signal (see the module docs).
            unsafe {
                b.layer
                    .permute_segments(&target, d, &bases, s.slot_rows() as u64)
            }?;
        } else {
            // SAFETY: as above; the send half of `rows` holds P slots of
            // [S, H], none of which a peer writes.
            unsafe { b.layer.permute(&target, d, b.rows + (p - 1) * slot) }?;
        }
        self.mark(marks)?;
        // Send slot j >= 1 (slot P - 1 + j of `rows`) goes to PE me + j,
        // into the slot of me's rows there, P - 1 - j (fused: already
        // there, only the signal goes). Dropless, each slot's row counts
        // go with it.
        let (counts, copy) = (s.dropless, !s.fused);
        if self.remote.is_some() {
            self.exchange_all(false, stream)?;
            self.mark(marks)?;
        } else {
            self.exchange(
                b.rows,
                (|j| p - 1 + j, |j| p - 1 - j),
                b.dispatch,
                (counts, copy),
                stream,
            )
            .context("dispatch put_signal")?;
            self.mark(marks)?;
            self.await_all(b.dispatch, waits)?;
        }
        self.mark(marks)?;
        self.experts(stream)?;
        self.mark(marks)?;
        // The results of PE me + j's rows (slot j - 1, where they were in
        // `rows`) go back to it, into the slot of its send slot P - j (the
        // one it sent to me): slot 2P - 1 - j of its `results`. Fused,
        // only the signal goes: PE me + j reads them where they are.
        if self.remote.is_some() {
            self.exchange_all(true, stream)?;
            self.mark(marks)?;
        } else {
            self.exchange(
                b.results,
                (|j| j - 1, |j| 2 * p - 1 - j),
                b.combine,
                (false, copy),
                stream,
            )
            .context("combine put_signal")?;
            self.mark(marks)?;
            self.await_all(b.combine, waits)?;
        }
        self.mark(marks)?;
        if s.fused {
            // Destination j's results are in PE me + j's `results`, in the
            // slot of me's rows there, P - 1 - j.
            let bases = self.peer_slots(b.results, |j| p - 1 - j)?;
            // SAFETY: as above; each base is a slot of [S, H] that its
            // owner's experts wrote before its combine signal, and no PE
            // writes until this PE's next dispatch signal.
            unsafe {
                b.layer
                    .unpermute_segments(&target, d, &bases, s.slot_rows() as u64, b.y)
            }?;
        } else {
            // SAFETY: as above; the receive half of `results` holds P
            // slots of [S, H] in the order permute wrote, and `y` [T, H].
            unsafe {
                b.layer
                    .unpermute(&target, d, b.results + (p - 1) * slot, b.y)
            }?;
        }
        self.mark(marks)
    }

    /// For each destination `j` in `0..P` (PE `me + j`): the address, as
    /// this PE reaches it, of slot `slot(j)` of `buffer` on that PE.
    pub(super) fn peer_slots(&self, buffer: u64, slot: impl Fn(u64) -> u64) -> Res<Vec<u64>> {
        let (me, p) = (self.rank, self.shape.pes);
        let bytes = Self::slot_bytes(&self.shape) as u64;
        (0..p as u64)
            .map(|j| {
                let q = (me + j as usize) % p;
                self.world
                    .ptr(q, buffer + slot(j) * bytes)
                    .ok_or_else(|| format!("PE {q} has no address for this PE's slot {}", slot(j)))
            })
            .collect()
    }

    /// For every peer `q = me + j` (`j` in `1..P`): with `copy`, the slot
    /// at `source(j)` of `buffer` goes to slot `dest(j)` of `buffer` on PE
    /// `q`; then SET `signals[me] = 1` there (ordered after the slot, and
    /// after everything enqueued before on CUDA). `with_counts`: the
    /// slot's `L` counts (of `tpe`) first, into `counts` there.
    pub(super) fn exchange(
        &mut self,
        buffer: u64,
        (source, dest): (impl Fn(u64) -> u64, impl Fn(u64) -> u64),
        signals: u64,
        (with_counts, copy): (bool, bool),
        stream: *mut c_void,
    ) -> Res<()> {
        let (me, p) = (self.rank, self.shape.pes);
        let slot = Self::slot_bytes(&self.shape) as u64;
        let l = self.shape.local_experts() as u64;
        for j in 1..p as u64 {
            let q = (me + j as usize) % p;
            if with_counts {
                // The slot's L counts (tokens_per_expert of PE q's experts)
                // into the counts of the slot they land in there; ordered
                // before the put_signal below on the same stream.
                // SAFETY: `tpe` holds E = P*L counts and `counts` (P-1)*L
                // before it; both indices are in range.
                unsafe {
                    self.world.put_nbi(
                        self.b.counts + (p as u64 - 1 - j) * l * 8,
                        self.b.layer.tpe + j * l * 8,
                        (l * 8) as usize,
                        q,
                        stream,
                    )
                }
                .map_err(|e| e.to_string())?;
            }
            // Fused: a signal only (no bytes), after the permute's or the
            // experts' stores into and out of the peers' slots.
            let bytes = if copy { slot } else { 0 };
            // SAFETY: `buffer` is one of this PE's heap buffers of 2P - 1
            // slots when copying, and both slot indices are below 2P - 1;
            // fused, nothing is copied.
            unsafe {
                self.world.put_signal_nbi(
                    buffer + if copy { dest(j) * slot } else { 0 },
                    buffer + if copy { source(j) * slot } else { 0 },
                    bytes as usize,
                    signals + 8 * me as u64,
                    1,
                    SignalOp::Set,
                    q,
                    stream,
                )
            }
            .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The copy exchange's dispatch or combine as one `World::exchange`
    /// on `stream` (a world with NCCL pairs; its waits are the
    /// exchange's own, so its "wait" phase is empty).
    pub(super) fn exchange_all(&mut self, combine: bool, stream: *mut c_void) -> Res<()> {
        let (out, inc) = copy_segments(&self.shape, &self.b, self.rank, combine);
        let what = if combine { "combine" } else { "dispatch" };
        // SAFETY: every segment is a slot (or a slot's counts) of this
        // PE's heap buffers, alive for the world's life, and no PE writes
        // a slot that its owner still reads (see the module docs).
        unsafe { self.world.exchange_on_stream(&out, &inc, stream) }
            .map_err(|e| format!("{what} exchange: {e}"))
    }

    /// Waits until every peer set its word of the signal array at `base`,
    /// then clears the words (ordered after the wait).
    pub(super) fn await_all(&mut self, base: u64, waits: Waits) -> Res<()> {
        let (me, stream) = (self.rank, self.stream());
        for p in (0..self.shape.pes).filter(|&p| p != me) {
            let word = base + 8 * p as u64;
            if self.device.platform == Platform::Cuda && waits == Waits::Stream {
                self.world
                    .wait_until_on_stream(word, Cmp::Eq, 1, stream)
                    .context("shmem wait")?;
            } else {
                self.world
                    .wait_until(word, Cmp::Eq, 1)
                    .context("shmem wait")?;
            }
            // A zero-byte put to itself whose signal SETs the word to 0.
            // SAFETY: copies nothing.
            unsafe {
                self.world
                    .put_signal_nbi(word, word, 0, word, 0, SignalOp::Set, me, stream)
            }
            .context("shmem signal reset")?;
        }
        Ok(())
    }

    /// `out = silu(recv) * scale_e` for every (sender, local expert)
    /// block of `C` rows, or dropless every ragged group of rows the
    /// counts give, in one call.
    /// The experts' op, `silu(x) * scale_e`, on `bytes` of `inputs[0]`
    /// into `output`, with per-block scales or ragged groups; on the
    /// PE's device (a Host PE's on the one Host device: its own names its
    /// slot in the world, host:rank).
    pub(super) fn expert_call<'a>(
        &self,
        stream: *mut c_void,
        inputs: &'a [u64],
        output: u64,
        bytes: u64,
        (scales, ragged): (Option<GroupScales>, Option<RaggedGroups>),
    ) -> OpCall<'a> {
        OpCall {
            sms: 0,
            device: match self.device.platform {
                Platform::Host => Device::HOST,
                Platform::Cuda => self.device,
            },
            stream,
            op: ElementwiseOp::SiluScale,
            dtype: self.shape.dtype,
            config: self.ops,
            variant: Variant::WarpSpecialized,
            host: self.host,
            inputs,
            output,
            bytes,
            scale: 0.0,
            scales,
            ragged,
        }
    }

    pub(super) fn experts(&mut self, stream: *mut c_void) -> Res<()> {
        let s = self.shape;
        let block = (s.capacity * s.row_bytes()) as u64;
        let (scales, ragged) = if s.dropless {
            let ragged = RaggedGroups {
                scales: self.b.scales,
                rows: self.b.counts,
                segments: s.pes as u64,
                groups: s.local_experts() as u64,
                segment_bytes: Self::slot_bytes(&s) as u64,
                row_bytes: s.row_bytes() as u64,
            };
            (None, Some(ragged))
        } else {
            let scales = GroupScales {
                addr: self.b.scales,
                group_bytes: block,
            };
            (Some(scales), None)
        };
        let inputs = [self.b.rows];
        let bytes = (s.pes * Self::slot_bytes(&s)) as u64;
        let call = self.expert_call(stream, &inputs, self.b.results, bytes, (scales, ragged));
        // SAFETY: `rows`, `results`, `scales` and `counts` are distinct
        // buffers of this PE's heap (the first P slots of `rows` and of
        // `results` are exactly these bytes, `scales` one f32 per block,
        // `counts` P*L counts from its first), alive as long
        // as the world; no peer writes those slots of `rows` until this
        // PE's combine of the step, nor those of `results` ever (see the
        // module docs).
        unsafe { xcall_warpspec::run(&call) }.context("experts")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::Layer;
    use xcall_core::DType;

    fn shape(pes: usize, dropless: bool) -> Shape {
        Shape {
            pes,
            tokens: 64,
            hidden: 16,
            experts: 4 * pes,
            topk: 2,
            dtype: DType::F32,
            capacity: 40,
            dropless,
            fused: false,
            ep: None,
        }
    }

    fn buffers() -> Buffers {
        Buffers {
            layer: Layer {
                x: 1 << 40,
                routing: 2 << 40,
                probs: 3 << 40,
                map: 4 << 40,
                tpe: (5 << 40) + 4096,
                offsets: 6 << 40,
            },
            counts: 5 << 40,
            rows: 7 << 40,
            results: 8 << 40,
            y: 9 << 40,
            dispatch: 10 << 40,
            combine: 11 << 40,
            scales: 12 << 40,
        }
    }

    /// Every PE's exchange pairs up with every other's (NCCL's rule: the
    /// same bytes to the same place, in order), fills each receive slot
    /// exactly once, and sends from the send half only.
    #[test]
    fn copy_segments_pair_up_and_cover_every_receive_slot() {
        let b = buffers();
        for pes in [1, 2, 3, 5] {
            for dropless in [false, true] {
                let s = shape(pes, dropless);
                let slot = Pe::slot_bytes(&s) as u64;
                for combine in [false, true] {
                    let all: Vec<_> = (0..pes)
                        .map(|me| copy_segments(&s, &b, me, combine))
                        .collect();
                    let per_peer = if dropless && !combine { 2 } else { 1 };
                    for (a, (out, inc)) in all.iter().enumerate() {
                        assert_eq!(out.len(), (pes - 1) * per_peer);
                        assert_eq!(inc.len(), (pes - 1) * per_peer);
                        for q in (0..pes).filter(|&q| q != a) {
                            let sent: Vec<(u64, usize)> = out
                                .iter()
                                .filter(|o| o.pe == q)
                                .map(|o| (o.dest, o.bytes))
                                .collect();
                            let got: Vec<(u64, usize)> = all[q]
                                .1
                                .iter()
                                .filter(|i| i.pe == a)
                                .map(|i| (i.dest, i.bytes))
                                .collect();
                            assert_eq!(
                                sent, got,
                                "P={pes} dropless={dropless} combine={combine}: {a} -> {q}"
                            );
                        }
                        assert!(out.iter().all(|o| o.pe != a) && inc.iter().all(|i| i.pe != a));
                        let (base, recv_half, send_half) = match combine {
                            // Results: send the first P - 1 slots, receive into the last P - 1.
                            true => (b.results, pes as u64..2 * pes as u64 - 1, 0..pes as u64 - 1),
                            // Rows: receive into the first P - 1, send the last P - 1.
                            false => (b.rows, 0..pes as u64 - 1, pes as u64..2 * pes as u64 - 1),
                        };
                        let mut slots: Vec<u64> = inc
                            .iter()
                            .filter(|i| i.bytes == slot as usize && i.dest >= base)
                            .map(|i| (i.dest - base) / slot)
                            .collect();
                        slots.sort();
                        assert_eq!(slots, recv_half.collect::<Vec<_>>());
                        for o in out.iter().filter(|o| o.bytes == slot as usize) {
                            assert!(send_half.contains(&((o.src - base) / slot)));
                            assert_eq!((o.src - base) % slot, 0);
                        }
                    }
                }
            }
        }
    }
}
