//! A PE of the token-once exchange (`--exchange token`, the default): the
//! step is xcall-ep's dispatch, the experts on its expert-major rows, and
//! its combine. Dispatch stores each token once into every PE hosting one
//! of its experts; there its rows are grouped by local expert (each group
//! starting on a multiple of `--align` rows) with the counts written by
//! the device; the experts (`silu(x) * scale_e`, warpspec, one ragged
//! group per local expert) read them and write the expert-major outputs;
//! combine sums each token's outputs on each PE and stores one row back,
//! where the token's PE adds the rows in rank order into `y`. Experts are
//! numbered as given (PE `q` hosts `q*L .. (q+1)*L`): no rotation.

use xcall_ep::{Buf, Capacity, EpConfig, EpGroup, ExpertMajor, Layout, Precision};
use xcall_graph::BufferRole;
use xcall_shmem::World;
use xcall_warpspec::ops::RaggedGroups;

use super::super::data::{Inputs, Shape};
use super::Pe;
use crate::alloc::RunError;
use crate::layer::{Context, Res};

/// The group and the PE's buffers of the token-once step.
pub(super) struct TokenPe {
    pub(super) group: EpGroup,
    pub(super) x: Buf,
    pub(super) ids: Buf,
    pub(super) probs: Buf,
    pub(super) out: ExpertMajor,
    pub(super) expert_out: Buf,
    pub(super) y: Buf,
    /// `[L]` f32: each local expert's scale.
    pub(super) scales: Buf,
}

/// The group's config for `shape`.
pub(super) fn config(shape: &Shape) -> EpConfig {
    let ep = shape.ep.unwrap_or(super::super::data::EpShape {
        fp8: false,
        align: 1,
        sms: 0,
        kernels: xcall_ep::EpKernels::Auto,
    });
    EpConfig {
        tokens: shape.tokens,
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

/// The buffers besides the group's own, in order: x, ids, probs, the
/// expert-major rows, their FP8 scales and bf16 rows (FP8 only; 1 byte
/// otherwise), tokens_per_expert, padded counts, the experts' outputs,
/// y, the experts' scales. `None` when a size passes `usize`.
pub(super) fn buffer_sizes(shape: &Shape) -> Option<(Layout, [(usize, BufferRole); 11])> {
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
            (wire, BufferRole::InOut),
            (
                if fp8 {
                    rows.checked_mul(h / 128 * 4)?
                } else {
                    1
                },
                BufferRole::InOut,
            ),
            (if fp8 { expert_rows } else { 1 }, BufferRole::InOut),
            (l * 8, BufferRole::InOut),
            (l * 8, BufferRole::InOut),
            (expert_rows, BufferRole::InOut),
            (t.checked_mul(row)?, BufferRole::Out),
            (l * 4, BufferRole::In),
        ],
    ))
}

/// The symmetric heap a token-once PE needs: the group, the buffers
/// (256-byte aligned) and 1 MiB to spare.
pub(super) fn heap_bytes(shape: &Shape) -> Option<usize> {
    let (layout, sizes) = buffer_sizes(shape)?;
    sizes.iter().try_fold(
        layout.heap_bytes + (shape.pes + 4) * 16 + (2 << 20),
        |sum: usize, (b, _)| sum.checked_add(b.checked_next_multiple_of(256)?),
    )
}

/// A buffer of the heap: address, bytes, role in the step.
pub(super) type Held = (u64, usize, BufferRole);

/// Allocates the buffers in `world` and makes the group (collective).
pub(super) fn new(world: &mut World, shape: &Shape) -> Result<(TokenPe, Vec<Held>), RunError> {
    let (_, sizes) = buffer_sizes(shape).ok_or("the layer's buffers pass usize")?;
    let group = EpGroup::new(world, config(shape)).context("expert-parallel group")?;
    let mut held = Vec::with_capacity(sizes.len());
    for (bytes, role) in sizes {
        let a = world.malloc(bytes.max(1)).context("shmem malloc")?;
        held.push((a, bytes, role));
    }
    let buf = |i: usize| Buf::new(held[i].0, held[i].1);
    let fp8 = shape.ep.is_some_and(|e| e.fp8);
    let tok = TokenPe {
        group,
        x: buf(0),
        ids: buf(1),
        probs: buf(2),
        out: ExpertMajor {
            rows: buf(3),
            scales: if fp8 { buf(4) } else { Buf::NONE },
            rows_bf16: if fp8 { buf(5) } else { Buf::NONE },
            tokens_per_expert: buf(6),
            padded_per_expert: buf(7),
            offsets: Buf::NONE,
        },
        expert_out: buf(8),
        y: buf(9),
        scales: buf(10),
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

impl Pe {
    pub(super) fn token(&self) -> Res<&TokenPe> {
        self.ep
            .as_ref()
            .ok_or_else(|| "not a token-once PE".to_string())
    }

    /// The token-once step: dispatch, experts, combine, with each end
    /// marked.
    pub(super) fn token_step(&mut self, marks: &mut Option<Vec<super::step::Mark>>) -> Res<()> {
        let stream = self.stream();
        let tok = self.ep.as_mut().ok_or("not a token-once PE")?;
        let t = self.shape.tokens;
        // SAFETY: every buffer is this PE's heap allocation of the size the
        // group checks, alive as long as the world, used by nothing else
        // while the stream runs the step.
        unsafe {
            tok.group
                .dispatch(tok.x, tok.ids, tok.probs, t, &tok.out, stream)
                .context("dispatch")?
        };
        self.mark(marks)?;
        self.token_experts(stream)?;
        self.mark(marks)?;
        let tok = self.ep.as_mut().ok_or("not a token-once PE")?;
        // SAFETY: as above.
        unsafe { tok.group.combine(tok.expert_out, tok.y, stream) }.context("combine")?;
        self.mark(marks)
    }

    /// `silu(x) * scale_e` on the expert-major rows: one ragged group per
    /// local expert, its rows counted on the device (padded counts when
    /// the groups are aligned; padding rows are computed and ignored).
    fn token_experts(&mut self, stream: *mut std::ffi::c_void) -> Res<()> {
        let s = self.shape;
        let tok = self.token()?;
        let layout = *tok.group.layout();
        let row = s.hidden * s.dtype.size_bytes();
        let bytes = (layout.expert_rows * row) as u64;
        let aligned = s.ep.is_some_and(|e| e.align > 1);
        let ragged = RaggedGroups {
            scales: tok.scales.addr,
            rows: if aligned {
                tok.out.padded_per_expert.addr
            } else {
                tok.out.tokens_per_expert.addr
            },
            segments: 1,
            groups: layout.local_experts as u64,
            segment_bytes: bytes,
            row_bytes: row as u64,
        };
        let input = if s.ep.is_some_and(|e| e.fp8) {
            tok.out.rows_bf16.addr
        } else {
            tok.out.rows.addr
        };
        let inputs = [input];
        let call = self.expert_call(
            stream,
            &inputs,
            tok.expert_out.addr,
            bytes,
            (None, Some(ragged)),
        );
        // SAFETY: the expert-major rows and outputs hold `bytes` each, the
        // scales L f32 and the counts L i64 (written by dispatch before,
        // on the same stream); all this PE's, written by nothing else
        // meanwhile.
        unsafe { xcall_warpspec::run(&call) }.context("experts")
    }
}
