//! A PE of the token-once exchange (`--exchange token`, the default): the
//! step is xcall-ep's dispatch, the experts on its expert-major rows, and
//! its combine. Dispatch moves each token once to every PE hosting one
//! of its experts (on CUDA above decode sizes, that PE reads it from the
//! token's PE); there its rows are grouped by local expert (each group
//! starting on a multiple of `--align` rows) with the counts written by
//! the device; the experts (`silu(x) * scale_e`, warpspec, one ragged
//! group per local expert) read them and write the expert-major outputs;
//! combine sums each token's outputs on each PE and stores one row back,
//! where the token's PE adds the rows in rank order into `y`. Experts are
//! numbered as given (PE `q` hosts `q*L .. (q+1)*L`): no rotation.
//!
//! With `--microbatches N` a PE's tokens are split into `N` runs of
//! consecutive tokens, each with its own group and expert-major buffers.
//! On CUDA the step forks off the PE's stream onto two: the exchange
//! stream (created at the device's greatest priority, which the graph
//! cache's replays keep: each kernel node runs at its captured stream's
//! priority) runs every micro-batch's
//! dispatch in turn, then every combine in turn, micro-batch `i`'s combine
//! after its experts; the experts stream runs micro-batch `i`'s experts
//! after its dispatch, on the SMs the exchange's budget (`--sms`) leaves.
//! The PE's stream joins the last combine. So on every PE the exchanges
//! run in one order on one stream (none waits on a peer that waits on
//! it), while micro-batch `i`'s experts run beside dispatch `i + 1` or
//! combine `i - 1`. A token's output does not depend on the split: its
//! rows are summed in the same order.

use xcall_core::cuda::{Event, OwnedStream, Stream};
use xcall_ep::{Buf, Capacity, EpConfig, EpGroup, ExpertMajor, Layout, Precision};
use xcall_graph::BufferRole;
use xcall_shmem::World;
use xcall_warpspec::ops::RaggedGroups;

use super::super::data::{Inputs, Shape};
use super::Pe;
use crate::alloc::RunError;
use crate::layer::{Context, Res};

/// One micro-batch: its group, its expert-major rows and their outputs,
/// and its tokens of the PE's `[T, ..]` buffers.
pub(super) struct Micro {
    pub(super) group: EpGroup,
    pub(super) out: ExpertMajor,
    pub(super) expert_out: Buf,
    /// The micro-batch's first token and its number of tokens.
    pub(super) first: usize,
    pub(super) tokens: usize,
}

/// The streams and events of a forked step (CUDA, more than one
/// micro-batch; see the module docs).
pub(super) struct Fork {
    /// Every micro-batch's dispatch and combine, at the greatest priority.
    exchange: OwnedStream,
    /// Every micro-batch's experts.
    experts: OwnedStream,
    /// Recorded on the PE's stream where the step starts.
    start: Event,
    /// Per micro-batch: recorded after its dispatch, after its experts.
    dispatched: Vec<Event>,
    computed: Vec<Event>,
    /// Recorded after the last combine.
    done: Event,
    /// SMs the experts may occupy in a forked step: those the exchange's
    /// budget leaves (0: every SM, where the exchange may take them all).
    expert_sms: u32,
}

/// The groups and the PE's buffers of the token-once step.
pub(super) struct TokenPe {
    pub(super) micro: Vec<Micro>,
    pub(super) x: Buf,
    pub(super) ids: Buf,
    pub(super) probs: Buf,
    pub(super) y: Buf,
    /// `[L]` f32: each local expert's scale.
    pub(super) scales: Buf,
    pub(super) fork: Option<Fork>,
    /// Run the next steps in turn even where they could fork (to time
    /// both).
    pub(super) in_turn: bool,
}

/// Micro-batches of `shape` (1 without `--microbatches`).
pub(super) fn microbatches(shape: &Shape) -> usize {
    shape.ep.map_or(1, |e| e.microbatches.max(1))
}

/// The first token and the tokens of each micro-batch: `T` split into
/// `N` runs whose sizes differ by at most one (the larger first).
pub(super) fn split(tokens: usize, n: usize) -> Vec<(usize, usize)> {
    let (base, extra) = (tokens / n, tokens % n);
    let mut first = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            first += len;
            (first - len, len)
        })
        .collect()
}

/// The config of each micro-batch's group for `shape` (its tokens: the
/// largest micro-batch's).
pub(super) fn config(shape: &Shape) -> EpConfig {
    let ep = shape.ep.unwrap_or(super::super::data::EpShape {
        fp8: false,
        align: 1,
        sms: 0,
        kernels: xcall_ep::EpKernels::Auto,
        microbatches: 1,
    });
    EpConfig {
        tokens: shape.tokens.div_ceil(microbatches(shape)),
        hidden: shape.hidden,
        topk: shape.topk,
        experts: shape.experts,
        precision: match (ep.fp8, shape.dtype) {
            (true, _) => Precision::Fp8Dispatch,
            (false, xcall_core::DType::F32) => Precision::F32,
            _ => Precision::Bf16,
        },
        align: ep.align,
        capacity: Capacity::Dropless,
        num_sms: ep.sms,
        kernels: ep.kernels,
    }
}

/// The PE's buffers besides the groups' own, in order: x, ids, probs, y,
/// the experts' scales; then each micro-batch's: the expert-major rows
/// (f32 and bf16; 1 byte with FP8), a byte (no FP8 scales are asked
/// for), the bf16 rows (FP8 only; 1 byte otherwise), tokens_per_expert,
/// padded counts, the experts' outputs. `None` when a size passes
/// `usize`.
#[allow(clippy::type_complexity)]
pub(super) fn buffer_sizes(
    shape: &Shape,
) -> Option<(Layout, [(usize, BufferRole); 5], [(usize, BufferRole); 6])> {
    let c = config(shape);
    let layout = c.layout(shape.pes).ok()?;
    let (t, h, k, l) = (shape.tokens, shape.hidden, shape.topk, layout.local_experts);
    let rows = layout.expert_rows;
    let fp8 = c.precision == Precision::Fp8Dispatch;
    let row = h.checked_mul(shape.dtype.size_bytes())?;
    let expert_rows = rows.checked_mul(row)?;
    let wire = rows.checked_mul(h.checked_mul(c.precision.wire_bytes())?)?;
    Some((
        layout,
        [
            (t.checked_mul(row)?, BufferRole::In),
            (t.checked_mul(k)?.checked_mul(4)?, BufferRole::In),
            (t.checked_mul(k)?.checked_mul(4)?, BufferRole::In),
            (t.checked_mul(row)?, BufferRole::Out),
            (l * 4, BufferRole::In),
        ],
        // FP8: the bf16 rows alone (the experts read bf16; no FP8 rows,
        // no scales).
        [
            (if fp8 { 1 } else { wire }, BufferRole::InOut),
            (1, BufferRole::InOut),
            (if fp8 { expert_rows } else { 1 }, BufferRole::InOut),
            (l * 8, BufferRole::InOut),
            (l * 8, BufferRole::InOut),
            (expert_rows, BufferRole::InOut),
        ],
    ))
}

/// The symmetric heap a token-once PE needs: the groups, the buffers
/// (256-byte aligned) and 1 MiB per micro-batch and 1 MiB to spare.
pub(super) fn heap_bytes(shape: &Shape) -> Option<usize> {
    let (layout, full, each) = buffer_sizes(shape)?;
    let n = microbatches(shape);
    let aligned = |sizes: &[(usize, BufferRole)]| {
        sizes.iter().try_fold(0usize, |sum, (b, _)| {
            sum.checked_add(b.checked_next_multiple_of(256)?)
        })
    };
    let per_micro = aligned(&each)?
        .checked_add(layout.heap_bytes)?
        .checked_add(1 << 20)?;
    per_micro
        .checked_mul(n)?
        .checked_add(aligned(&full)?)?
        .checked_add((shape.pes + 4) * 16 + (1 << 20))
}

/// A buffer of the heap: address, bytes, role in the step.
pub(super) type Held = (u64, usize, BufferRole);

/// Allocates the buffers in `world` and makes the groups (collective),
/// and on CUDA with micro-batches the fork's streams and events.
pub(super) fn new(
    world: &mut World,
    shape: &Shape,
    device: xcall_core::Device,
) -> Result<(TokenPe, Vec<Held>), RunError> {
    let (_, full, each) = buffer_sizes(shape).ok_or("the layer's buffers pass usize")?;
    let fp8 = shape.ep.is_some_and(|e| e.fp8);
    let mut held = Vec::with_capacity(full.len() + each.len() * microbatches(shape));
    let mut alloc = |world: &mut World, (bytes, role): (usize, BufferRole)| {
        let a = world.malloc(bytes.max(1)).context("shmem malloc")?;
        held.push((a, bytes, role));
        Ok::<_, RunError>(Buf::new(a, bytes))
    };
    let [x, ids, probs, y, scales] = full;
    let (x, ids, probs) = (alloc(world, x)?, alloc(world, ids)?, alloc(world, probs)?);
    let (y, scales) = (alloc(world, y)?, alloc(world, scales)?);
    let mut micro = Vec::new();
    for (first, tokens) in split(shape.tokens, microbatches(shape)) {
        let group = EpGroup::new(world, config(shape)).context("expert-parallel group")?;
        let mut bufs = [Buf::NONE; 6];
        for (b, size) in bufs.iter_mut().zip(each) {
            *b = alloc(world, size)?;
        }
        let [rows, _, bf16, tpe, padded, expert_out] = bufs;
        micro.push(Micro {
            group,
            // FP8 dispatch writes the bf16 rows the experts read, alone.
            out: ExpertMajor {
                rows: if fp8 { Buf::NONE } else { rows },
                scales: Buf::NONE,
                rows_bf16: if fp8 { bf16 } else { Buf::NONE },
                tokens_per_expert: tpe,
                padded_per_expert: padded,
                offsets: Buf::NONE,
            },
            expert_out,
            first,
            tokens,
        });
    }
    let fork = match (device.platform, micro.len()) {
        (xcall_core::Platform::Cuda, n) if n > 1 => {
            let event = || Event::ordering(device).context("CUDA event");
            let sms = xcall_core::cuda::device_info(device)
                .context("CUDA device")?
                .multiprocessors
                .max(0) as usize;
            let exchange_sms = micro[0].group.sms_used();
            Some(Fork {
                exchange: OwnedStream::greatest_priority(device).context("CUDA stream")?,
                experts: OwnedStream::new(device).context("CUDA stream")?,
                start: event()?,
                dispatched: (0..n).map(|_| event()).collect::<Result<_, _>>()?,
                computed: (0..n).map(|_| event()).collect::<Result<_, _>>()?,
                done: event()?,
                expert_sms: sms.saturating_sub(exchange_sms) as u32,
            })
        }
        _ => None,
    };
    let tok = TokenPe {
        micro,
        x,
        ids,
        probs,
        y,
        scales,
        fork,
        in_turn: false,
    };
    Ok((tok, held))
}

/// `inputs`' routing as top-k ids and probs (`[T, k]`, experts in
/// ascending order; -1 past a token's routes), into `ids` and `probs`
/// (bytes).
pub(super) fn top_k(shape: &Shape, inputs: &Inputs, ids: &mut [u8], probs: &mut [u8]) {
    let (e, k) = (shape.experts, shape.topk);
    for t in 0..shape.tokens {
        let mut j = 0;
        for x in (0..e).filter(|&x| inputs.routing[t * e + x] != 0) {
            if j == k {
                break;
            }
            let at = 4 * (t * k + j);
            ids[at..at + 4].copy_from_slice(&(x as i32).to_le_bytes());
            probs[at..at + 4].copy_from_slice(&inputs.probs[t * e + x].to_le_bytes());
            j += 1;
        }
        for j in j..k {
            let at = 4 * (t * k + j);
            ids[at..at + 4].copy_from_slice(&(-1i32).to_le_bytes());
            probs[at..at + 4].copy_from_slice(&0f32.to_le_bytes());
        }
    }
}

/// Which part of a micro-batch's step to enqueue.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Dispatch,
    Experts,
    Combine,
}

impl Pe {
    pub(super) fn token(&self) -> Res<&TokenPe> {
        self.ep
            .as_ref()
            .ok_or_else(|| "not a token-once PE".to_string())
    }

    pub(super) fn token_mut(&mut self) -> Res<&mut TokenPe> {
        self.ep
            .as_mut()
            .ok_or_else(|| "not a token-once PE".to_string())
    }

    /// The token-once step: dispatch, experts, combine of every
    /// micro-batch. With `marks` (or on Host, or with one micro-batch) the
    /// parts run in turn on the PE's stream, every micro-batch's dispatch,
    /// then their experts, then their combines, each part's end marked;
    /// else forked (see the module docs).
    pub(super) fn token_step(&mut self, marks: &mut Option<Vec<super::step::Mark>>) -> Res<()> {
        let stream = self.stream();
        let tok = self.token()?;
        let n = tok.micro.len();
        if marks.is_some() || tok.fork.is_none() || tok.in_turn {
            for part in [Part::Dispatch, Part::Experts, Part::Combine] {
                for i in 0..n {
                    match part {
                        Part::Experts => self.token_experts(i, stream, 0)?,
                        _ => self.micro_part(i, part, stream)?,
                    }
                }
                self.mark(marks)?;
            }
            return Ok(());
        }
        self.forked_step()
    }

    /// The forked step (see the module docs).
    fn forked_step(&mut self) -> Res<()> {
        let main = self
            .gpu
            .as_ref()
            .ok_or("a forked step off CUDA")?
            .stream
            .stream();
        let fork = self.fork()?;
        let (n, sms) = (self.token()?.micro.len(), fork.expert_sms);
        let (x, e) = (fork.exchange.stream(), fork.experts.stream());
        let raw = |s: Stream| s.raw() as *mut std::ffi::c_void;
        let order = |s: Stream, event: &Event| s.wait_event(event).context("CUDA stream");
        let record = |s: Stream, event: &Event| event.record_on(&s).context("CUDA event");
        record(main, &self.fork()?.start)?;
        order(x, &self.fork()?.start)?;
        for i in 0..n {
            self.micro_part(i, Part::Dispatch, raw(x))?;
            record(x, &self.fork()?.dispatched[i])?;
        }
        for i in 0..n {
            order(e, &self.fork()?.dispatched[i])?;
            self.token_experts(i, raw(e), sms)?;
            record(e, &self.fork()?.computed[i])?;
        }
        for i in 0..n {
            order(x, &self.fork()?.computed[i])?;
            self.micro_part(i, Part::Combine, raw(x))?;
        }
        record(x, &self.fork()?.done)?;
        order(main, &self.fork()?.done)
    }

    /// The forked step's streams and events.
    fn fork(&self) -> Res<&Fork> {
        self.token()?
            .fork
            .as_ref()
            .ok_or_else(|| "a forked step without streams".to_string())
    }

    /// Enqueues micro-batch `i`'s dispatch or combine on `stream` (its
    /// experts: [`Pe::token_experts`]).
    fn micro_part(&mut self, i: usize, part: Part, stream: *mut std::ffi::c_void) -> Res<()> {
        let (h, k) = (self.shape.row_bytes(), self.shape.topk);
        let tok = self.token_mut()?;
        let (x, ids, probs, y) = (tok.x, tok.ids, tok.probs, tok.y);
        let m = tok.micro.get_mut(i).ok_or("no such micro-batch")?;
        let (first, tokens) = (m.first, m.tokens);
        let rows = |b: Buf, row: usize| Buf::new(b.addr + (first * row) as u64, tokens * row);
        match part {
            // SAFETY: every buffer is this PE's heap allocation of the
            // size the group checks (this micro-batch's tokens of the
            // PE's), alive as long as the world, used by nothing else
            // while the stream runs the step.
            Part::Dispatch => unsafe {
                let (x, ids, probs) = (rows(x, h), rows(ids, 4 * k), rows(probs, 4 * k));
                m.group
                    .dispatch(x, ids, probs, tokens, &m.out, stream)
                    .context("dispatch")
            },
            // SAFETY: as above.
            Part::Combine => unsafe {
                let y = rows(y, h);
                m.group.combine(m.expert_out, y, stream).context("combine")
            },
            Part::Experts => Err("the experts are not an exchange part".into()),
        }
    }

    /// `silu(x) * scale_e` on micro-batch `i`'s expert-major rows: one
    /// ragged group per local expert, its rows counted on the device
    /// (padded counts when the groups are aligned; padding rows are
    /// computed and ignored), on at most `sms` SMs (0: every SM).
    fn token_experts(&mut self, i: usize, stream: *mut std::ffi::c_void, sms: u32) -> Res<()> {
        let s = self.shape;
        let tok = self.token()?;
        let m = tok.micro.get(i).ok_or("no such micro-batch")?;
        let layout = *m.group.layout();
        let row = s.hidden * s.dtype.size_bytes();
        let bytes = (layout.expert_rows * row) as u64;
        let aligned = s.ep.is_some_and(|e| e.align > 1);
        let ragged = RaggedGroups {
            scales: tok.scales.addr,
            rows: if aligned {
                m.out.padded_per_expert.addr
            } else {
                m.out.tokens_per_expert.addr
            },
            segments: 1,
            groups: layout.local_experts as u64,
            segment_bytes: bytes,
            row_bytes: row as u64,
        };
        let input = if s.ep.is_some_and(|e| e.fp8) {
            m.out.rows_bf16.addr
        } else {
            m.out.rows.addr
        };
        let inputs = [input];
        let mut call = self.expert_call(
            stream,
            &inputs,
            m.expert_out.addr,
            bytes,
            (None, Some(ragged)),
        );
        call.sms = sms;
        // SAFETY: the expert-major rows and outputs hold `bytes` each, the
        // scales L f32 and the counts L i64 (written by dispatch before:
        // on the same stream, or forked, on the exchange stream before the
        // `dispatched` event this stream waited for); all this PE's,
        // written by nothing else meanwhile.
        unsafe { xcall_warpspec::run(&call) }.context("experts")
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::data::{EpShape, Shape};
    use super::{buffer_sizes, config, heap_bytes, split};

    fn shape(microbatches: usize) -> Shape {
        Shape {
            pes: 3,
            tokens: 301,
            hidden: 64,
            experts: 6,
            topk: 3,
            capacity: 301,
            dropless: true,
            fused: false,
            dtype: xcall_core::DType::Bf16,
            ep: Some(EpShape {
                fp8: false,
                align: 1,
                sms: 0,
                kernels: xcall_ep::EpKernels::Auto,
                microbatches,
            }),
        }
    }

    /// Each micro-batch's group takes the largest micro-batch's tokens,
    /// and the heap holds a group and its buffers per micro-batch.
    #[test]
    fn each_group_is_sized_for_the_largest_micro_batch() {
        assert_eq!(config(&shape(1)).tokens, 301);
        assert_eq!(config(&shape(3)).tokens, 101);
        assert_eq!(config(&shape(8)).tokens, 38);
        let (one, three) = (
            heap_bytes(&shape(1)).unwrap(),
            heap_bytes(&shape(3)).unwrap(),
        );
        // Three groups of a third of the tokens, each with its spare MiB.
        assert!(three > one + (1 << 20), "{one} {three}");
    }

    /// The copy the phases' floors divide by moves micro-batch 0's
    /// received rows: the bf16 rows, with FP8 dispatch too (the only
    /// rows it writes here); the rate once read a copy of 1-byte FP8 rows
    /// as moving 2-byte rows, 2x high.
    #[test]
    fn the_floors_copy_counts_the_bytes_of_the_rows_it_moves() {
        for microbatches in [1, 3] {
            let bf16 = shape(microbatches);
            let rows = config(&bf16).layout(3).unwrap().expert_rows;
            assert_eq!(super::super::Pe::copy_bytes(&bf16), rows * 64 * 2);
            let mut fp8 = bf16;
            fp8.hidden = 128;
            fp8.ep.as_mut().unwrap().fp8 = true;
            let rows = config(&fp8).layout(3).unwrap().expert_rows;
            assert_eq!(super::super::Pe::copy_bytes(&fp8), rows * 128 * 2);
            // No FP8 rows and no scales are allocated for it.
            let (_, _, each) = buffer_sizes(&fp8).unwrap();
            assert_eq!((each[0].0, each[1].0, each[2].0), (1, 1, rows * 128 * 2));
        }
    }

    /// Runs of consecutive tokens, covering every token once, sizes
    /// within one of each other, the larger first.
    #[test]
    fn split_covers_every_token_once_larger_runs_first() {
        assert_eq!(split(10, 3), [(0, 4), (4, 3), (7, 3)]);
        assert_eq!(split(9, 3), [(0, 3), (3, 3), (6, 3)]);
        assert_eq!(split(5, 1), [(0, 5)]);
        assert_eq!(split(3, 3), [(0, 1), (1, 1), (2, 1)]);
        for (t, n) in [(301, 2), (4096, 8), (17, 5)] {
            let runs = split(t, n);
            assert_eq!(runs.len(), n);
            assert_eq!(runs.iter().map(|r| r.1).sum::<usize>(), t);
            assert!(runs
                .windows(2)
                .all(|w| w[0].0 + w[0].1 == w[1].0 && w[0].1 >= w[1].1));
        }
    }
}
