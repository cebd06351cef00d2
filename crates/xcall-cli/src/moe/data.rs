//! The inputs every PE draws for a step, and the reference the outputs are
//! checked against. The reference shares no code with the pipeline: it
//! walks tokens and experts with plain loops, keeps routes by its own
//! capacity count, decodes with `half`, and accumulates in f64.

use half::bf16;
use xcall_core::testing::XorShift;
use xcall_core::DType;

use crate::alloc::{self, AllocError};

/// Shape of the layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    /// PEs.
    pub pes: usize,
    /// Tokens per PE.
    pub tokens: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Experts (split evenly over the PEs).
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// Rows each expert takes from each PE (`tokens` when dropless: an
    /// expert takes every token).
    pub capacity: usize,
    /// Dropless: every PE's rows for one destination are packed densely
    /// in a slot of [`Shape::slot_rows`] rows, sized for the worst case.
    pub dropless: bool,
    /// Fused exchange: `permute` writes each peer's rows straight into
    /// its receive slot and `unpermute` reads the results from the peers'
    /// slots (peer pointers); else whole slots are copied with
    /// `put_signal` (see `pe`).
    pub fused: bool,
    /// f32 or bf16.
    pub dtype: DType,
    /// The token-once exchange of xcall-ep (`None`: one of the per-route
    /// exchanges above, `fused` telling which).
    pub ep: Option<EpShape>,
}

/// How the token-once exchange runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpShape {
    /// FP8 dispatch (bf16 tokens quantized on the way out, e4m3 with a
    /// scale per 128 elements).
    pub fp8: bool,
    /// Each expert's rows start on a multiple of this many rows.
    pub align: usize,
    /// SMs the exchange kernels may occupy (0: as many as help).
    pub sms: usize,
    /// Which CUDA kernels run it.
    pub kernels: xcall_ep::EpKernels,
    /// Micro-batches a PE's tokens are split into, each with its own
    /// group; on CUDA one's experts run beside the next one's exchange.
    pub microbatches: usize,
}

impl Shape {
    /// Experts per PE.
    pub fn local_experts(&self) -> usize {
        self.experts / self.pes
    }

    /// Rows of one slot, what one PE sends another: `L * C` with a
    /// capacity; dropless, `T * min(k, L)`, the most rows a PE's tokens
    /// can route to one PE's `L` experts (a token routes to at most
    /// `min(k, L)` of them).
    pub fn slot_rows(&self) -> usize {
        if self.dropless {
            self.tokens * self.topk.min(self.local_experts())
        } else {
            self.local_experts() * self.capacity
        }
    }

    /// Bytes of one token row.
    pub fn row_bytes(&self) -> usize {
        self.hidden * self.dtype.size_bytes()
    }

    /// `silu(x) * scale_e`'s scale of expert `e`: distinct per expert.
    pub fn scale(&self, e: usize) -> f32 {
        0.5 + e as f32 / self.experts as f32
    }
}

/// One PE's inputs of one step.
pub struct Inputs {
    /// `[T, H]` in the layer's dtype.
    pub x: Vec<u8>,
    /// `[T, E]`: 1 where a token routes to an expert.
    pub routing: Vec<u8>,
    /// `[T, E]` f32 merging weights: softmax over a token's top-k logits,
    /// 0 elsewhere.
    pub probs: Vec<f32>,
}

impl Inputs {
    /// PE `rank`'s buffers of one step's inputs, to draw into.
    pub fn alloc(shape: &Shape, rank: usize) -> Result<Inputs, AllocError> {
        let (t, e) = (shape.tokens, shape.experts);
        let x = alloc::count::<u8>(|| format!("PE {rank}'s tokens"), t, shape.row_bytes())?;
        let routes = alloc::count::<f32>(|| format!("PE {rank}'s probs"), t, e)?;
        Ok(Inputs {
            x: alloc::zeroed(|| format!("PE {rank}'s tokens"), x)?,
            routing: alloc::zeroed(|| format!("PE {rank}'s routing"), routes)?,
            probs: alloc::zeroed(|| format!("PE {rank}'s probs"), routes)?,
        })
    }
}

/// Tokens drawn from one stream of random numbers: blocks of them are
/// drawn on different threads.
const DRAW_BLOCK: usize = 256;

/// The stream of random numbers of (seed, step, rank, block of tokens).
fn generator(seed: u64, step: usize, rank: usize, block: usize) -> XorShift {
    XorShift::new(
        seed ^ (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ (rank as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
            ^ (block as u64).wrapping_mul(0x1656_67b1_9e37_79f9),
    )
}

/// [`draw_into`] new buffers.
#[cfg(test)]
pub fn draw(
    shape: &Shape,
    seed: u64,
    step: usize,
    rank: usize,
    threads: usize,
) -> Result<Inputs, AllocError> {
    let mut inputs = Inputs::alloc(shape, rank)?;
    draw_into(shape, seed, step, rank, threads, &mut inputs)?;
    Ok(inputs)
}

/// Draws PE `rank`'s tokens and router decisions of step `step` into
/// `inputs`, buffers of [`Inputs::alloc`] (every value is written: they
/// may hold an earlier step's), the blocks of [`DRAW_BLOCK`] tokens split
/// over up to `threads` threads (the same inputs on any number).
pub fn draw_into(
    shape: &Shape,
    seed: u64,
    step: usize,
    rank: usize,
    threads: usize,
    inputs: &mut Inputs,
) -> Result<(), AllocError> {
    let (t, e) = (shape.tokens, shape.experts);
    let row = shape.row_bytes();
    let Inputs { x, routing, probs } = inputs;
    routing.fill(0);
    probs.fill(0.0);
    let blocks = t.div_ceil(DRAW_BLOCK);
    // Blocks per thread.
    let share = blocks.div_ceil(threads.clamp(1, blocks.max(1))).max(1);
    std::thread::scope(|scope| {
        let parts = x
            .chunks_mut(share * DRAW_BLOCK * row)
            .zip(routing.chunks_mut(share * DRAW_BLOCK * e))
            .zip(probs.chunks_mut(share * DRAW_BLOCK * e));
        let handles: Vec<_> = parts
            .enumerate()
            .map(|(i, ((x, routing), probs))| {
                scope.spawn(move || {
                    // A token's logits and the experts in their order.
                    let mut logits = alloc::zeroed(|| format!("PE {rank}'s logits"), e)?;
                    let mut order = alloc::zeroed(|| format!("PE {rank}'s expert order"), e)?;
                    let blocks = x
                        .chunks_mut(DRAW_BLOCK * row)
                        .zip(routing.chunks_mut(DRAW_BLOCK * e))
                        .zip(probs.chunks_mut(DRAW_BLOCK * e));
                    for (j, ((x, routing), probs)) in blocks.enumerate() {
                        let mut g = generator(seed, step, rank, i * share + j);
                        draw_block(shape, &mut g, (x, routing, probs), &mut logits, &mut order);
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

/// Draws the tokens whose rows `x`, routing and probs are given (routing
/// and probs zero): first every value of `x`, then each token's logits
/// into `logits` (`E` values), the experts sorted by them in `order`.
fn draw_block(
    shape: &Shape,
    g: &mut XorShift,
    (x, routing, probs): (&mut [u8], &mut [u8], &mut [f32]),
    logits: &mut [f32],
    order: &mut [usize],
) {
    let (e, k) = (shape.experts, shape.topk);
    match shape.dtype {
        DType::Bf16 => x
            .chunks_exact_mut(2)
            .for_each(|v| v.copy_from_slice(&bf16::from_f32(3.0 * g.next_f32()).to_le_bytes())),
        _ => x
            .chunks_exact_mut(4)
            .for_each(|v| v.copy_from_slice(&(3.0 * g.next_f32()).to_le_bytes())),
    }
    for (i, o) in order.iter_mut().enumerate() {
        *o = i;
    }
    for (routing, probs) in routing.chunks_exact_mut(e).zip(probs.chunks_exact_mut(e)) {
        for l in logits.iter_mut() {
            *l = 4.0 * g.next_f32();
        }
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let top = &order[..k];
        let max = logits[top[0]];
        let weight = |x: usize| ((logits[x] - max) as f64).exp();
        let sum: f64 = top.iter().map(|&x| weight(x)).sum();
        for &x in top {
            routing[x] = 1;
            probs[x] = (weight(x) / sum) as f32;
        }
    }
}

/// Decodes `[n]` values of `dtype` (f32 or bf16) to f64.
#[cfg(test)]
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let mut out = vec![0.0; bytes.len() / dtype.size_bytes()];
    decode_into(dtype, bytes, &mut out);
    out
}

/// Decodes the values of `dtype` (f32 or bf16) in `bytes` into `out`
/// (as many as `out` holds).
pub fn decode_into(dtype: DType, bytes: &[u8], out: &mut [f64]) {
    match dtype {
        DType::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f64();
            }
        }
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64;
            }
        }
    }
}

/// The routes the layer keeps: expert `e` takes the first `capacity`
/// tokens routed to it, in token order.
#[cfg(test)]
pub fn kept_routes(shape: &Shape, routing: &[u8]) -> Result<Vec<bool>, AllocError> {
    let mut kept = alloc::zeroed(|| "the kept routes".into(), routing.len())?;
    kept_routes_into(shape, routing, &mut kept);
    Ok(kept)
}

/// The routes the layer keeps into `kept` (`[T, E]`, every value
/// written): expert `e` takes the first `capacity` tokens routed to it,
/// in token order.
pub fn kept_routes_into(shape: &Shape, routing: &[u8], kept: &mut [bool]) {
    let (t, e) = (shape.tokens, shape.experts);
    kept.fill(false);
    for expert in 0..e {
        let mut taken = 0;
        for tok in 0..t {
            if routing[tok * e + expert] != 0 && taken < shape.capacity {
                kept[tok * e + expert] = true;
                taken += 1;
            }
        }
    }
}

/// Token rows PE `rank`'s dispatch moves to other PEs with the
/// token-once exchange: per token, the other PEs hosting one of its
/// experts (combine returns as many).
pub fn link_tokens(shape: &Shape, rank: usize, routing: &[u8]) -> usize {
    let (e, l) = (shape.experts, shape.local_experts());
    routing
        .chunks_exact(e.max(1))
        .map(|row| {
            (0..shape.pes)
                .filter(|&q| q != rank && row[q * l..(q + 1) * l].iter().any(|&r| r != 0))
                .count()
        })
        .sum()
}

/// The routes of `routing` that `kept` drops.
pub fn dropped_routes(routing: &[u8], kept: &[bool]) -> usize {
    kept.iter()
        .zip(routing)
        .filter(|&(&k, &r)| r != 0 && !k)
        .count()
}

/// What one PE's output looked like against the reference.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Check {
    /// Elements outside the tolerance.
    pub mismatches: usize,
    /// First mismatch: (token, column, got, want).
    pub first: Option<(usize, usize, f64, f64)>,
    /// Largest |got - want| / (sum of |terms| + 1e-6).
    pub max_relative: f64,
    /// Routes dropped by the capacity.
    pub dropped: usize,
}

/// Checks `y` (`[T, H]` in the layer's dtype) against
/// `sum over kept routes e of probs[t, e] * silu(x[t]) * scale_e`, with a
/// tolerance of the dtype's two roundings (expert output and result).
/// The tokens are split over up to `threads` threads.
#[cfg(test)]
pub fn check(shape: &Shape, inputs: &Inputs, y: &[u8], threads: usize) -> Check {
    let mut kept = vec![false; inputs.routing.len()];
    check_with(shape, inputs, y, threads, &mut kept).expect("the check's buffers")
}

/// Checks `y` against the reference as [`check`] does, with `kept`
/// (`[T, E]`) to hold the kept routes; every other buffer it takes is
/// allocated fallibly.
pub fn check_with(
    shape: &Shape,
    inputs: &Inputs,
    y: &[u8],
    threads: usize,
    kept: &mut [bool],
) -> Result<Check, AllocError> {
    let t = shape.tokens;
    kept_routes_into(shape, &inputs.routing, kept);
    let dropped = dropped_routes(&inputs.routing, kept);
    let chunk = t.div_ceil(threads.clamp(1, t.max(1)));
    let parts: Vec<Check> = std::thread::scope(|scope| {
        let kept = &*kept;
        let handles: Vec<_> = (0..t)
            .step_by(chunk.max(1))
            .map(|lo| {
                let hi = (lo + chunk).min(t);
                scope.spawn(move || check_tokens(shape, inputs, y, kept, lo..hi))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect::<Result<_, _>>()
    })?;
    // The parts are in token order: the first mismatch is the first part's.
    Ok(parts.into_iter().fold(
        Check {
            dropped,
            ..Check::default()
        },
        |mut c, part| {
            c.mismatches += part.mismatches;
            c.max_relative = c.max_relative.max(part.max_relative);
            c.first = c.first.or(part.first);
            c
        },
    ))
}

/// What the experts of an FP8 dispatch see of a bf16 token: per block of
/// 128 values, the scale `amax / 448` (1 for an all-zero block), each
/// value divided by it and rounded to e4m3, multiplied back, rounded to
/// bf16 (f32 arithmetic, as the exchange does).
pub fn fp8_round_trip(x: &mut [f64]) {
    use xcall_core::{fp8_decode, fp8_encode, Fp8};
    for block in x.chunks_mut(128) {
        let amax = block.iter().fold(0f32, |m, v| m.max((*v as f32).abs()));
        let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        for v in block.iter_mut() {
            let q = fp8_encode(Fp8::E4M3, *v as f32 / scale);
            *v = bf16::from_f32(fp8_decode(Fp8::E4M3, q) * scale).to_f64();
        }
    }
}

/// [`check`] of the tokens `range`.
fn check_tokens(
    shape: &Shape,
    inputs: &Inputs,
    y: &[u8],
    kept: &[bool],
    range: std::ops::Range<usize>,
) -> Result<Check, AllocError> {
    let (h, e) = (shape.hidden, shape.experts);
    let row = shape.row_bytes();
    // bf16: the experts' output and the result are rounded; the
    // token-once combine also rounds each PE's partial sum.
    let rtol = match (shape.dtype, shape.ep.is_some()) {
        (DType::Bf16, false) => 1e-2,
        (DType::Bf16, true) => 2e-2,
        (_, false) => 1e-5,
        (_, true) => 2e-5,
    };
    // One token's values, its output and its kept routes (prob, scale).
    let mut x = alloc::zeroed(|| "a token's values for the check".into(), h)?;
    let mut got = alloc::zeroed(|| "a token's output for the check".into(), h)?;
    let mut routes = alloc::with_capacity(|| "a token's routes for the check".into(), e)?;
    let mut c = Check::default();
    let fp8 = shape.ep.is_some_and(|e| e.fp8);
    for tok in range {
        decode_into(shape.dtype, &inputs.x[tok * row..(tok + 1) * row], &mut x);
        if fp8 {
            fp8_round_trip(&mut x);
        }
        decode_into(shape.dtype, &y[tok * row..(tok + 1) * row], &mut got);
        routes.clear();
        routes.extend(
            (0..e)
                .filter(|&x| kept[tok * e + x])
                .map(|x| (inputs.probs[tok * e + x] as f64, shape.scale(x) as f64)),
        );
        for j in 0..h {
            let v = x[j];
            let silu = v / (1.0 + (-v).exp());
            let (mut want, mut magnitude) = (0f64, 0f64);
            for &(p, s) in &routes {
                want += p * silu * s;
                magnitude += (p * silu * s).abs();
            }
            let g = got[j];
            let err = (g - want).abs();
            c.max_relative = c.max_relative.max(err / (magnitude + 1e-6));
            // A NaN (the poison of an unwritten output) is a mismatch too.
            if err.is_nan() || err > 1e-6 + rtol * magnitude {
                c.mismatches += 1;
                c.first.get_or_insert((tok, j, g, want));
            }
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(dtype: DType, capacity: usize) -> Shape {
        Shape {
            pes: 2,
            tokens: 64,
            hidden: 16,
            experts: 4,
            topk: 2,
            capacity,
            dropless: false,
            fused: true,
            dtype,
            ep: None,
        }
    }

    /// The layer computed the slow obvious way, rounded to the dtype.
    fn layer(s: &Shape, inputs: &Inputs) -> Vec<u8> {
        let x = decode(s.dtype, &inputs.x);
        let kept = kept_routes(s, &inputs.routing).unwrap();
        let mut y = Vec::new();
        for tok in 0..s.tokens {
            for j in 0..s.hidden {
                let v = x[tok * s.hidden + j] as f32;
                let mut sum = 0f32;
                for e in 0..s.experts {
                    if kept[tok * s.experts + e] {
                        let out = v / (1.0 + (-v).exp()) * s.scale(e);
                        let out = match s.dtype {
                            DType::Bf16 => bf16::from_f32(out).to_f32(),
                            _ => out,
                        };
                        sum += inputs.probs[tok * s.experts + e] * out;
                    }
                }
                match s.dtype {
                    DType::Bf16 => y.extend(bf16::from_f32(sum).to_le_bytes()),
                    _ => y.extend(sum.to_le_bytes()),
                }
            }
        }
        y
    }

    #[test]
    fn the_check_is_the_same_on_any_number_of_threads() {
        let s = shape(DType::Bf16, 64);
        let inputs = draw(&s, 5, 2, 0, 2).unwrap();
        let mut y = layer(&s, &inputs);
        // Two bad elements, in tokens 50 and 5 (the first one reported).
        let row = s.row_bytes();
        for (tok, j) in [(50, 3), (5, 7)] {
            let at = tok * row + 2 * j;
            y[at..at + 2].copy_from_slice(&bf16::from_f32(1e3).to_le_bytes());
        }
        let one = check(&s, &inputs, &y, 1);
        assert_eq!(one.mismatches, 2);
        assert_eq!(one.first.map(|f| (f.0, f.1)), Some((5, 7)));
        for threads in [0, 2, 3, 7, 64, 1000] {
            assert_eq!(check(&s, &inputs, &y, threads), one, "{threads} threads");
        }
    }

    #[test]
    fn draws_are_reproducible_top_k_and_normalised() {
        let s = shape(DType::F32, 64);
        let a = draw(&s, 7, 3, 1, 1).unwrap();
        // The same inputs on any number of threads, blocks of tokens included.
        for threads in [0, 2, 3, 64] {
            let b = draw(&s, 7, 3, 1, threads).unwrap();
            assert_eq!((&a.x, &a.routing, &a.probs), (&b.x, &b.routing, &b.probs));
        }
        let long = Shape { tokens: 1000, ..s };
        let one = draw(&long, 7, 3, 1, 1).unwrap();
        for threads in [2, 3, 4, 5, 1000] {
            let b = draw(&long, 7, 3, 1, threads).unwrap();
            assert_eq!(
                (&one.x, &one.routing, &one.probs),
                (&b.x, &b.routing, &b.probs)
            );
        }
        // Blocks of tokens differ (each has its own stream).
        let row = long.row_bytes();
        assert_ne!(one.x[..row], one.x[256 * row..257 * row]);
        // Drawn again into the buffers of another step: the same inputs.
        let mut again = draw(&s, 9, 4, 1, 2).unwrap();
        draw_into(&s, 7, 3, 1, 2, &mut again).unwrap();
        assert_eq!(
            (&a.x, &a.routing, &a.probs),
            (&again.x, &again.routing, &again.probs)
        );
        assert_ne!(a.x, draw(&s, 7, 4, 1, 1).unwrap().x, "steps differ");
        assert_ne!(a.x, draw(&s, 7, 3, 0, 1).unwrap().x, "ranks differ");
        for tok in 0..s.tokens {
            let row = &a.routing[tok * 4..tok * 4 + 4];
            assert_eq!(row.iter().filter(|&&r| r == 1).count(), 2);
            let p: f32 = a.probs[tok * 4..tok * 4 + 4].iter().sum();
            assert!((p - 1.0).abs() < 1e-6);
        }
        assert!(decode(DType::F32, &a.x).iter().any(|&v| v.abs() > 1.0));
    }

    #[test]
    fn capacity_keeps_the_first_tokens_of_each_expert() {
        let s = shape(DType::F32, 3);
        let inputs = draw(&s, 1, 0, 0, 1).unwrap();
        let kept = kept_routes(&s, &inputs.routing).unwrap();
        for e in 0..4 {
            let routed: Vec<usize> = (0..64)
                .filter(|&t| inputs.routing[t * 4 + e] == 1)
                .collect();
            let k: Vec<usize> = (0..64).filter(|&t| kept[t * 4 + e]).collect();
            assert_eq!(k, routed[..3.min(routed.len())]);
        }
    }

    #[test]
    fn the_check_accepts_the_layer_and_catches_errors() {
        for dtype in [DType::F32, DType::Bf16] {
            for capacity in [64, 20] {
                let s = shape(dtype, capacity);
                let inputs = draw(&s, 11, 0, 1, 2).unwrap();
                let y = layer(&s, &inputs);
                let ok = check(&s, &inputs, &y, 3);
                assert_eq!(ok.mismatches, 0, "{dtype} {capacity}: {ok:?}");
                assert_eq!(ok.dropped > 0, capacity == 20);
                // One element off by 5% (or 0.005 when tiny).
                let mut bad = y.clone();
                let size = dtype.size_bytes();
                let v = decode(dtype, &bad[..size])[0];
                let v = v + 0.05 * v.abs().max(0.1);
                match dtype {
                    DType::Bf16 => bad[..2].copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
                    _ => bad[..4].copy_from_slice(&(v as f32).to_le_bytes()),
                }
                assert_eq!(check(&s, &inputs, &bad, 3).mismatches, 1, "{dtype}");
                // Every route kept although the capacity drops some.
                if capacity == 20 {
                    let all = Shape { capacity: 64, ..s };
                    let y = layer(&all, &inputs);
                    assert!(check(&s, &inputs, &y, 3).mismatches > 0);
                }
                // Never written (the NaN poison).
                let poison = vec![0xffu8; y.len()];
                assert_eq!(
                    check(&s, &inputs, &poison, 3).mismatches,
                    s.tokens * s.hidden
                );
                // The outputs of another step.
                let other = layer(&s, &draw(&s, 11, 1, 1, 2).unwrap());
                assert!(check(&s, &inputs, &other, 3).mismatches > s.tokens * s.hidden / 2);
            }
        }
    }
}
