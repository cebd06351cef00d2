//! Permute and unpermute on the Host.
//!
//! `permute`: `out[dst] = input[t]` for every kept route (pure data
//! movement: any dtype), `permuted_probs[dst] = probs[t, e]`,
//! `permuted_scales[dst] = scales[t]`; rows no route writes (padding, rows
//! past the routes) are zero. Every output row is written once.
//! `unpermute`: `out[t] = sum_k input[dst_k] * merging_probs[t, e_k]`
//! (weight 1 without merging probs), accumulated in f32 in ascending
//! expert order (deterministic), and
//! `unpermuted_probs[t, e] = permuted_probs[dst]` (0 where no route).
//! Every call checks shapes and buffer overlap before writing anything.

use xcall_core::alloc::try_vec;
use xcall_core::{DType, FloatCodec};

use crate::alias::{self, Op, Region};
use crate::error::{shape, PermuteError};
use crate::row_id_map::RowIdMapRef;

/// `len` must be the product of `dims` (checked: a product past `usize`
/// is an error, never a wrapped size).
fn expect_len(name: &str, len: usize, dims: &[usize]) -> Result<(), PermuteError> {
    let want = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| shape(format!("{name}: dims {dims:?} overflow a size")))?;
    if len == want {
        Ok(())
    } else {
        Err(shape(format!("{name} has {len} elements, {want} expected")))
    }
}

fn chunks_known(op: &str, map: &RowIdMapRef<'_>) -> Result<(), PermuteError> {
    if map.has_chunks() {
        Ok(())
    } else {
        Err(shape(format!(
            "{op} zeroes the output rows no route writes and needs the map's tokens_per_expert and expert_offsets"
        )))
    }
}

/// Inputs of [`permute`].
pub struct PermuteInputs<'a> {
    /// `[T, H]` of `dtype`, as bytes.
    pub input: &'a [u8],
    /// Element type of `input` and `output`.
    pub dtype: DType,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Optional `[T, E]` routing probabilities.
    pub probs: Option<&'a [f32]>,
    /// Optional `[T, S]` scales (for example fp8 scaling factors).
    pub scales: Option<&'a [f32]>,
}

/// Outputs of [`permute`].
pub struct PermuteOutputs<'a> {
    /// `[out_rows, H]` of `dtype`, as bytes.
    pub output: &'a mut [u8],
    /// `[out_rows]`, required when `probs` is given.
    pub permuted_probs: Option<&'a mut [f32]>,
    /// `[out_rows, S]`, required when `scales` is given.
    pub permuted_scales: Option<&'a mut [f32]>,
}

/// Groups tokens by expert, see the module docs.
pub fn permute(
    map: RowIdMapRef<'_>,
    inputs: &PermuteInputs<'_>,
    outputs: &mut PermuteOutputs<'_>,
) -> Result<(), PermuteError> {
    let (t, e, h, n) = (map.tokens(), map.experts(), inputs.hidden, map.out_rows());
    chunks_known("permute", &map)?;
    let row = h
        .checked_mul(inputs.dtype.size_bytes())
        .ok_or_else(|| shape(format!("hidden size {h} overflows a row's bytes")))?;
    expect_len("input (bytes)", inputs.input.len(), &[t, row])?;
    expect_len("output (bytes)", outputs.output.len(), &[n, row])?;
    let scales_width = match inputs.scales {
        Some(s) if t > 0 => {
            if s.len() % t != 0 {
                return Err(shape(format!(
                    "scales has {} elements, not a multiple of {t} tokens",
                    s.len()
                )));
            }
            s.len() / t
        }
        _ => 0,
    };
    if let Some(p) = inputs.probs {
        expect_len("probs", p.len(), &[t, e])?;
    }
    match (&inputs.probs, &outputs.permuted_probs) {
        (Some(_), Some(pp)) => expect_len("permuted_probs", pp.len(), &[n])?,
        (Some(_), None) => return Err(shape("probs given without permuted_probs")),
        (None, Some(_)) => return Err(shape("permuted_probs given without probs")),
        (None, None) => {}
    }
    match (&inputs.scales, &outputs.permuted_scales) {
        (Some(_), Some(ps)) => expect_len("permuted_scales", ps.len(), &[n, scales_width])?,
        (Some(_), None) => return Err(shape("scales given without permuted_scales")),
        (None, Some(_)) => return Err(shape("permuted_scales given without scales")),
        (None, None) => {}
    }
    let mut ins = vec![Region::of("input", inputs.input)];
    ins.extend(inputs.probs.map(|p| Region::of("probs", p)));
    ins.extend(inputs.scales.map(|s| Region::of("scales", s)));
    let mut outs = vec![Region::of("output", outputs.output)];
    outs.extend(
        outputs
            .permuted_probs
            .as_deref()
            .map(|p| Region::of("permuted_probs", p)),
    );
    outs.extend(
        outputs
            .permuted_scales
            .as_deref()
            .map(|s| Region::of("permuted_scales", s)),
    );
    alias::check(&ins, &outs, alias::alias_table(Op::Permute))?;

    // Routes write their rows; only the others are zeroed.
    for rows in map.unwritten_rows() {
        outputs.output[rows.start * row..rows.end * row].fill(0);
        if let Some(pp) = outputs.permuted_probs.as_deref_mut() {
            pp[rows.clone()].fill(0.0);
        }
        if let Some(ps) = outputs.permuted_scales.as_deref_mut() {
            ps[rows.start * scales_width..rows.end * scales_width].fill(0.0);
        }
    }
    for token in 0..t {
        for (dst, expert) in map.routes(token) {
            outputs.output[dst * row..(dst + 1) * row]
                .copy_from_slice(&inputs.input[token * row..(token + 1) * row]);
            if let (Some(p), Some(pp)) = (inputs.probs, outputs.permuted_probs.as_deref_mut()) {
                pp[dst] = p[token * e + expert];
            }
            if let (Some(sc), Some(ps)) = (inputs.scales, outputs.permuted_scales.as_deref_mut()) {
                let w = scales_width;
                ps[dst * w..(dst + 1) * w].copy_from_slice(&sc[token * w..(token + 1) * w]);
            }
        }
    }
    Ok(())
}

/// [`permute`] into an output in segments: row `r` of the `[S*rows, H]`
/// output is row `r % rows` of `segments[r / rows]` (each `rows` rows of
/// `H` elements). Only the routed rows are written; the others keep their
/// bytes. Takes no probs or scales.
pub fn permute_segmented(
    map: RowIdMapRef<'_>,
    inputs: &PermuteInputs<'_>,
    segments: &mut [&mut [u8]],
    rows: usize,
) -> Result<(), PermuteError> {
    let (t, h, n) = (map.tokens(), inputs.hidden, map.out_rows());
    if inputs.probs.is_some() || inputs.scales.is_some() {
        return Err(PermuteError::Unsupported(
            "permute with output segments takes no probs or scales".into(),
        ));
    }
    let row = h
        .checked_mul(inputs.dtype.size_bytes())
        .ok_or_else(|| shape(format!("hidden size {h} overflows a row's bytes")))?;
    expect_len("input (bytes)", inputs.input.len(), &[t, row])?;
    expect_len("output rows", n, &[segments.len(), rows])?;
    for (i, seg) in segments.iter().enumerate() {
        expect_len(
            &format!("output segment {i} (bytes)"),
            seg.len(),
            &[rows, row],
        )?;
    }
    let ins = [Region::of("input", inputs.input)];
    let names: Vec<String> = (0..segments.len())
        .map(|i| format!("output segment {i}"))
        .collect();
    let outs: Vec<Region<'_>> = segments
        .iter()
        .zip(&names)
        .map(|(seg, name)| Region::of(name, seg))
        .collect();
    alias::check(&ins, &outs, alias::alias_table(Op::Permute))?;
    for token in 0..t {
        for (dst, _) in map.routes(token) {
            let (seg, at) = (dst / rows, dst % rows);
            segments[seg][at * row..(at + 1) * row]
                .copy_from_slice(&inputs.input[token * row..(token + 1) * row]);
        }
    }
    Ok(())
}

/// The codec of an accumulating op's dtype (f32, f16 or bf16).
fn codec(op: &str, dtype: DType) -> Result<FloatCodec, PermuteError> {
    FloatCodec::new(dtype).ok_or_else(|| {
        PermuteError::Unsupported(format!(
            "{op} accumulates in f32 and supports f32, f16 and bf16, not {dtype}"
        ))
    })
}

/// Inputs of [`unpermute`].
pub struct UnpermuteInputs<'a> {
    /// `[out_rows, H]` of `dtype` (f32, f16 or bf16; also f8e4m3 and
    /// f8e5m2 without `merging_probs`: summed in f32, stored rounded to
    /// nearest even with saturation, see [`xcall_core::fp8_encode`]).
    pub input: &'a [u8],
    /// Element type of `input` and `output`.
    pub dtype: DType,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Optional `[T, E]` merging weights.
    pub merging_probs: Option<&'a [f32]>,
    /// Optional `[out_rows]` probabilities to scatter back to `[T, E]`.
    pub permuted_probs: Option<&'a [f32]>,
}

/// Outputs of [`unpermute`].
pub struct UnpermuteOutputs<'a> {
    /// `[T, H]` of `dtype`, as bytes.
    pub output: &'a mut [u8],
    /// `[T, E]`, required when `permuted_probs` is given.
    pub unpermuted_probs: Option<&'a mut [f32]>,
}

/// Restores token order, merging each token's routes; see the module docs.
pub fn unpermute(
    map: RowIdMapRef<'_>,
    inputs: &UnpermuteInputs<'_>,
    outputs: &mut UnpermuteOutputs<'_>,
) -> Result<(), PermuteError> {
    let rows = map.out_rows();
    unpermute_rows(map, &[inputs.input], rows, inputs, outputs)
}

/// [`unpermute`] of an input in segments: row `r` of the `[S*rows, H]`
/// input is row `r % rows` of `segments[r / rows]`. `inputs.input` must be
/// empty (the segments stand for it) and `inputs.permuted_probs` absent.
pub fn unpermute_segmented(
    map: RowIdMapRef<'_>,
    segments: &[&[u8]],
    rows: usize,
    inputs: &UnpermuteInputs<'_>,
    outputs: &mut UnpermuteOutputs<'_>,
) -> Result<(), PermuteError> {
    if !inputs.input.is_empty() || inputs.permuted_probs.is_some() {
        return Err(shape(
            "unpermute with input segments takes its rows from the segments: input must be empty and permuted_probs absent",
        ));
    }
    unpermute_rows(map, segments, rows, inputs, outputs)
}

/// `unpermute` with the input's rows in `segments` of `rows` rows each
/// (one segment of every row for a dense input).
fn unpermute_rows(
    map: RowIdMapRef<'_>,
    segments: &[&[u8]],
    rows: usize,
    inputs: &UnpermuteInputs<'_>,
    outputs: &mut UnpermuteOutputs<'_>,
) -> Result<(), PermuteError> {
    let codec = match inputs.merging_probs {
        // Without weights the sum is data movement plus adds: fp8 too.
        None => FloatCodec::with_fp8(inputs.dtype).ok_or_else(|| {
            PermuteError::Unsupported(format!(
                "unpermute supports f32, f16, bf16, f8e4m3 and f8e5m2, not {}",
                inputs.dtype
            ))
        })?,
        Some(_) => codec("unpermute with merging_probs", inputs.dtype)?,
    };
    let (t, e, h, n) = (map.tokens(), map.experts(), inputs.hidden, map.out_rows());
    let size = inputs.dtype.size_bytes();
    expect_len("input rows", n, &[segments.len(), rows])?;
    let names: Vec<String> = (0..segments.len())
        .map(|i| match segments.len() {
            1 => "input (bytes)".to_string(),
            _ => format!("input segment {i} (bytes)"),
        })
        .collect();
    for (seg, name) in segments.iter().zip(&names) {
        expect_len(name, seg.len(), &[rows, h, size])?;
    }
    expect_len("output (bytes)", outputs.output.len(), &[t, h, size])?;
    if let Some(m) = inputs.merging_probs {
        expect_len("merging_probs", m.len(), &[t, e])?;
    }
    match (&inputs.permuted_probs, &outputs.unpermuted_probs) {
        (Some(pp), Some(up)) => {
            expect_len("permuted_probs", pp.len(), &[n])?;
            expect_len("unpermuted_probs", up.len(), &[t, e])?;
        }
        (Some(_), None) => return Err(shape("permuted_probs given without unpermuted_probs")),
        (None, Some(_)) => return Err(shape("unpermuted_probs given without permuted_probs")),
        (None, None) => {}
    }
    let region_names: Vec<&str> = names
        .iter()
        .map(|m| m.strip_suffix(" (bytes)").unwrap_or(m))
        .collect();
    let mut ins: Vec<Region<'_>> = segments
        .iter()
        .zip(&region_names)
        .map(|(seg, name)| Region::of(name, seg))
        .collect();
    ins.extend(inputs.merging_probs.map(|m| Region::of("merging_probs", m)));
    ins.extend(
        inputs
            .permuted_probs
            .map(|p| Region::of("permuted_probs", p)),
    );
    let mut outs = vec![Region::of("output", outputs.output)];
    outs.extend(
        outputs
            .unpermuted_probs
            .as_deref()
            .map(|u| Region::of("unpermuted_probs", u)),
    );
    alias::check(&ins, &outs, alias::alias_table(Op::Unpermute))?;

    if t == 0 {
        return Ok(());
    }
    // H is bounded by the checked output (T > 0 rows of H elements).
    let mut acc = try_vec(h, 0f32, "unpermute accumulator")?;
    let mut x = try_vec(h, 0f32, "unpermute row")?;
    for token in 0..t {
        acc.fill(0.0);
        for (dst, expert) in map.routes(token) {
            let w = inputs.merging_probs.map_or(1.0, |m| m[token * e + expert]);
            codec.load_slice(segments[dst / rows], (dst % rows) * h, &mut x);
            for (a, v) in acc.iter_mut().zip(&x) {
                *a += v * w;
            }
        }
        codec.store_slice(outputs.output, token * h, &acc);
    }
    if let (Some(pp), Some(up)) = (
        inputs.permuted_probs,
        outputs.unpermuted_probs.as_deref_mut(),
    ) {
        up.fill(0.0);
        for token in 0..t {
            for (dst, expert) in map.routes(token) {
                up[token * e + expert] = pp[dst];
            }
        }
    }
    Ok(())
}

/// Inputs of [`unpermute_backward`] (the gradient of `unpermute` with
/// merging probs).
pub struct UnpermuteBackwardInputs<'a> {
    /// `[T, H]` gradient of the unpermuted output, of `dtype`.
    pub grad: &'a [u8],
    /// `[out_rows, H]` forward input of `unpermute`, of `dtype`.
    pub fwd_input: &'a [u8],
    /// Element type (f32, f16 or bf16).
    pub dtype: DType,
    /// Hidden size `H`.
    pub hidden: usize,
    /// `[T, E]` merging probs of the forward call.
    pub merging_probs: &'a [f32],
}

/// Outputs of [`unpermute_backward`].
pub struct UnpermuteBackwardOutputs<'a> {
    /// `[out_rows, H]`: `act_grad[dst] = grad[t] * merging_probs[t, e]`
    /// (zero where no route writes).
    pub act_grad: &'a mut [u8],
    /// `[T, E]`: `dot(fwd_input[dst], grad[t])` in f32, summed in the
    /// fixed order of [`DOT_SLOTS`] (zero where no route).
    pub probs_grad: &'a mut [f32],
}

/// The backward of `unpermute` with merging probs.
pub fn unpermute_backward(
    map: RowIdMapRef<'_>,
    inputs: &UnpermuteBackwardInputs<'_>,
    outputs: &mut UnpermuteBackwardOutputs<'_>,
) -> Result<(), PermuteError> {
    let codec = codec("unpermute_backward", inputs.dtype)?;
    let (t, e, h, n) = (map.tokens(), map.experts(), inputs.hidden, map.out_rows());
    chunks_known("unpermute_backward", &map)?;
    let size = inputs.dtype.size_bytes();
    expect_len("grad (bytes)", inputs.grad.len(), &[t, h, size])?;
    expect_len("fwd_input (bytes)", inputs.fwd_input.len(), &[n, h, size])?;
    expect_len("merging_probs", inputs.merging_probs.len(), &[t, e])?;
    expect_len("act_grad (bytes)", outputs.act_grad.len(), &[n, h, size])?;
    expect_len("probs_grad", outputs.probs_grad.len(), &[t, e])?;
    let ins = [
        Region::of("grad", inputs.grad),
        Region::of("fwd_input", inputs.fwd_input),
        Region::of("merging_probs", inputs.merging_probs),
    ];
    let outs = [
        Region::of("act_grad", outputs.act_grad),
        Region::of("probs_grad", outputs.probs_grad),
    ];
    alias::check(&ins, &outs, alias::alias_table(Op::UnpermuteBackward))?;

    for rows in map.unwritten_rows() {
        outputs.act_grad[rows.start * h * size..rows.end * h * size].fill(0);
    }
    outputs.probs_grad.fill(0.0);
    let group = DOT_GROUP_BYTES / size;
    let mut partial = [0f32; DOT_SLOTS];
    if t == 0 {
        return Ok(());
    }
    // H is bounded by the checked grad (T > 0 rows of H elements).
    let mut g = try_vec(h, 0f32, "unpermute_backward grad row")?;
    let mut f = try_vec(h, 0f32, "unpermute_backward input row")?;
    let mut act = try_vec(h, 0f32, "unpermute_backward act row")?;
    for token in 0..t {
        codec.load_slice(inputs.grad, token * h, &mut g);
        for (dst, expert) in map.routes(token) {
            let w = inputs.merging_probs[token * e + expert];
            codec.load_slice(inputs.fwd_input, dst * h, &mut f);
            for (a, gj) in act.iter_mut().zip(&g) {
                *a = gj * w;
            }
            codec.store_slice(outputs.act_grad, dst * h, &act);
            partial.fill(0.0);
            for (q, (fs, gs)) in f.chunks(group).zip(g.chunks(group)).enumerate() {
                let slot = &mut partial[q % DOT_SLOTS];
                for (fj, gj) in fs.iter().zip(gs) {
                    *slot += fj * gj;
                }
            }
            outputs.probs_grad[token * e + expert] = tree_sum(&mut partial);
        }
    }
    Ok(())
}

/// The dot products of `unpermute_backward` sum in a fixed order that does
/// not depend on threads or launch shape, the same on Host and CUDA: the
/// row splits into groups of `DOT_GROUP_BYTES`; group `q` adds, element by
/// element, into slot `q % DOT_SLOTS`; the slots then add pairwise
/// ([`tree_sum`]).
pub const DOT_SLOTS: usize = 256;
/// See [`DOT_SLOTS`].
pub const DOT_GROUP_BYTES: usize = 16;

/// `slots[0] + slots[1] + ...` as a tree: halves fold onto each other,
/// `s[i] += s[i + width]` for `width = len/2, len/4, .., 1`.
fn tree_sum(slots: &mut [f32; DOT_SLOTS]) -> f32 {
    let mut width = DOT_SLOTS / 2;
    while width > 0 {
        for i in 0..width {
            slots[i] += slots[i + width];
        }
        width /= 2;
    }
    slots[0]
}
