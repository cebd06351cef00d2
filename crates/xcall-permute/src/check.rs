//! The checks every op runs before any work, in this order: dtypes, ranks
//! and shapes against each other; NULL addresses of non-empty tensors;
//! alignment to the element size; overlap of every output with every input
//! and with the other outputs (refused as [`PermuteError::Aliased`] naming
//! both buffers). A call that passes them becomes a [`Checked`], the only
//! thing the backends accept.

use std::borrow::Cow;

use xcall_core::DType;

use crate::alias::{self, Op, Region};
use crate::args::{
    MakeChunkSortMapArgs, MakeRowIdMapArgs, NamedTensors, PermuteArgs, Segments, SortChunksArgs,
    Tensor, UnpermuteArgs, UnpermuteBackwardArgs, MAX_SEGMENTS,
};
use crate::error::{shape, PermuteError};
use crate::row_id_map;

/// Shape facts of a checked call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Tokens `T`.
    pub tokens: usize,
    /// Experts `E` (0 for chunk sort).
    pub experts: usize,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Permuted rows `N`.
    pub out_rows: usize,
    /// Scales per token `S` (0 without scales).
    pub scales: usize,
}

/// A call's arguments that passed every check of its op, with the dims the
/// checks found. Made only by this module's functions. It borrows the
/// caller's arguments; only staging (in-place calls) makes its own copy.
#[derive(Clone, Debug)]
pub struct Checked<'a, A: Clone> {
    args: Cow<'a, A>,
    dims: Dims,
}

impl<'a, A: Clone> Checked<'a, A> {
    fn new(args: &'a A, dims: Dims) -> Checked<'a, A> {
        Checked {
            args: Cow::Borrowed(args),
            dims,
        }
    }
    /// The checked arguments.
    pub fn args(&self) -> &A {
        &self.args
    }

    /// The dims the checks found.
    pub fn dims(&self) -> Dims {
        self.dims
    }

    /// The arguments, for staging only: an in-place call replaces an input
    /// that overlaps an output by a copy of the same bytes, which keeps
    /// every check true.
    pub(crate) fn args_mut(&mut self) -> &mut A {
        self.args.to_mut()
    }
}

/// Checks dtype, rank, size, NULL and alignment of one tensor.
fn check(name: &str, t: &Tensor, dtypes: &[DType], rank: usize) -> Result<(), PermuteError> {
    if !dtypes.contains(&t.dtype) {
        let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        return Err(PermuteError::Unsupported(format!(
            "{name} is {}, expected {}",
            t.dtype,
            names.join(" or ")
        )));
    }
    if t.dims.len() != rank {
        return Err(shape(format!(
            "{name} has rank {} (dims {:?}), expected rank {rank}",
            t.dims.len(),
            t.dims
        )));
    }
    let bytes = t
        .dims
        .iter()
        .try_fold(t.dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
        .filter(|&b| b < i64::MAX as u64 && t.address.checked_add(b).is_some())
        .ok_or_else(|| {
            shape(format!(
                "{name} dims {:?} overflow the address space",
                t.dims
            ))
        })?;
    if bytes > 0 && t.address == 0 {
        return Err(PermuteError::Null(format!(
            "{name} is NULL but holds {bytes} bytes"
        )));
    }
    let align = t.dtype.size_bytes() as u64;
    if bytes > 0 && t.address % align != 0 {
        return Err(shape(format!(
            "{name} address {:#x} is not aligned to its {align}-byte {} elements",
            t.address, t.dtype
        )));
    }
    Ok(())
}

fn dim(name: &str, t: &Tensor, axis: usize, want: u64, meaning: &str) -> Result<(), PermuteError> {
    if t.dims[axis] == want {
        Ok(())
    } else {
        Err(shape(format!(
            "{name} dim {axis} is {}, expected {want} ({meaning})",
            t.dims[axis]
        )))
    }
}

/// Checks the segments of tensor `name` (`t`, already checked as a
/// tensor; rows of `row` bytes): 1 to [`MAX_SEGMENTS`] bases, the first at
/// `t`'s address; `rows >= 1` with `bases * rows` the tensor's rows; each
/// base non-NULL, aligned to the element size, its rows inside the
/// address space.
fn check_segments(name: &str, t: &Tensor, s: &Segments, row: u64) -> Result<(), PermuteError> {
    let n = s.bases.len();
    if n == 0 || n > MAX_SEGMENTS {
        return Err(shape(format!(
            "{name} segments: {n} bases, expected 1 to {MAX_SEGMENTS}"
        )));
    }
    if s.bases[0] != t.address {
        return Err(shape(format!(
            "{name} segments: the first base {:#x} is not {name}'s address {:#x}",
            s.bases[0], t.address
        )));
    }
    if s.rows == 0 || (n as u64).checked_mul(s.rows) != Some(t.dims[0]) {
        return Err(shape(format!(
            "{name} segments: {n} segments of {} rows do not make {name}'s {} rows",
            s.rows, t.dims[0]
        )));
    }
    // The tensor's bytes were bounded by i64::MAX, so one segment's are.
    let bytes = s.rows * row;
    let align = t.dtype.size_bytes() as u64;
    for (i, &b) in s.bases.iter().enumerate() {
        if bytes == 0 {
            break;
        }
        if b == 0 {
            return Err(PermuteError::Null(format!(
                "{name} segment {i} is NULL but holds {bytes} bytes"
            )));
        }
        if b % align != 0 {
            return Err(shape(format!(
                "{name} segment {i} address {b:#x} is not aligned to its {align}-byte {} elements",
                t.dtype
            )));
        }
        if b.checked_add(bytes).is_none() {
            return Err(shape(format!(
                "{name} segment {i} at {b:#x} overflows the address space"
            )));
        }
    }
    Ok(())
}

pub(crate) fn usize_of(v: u64) -> usize {
    // Checked tensors' dims multiply to less than i64::MAX bytes.
    v as usize
}

/// Refuses overlaps (see the module docs); `in_place` allows outputs over
/// inputs, which the call then stages (copies away).
fn check_overlap(op: Op, a: &impl NamedTensors, in_place: bool) -> Result<(), PermuteError> {
    check_overlap_segmented(op, a, in_place, None)
}

/// [`check_overlap`] with one tensor (`name`) in segments: each segment is
/// a region of its own in that tensor's place.
fn check_overlap_segmented(
    op: Op,
    a: &impl NamedTensors,
    in_place: bool,
    segmented: Option<(&str, &Segments, u64)>,
) -> Result<(), PermuteError> {
    let (inputs, outputs) = (a.inputs(), a.outputs());
    let names: Vec<String> = segmented.map_or(Vec::new(), |(name, s, _)| {
        (0..s.bases.len())
            .map(|i| format!("{name} segment {i}"))
            .collect()
    });
    let regions = |list: &[(&'static str, &Tensor)]| -> Vec<Region<'_>> {
        let mut v = Vec::new();
        for &(n, t) in list {
            match segmented {
                Some((name, s, row)) if name == n => {
                    v.extend(names.iter().enumerate().map(|(i, m)| s.region(m, i, row)));
                }
                _ => v.push(t.region(n)),
            }
        }
        v
    };
    let (ins, outs) = (regions(&inputs), regions(&outputs));
    let mut allowed: Vec<(&str, &str)> = alias::alias_table(op).to_vec();
    if in_place {
        for (i, _) in &inputs {
            for (o, _) in &outputs {
                allowed.push((i, o));
            }
        }
    }
    alias::check(&ins, &outs, &allowed)
}

/// Checks a `make_row_id_map` call.
pub fn make_row_id_map(
    a: &MakeRowIdMapArgs,
) -> Result<Checked<'_, MakeRowIdMapArgs>, PermuteError> {
    check("routing", &a.routing, &[DType::U8, DType::Bool], 2)?;
    let (t, e) = (a.routing.dims[0], a.routing.dims[1]);
    if e == 0 {
        return Err(shape("a routing map needs at least 1 expert"));
    }
    if e > i32::MAX as u64 {
        return Err(shape(format!(
            "routing has {e} experts: expert ids do not fit the i32 row-id map"
        )));
    }
    check("row_id_map", &a.row_id_map, &[DType::I32], 2)?;
    dim("row_id_map", &a.row_id_map, 0, t, "tokens")?;
    dim("row_id_map", &a.row_id_map, 1, 2 * e + 1, "2 * experts + 1")?;
    check("tokens_per_expert", &a.tokens_per_expert, &[DType::I64], 1)?;
    dim("tokens_per_expert", &a.tokens_per_expert, 0, e, "experts")?;
    check("expert_offsets", &a.expert_offsets, &[DType::I64], 1)?;
    dim("expert_offsets", &a.expert_offsets, 0, e + 1, "experts + 1")?;
    row_id_map::check_layout(a.options, usize_of(t), usize_of(e))?;
    check_overlap(Op::MakeRowIdMap, a, false)?;
    Ok(Checked::new(
        a,
        Dims {
            tokens: usize_of(t),
            experts: usize_of(e),
            hidden: 0,
            out_rows: 0,
            scales: 0,
        },
    ))
}

fn pair<'a>(
    input: (&'a str, &'a Option<Tensor>),
    output: (&'a str, &'a Option<Tensor>),
) -> Result<Option<(&'a Tensor, &'a Tensor)>, PermuteError> {
    match (input.1, output.1) {
        (Some(i), Some(o)) => Ok(Some((i, o))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(shape(format!("{} given without {}", input.0, output.0))),
        (None, Some(_)) => Err(shape(format!("{} given without {}", output.0, input.0))),
    }
}

fn check_map(a: &Tensor, t: u64) -> Result<u64, PermuteError> {
    check("row_id_map", a, &[DType::I32], 2)?;
    dim("row_id_map", a, 0, t, "tokens")?;
    let w = a.dims[1];
    if w < 3 || w % 2 == 0 {
        return Err(shape(format!(
            "row_id_map dim 1 is {w}, expected 2 * experts + 1 with experts >= 1"
        )));
    }
    Ok((w - 1) / 2)
}

fn check_chunks(tpe: &Tensor, offsets: &Tensor, e: u64) -> Result<(), PermuteError> {
    check("tokens_per_expert", tpe, &[DType::I64], 1)?;
    dim("tokens_per_expert", tpe, 0, e, "experts")?;
    check("expert_offsets", offsets, &[DType::I64], 1)?;
    dim("expert_offsets", offsets, 0, e + 1, "experts + 1")
}

/// Checks a `permute` call.
pub fn permute(a: &PermuteArgs) -> Result<Checked<'_, PermuteArgs>, PermuteError> {
    check("input", &a.input, &DType::ALL, 2)?;
    let (t, h) = (a.input.dims[0], a.input.dims[1]);
    let e = check_map(&a.row_id_map, t)?;
    check_chunks(&a.tokens_per_expert, &a.expert_offsets, e)?;
    check("output", &a.output, &[a.input.dtype], 2)?;
    dim("output", &a.output, 1, h, "hidden, as input")?;
    let n = a.output.dims[0];
    if n > i32::MAX as u64 {
        return Err(shape(format!(
            "{n} output rows do not fit the i32 row-id map"
        )));
    }
    if let Some((p, pp)) = pair(("probs", &a.probs), ("permuted_probs", &a.permuted_probs))? {
        check("probs", p, &[DType::F32], 2)?;
        dim("probs", p, 0, t, "tokens")?;
        dim("probs", p, 1, e, "experts")?;
        check("permuted_probs", pp, &[DType::F32], 1)?;
        dim("permuted_probs", pp, 0, n, "output rows")?;
    }
    let mut s = 0;
    if let Some((sc, ps)) = pair(
        ("scales", &a.scales),
        ("permuted_scales", &a.permuted_scales),
    )? {
        check("scales", sc, &[DType::F32], 2)?;
        dim("scales", sc, 0, t, "tokens")?;
        s = sc.dims[1];
        check("permuted_scales", ps, &[DType::F32], 2)?;
        dim("permuted_scales", ps, 0, n, "output rows")?;
        dim("permuted_scales", ps, 1, s, "scales per token")?;
    }
    if let Some(segs) = &a.output_segments {
        let row = h * a.input.dtype.size_bytes() as u64;
        check_segments("output", &a.output, segs, row)?;
        for (given, name) in [
            (a.permuted_probs.is_some(), "permuted_probs"),
            (a.permuted_scales.is_some(), "permuted_scales"),
            (a.in_place, "in_place"),
        ] {
            if given {
                return Err(PermuteError::Unsupported(format!(
                    "permute with output segments writes the routed rows only, not {name}"
                )));
            }
        }
    }
    check_overlap_segmented(
        Op::Permute,
        a,
        a.in_place,
        a.output_segments
            .as_ref()
            .map(|s| ("output", s, h * a.input.dtype.size_bytes() as u64)),
    )?;
    Ok(Checked::new(
        a,
        Dims {
            tokens: usize_of(t),
            experts: usize_of(e),
            hidden: usize_of(h),
            out_rows: usize_of(n),
            scales: usize_of(s),
        },
    ))
}

/// Checks an `unpermute` call.
pub fn unpermute(a: &UnpermuteArgs) -> Result<Checked<'_, UnpermuteArgs>, PermuteError> {
    let dtypes: &[DType] = if a.merging_probs.is_some() {
        &[DType::F32, DType::F16, DType::Bf16]
    } else {
        &[
            DType::F32,
            DType::F16,
            DType::Bf16,
            DType::F8E4M3,
            DType::F8E5M2,
        ]
    };
    check("input", &a.input, dtypes, 2).map_err(|e| match e {
        PermuteError::Unsupported(m) => PermuteError::Unsupported(format!(
            "{m}: unpermute accumulates in f32 (fp8 only without merging_probs)"
        )),
        e => e,
    })?;
    let (n, h) = (a.input.dims[0], a.input.dims[1]);
    check("output", &a.output, &[a.input.dtype], 2)?;
    dim("output", &a.output, 1, h, "hidden, as input")?;
    let t = a.output.dims[0];
    let e = check_map(&a.row_id_map, t)?;
    if let Some(m) = &a.merging_probs {
        check("merging_probs", m, &[DType::F32], 2)?;
        dim("merging_probs", m, 0, t, "tokens")?;
        dim("merging_probs", m, 1, e, "experts")?;
    }
    if let Some((pp, up)) = pair(
        ("permuted_probs", &a.permuted_probs),
        ("unpermuted_probs", &a.unpermuted_probs),
    )? {
        check("permuted_probs", pp, &[DType::F32], 1)?;
        dim("permuted_probs", pp, 0, n, "input rows")?;
        check("unpermuted_probs", up, &[DType::F32], 2)?;
        dim("unpermuted_probs", up, 0, t, "tokens")?;
        dim("unpermuted_probs", up, 1, e, "experts")?;
    }
    if let Some(segs) = &a.input_segments {
        check_segments(
            "input",
            &a.input,
            segs,
            h * a.input.dtype.size_bytes() as u64,
        )?;
        if a.permuted_probs.is_some() {
            return Err(PermuteError::Unsupported(
                "unpermute with input segments does not take permuted_probs".into(),
            ));
        }
    }
    check_overlap_segmented(
        Op::Unpermute,
        a,
        false,
        a.input_segments
            .as_ref()
            .map(|s| ("input", s, h * a.input.dtype.size_bytes() as u64)),
    )?;
    Ok(Checked::new(
        a,
        Dims {
            tokens: usize_of(t),
            experts: usize_of(e),
            hidden: usize_of(h),
            out_rows: usize_of(n),
            scales: 0,
        },
    ))
}

/// Checks an `unpermute_backward` call.
pub fn unpermute_backward(
    a: &UnpermuteBackwardArgs,
) -> Result<Checked<'_, UnpermuteBackwardArgs>, PermuteError> {
    check("grad", &a.grad, &[DType::F32, DType::F16, DType::Bf16], 2)?;
    let (t, h) = (a.grad.dims[0], a.grad.dims[1]);
    check("fwd_input", &a.fwd_input, &[a.grad.dtype], 2)?;
    dim("fwd_input", &a.fwd_input, 1, h, "hidden, as grad")?;
    let n = a.fwd_input.dims[0];
    let e = check_map(&a.row_id_map, t)?;
    check_chunks(&a.tokens_per_expert, &a.expert_offsets, e)?;
    check("merging_probs", &a.merging_probs, &[DType::F32], 2)?;
    dim("merging_probs", &a.merging_probs, 0, t, "tokens")?;
    dim("merging_probs", &a.merging_probs, 1, e, "experts")?;
    check("act_grad", &a.act_grad, &[a.grad.dtype], 2)?;
    dim("act_grad", &a.act_grad, 0, n, "rows, as fwd_input")?;
    dim("act_grad", &a.act_grad, 1, h, "hidden, as grad")?;
    check("probs_grad", &a.probs_grad, &[DType::F32], 2)?;
    dim("probs_grad", &a.probs_grad, 0, t, "tokens")?;
    dim("probs_grad", &a.probs_grad, 1, e, "experts")?;
    check_overlap(Op::UnpermuteBackward, a, false)?;
    Ok(Checked::new(
        a,
        Dims {
            tokens: usize_of(t),
            experts: usize_of(e),
            hidden: usize_of(h),
            out_rows: usize_of(n),
            scales: 0,
        },
    ))
}

/// Checks a `make_chunk_sort_map` call (`dims.tokens` is the map's length).
pub fn make_chunk_sort_map(
    a: &MakeChunkSortMapArgs,
) -> Result<Checked<'_, MakeChunkSortMapArgs>, PermuteError> {
    check("split_sizes", &a.split_sizes, &[DType::I64], 1)?;
    check("sorted_indices", &a.sorted_indices, &[DType::I64], 1)?;
    dim(
        "sorted_indices",
        &a.sorted_indices,
        0,
        a.split_sizes.dims[0],
        "chunks",
    )?;
    check("map", &a.map, &[DType::I64], 1)?;
    check_overlap(Op::MakeChunkSortMap, a, false)?;
    Ok(Checked::new(
        a,
        Dims {
            tokens: usize_of(a.map.dims[0]),
            experts: 0,
            hidden: 0,
            out_rows: usize_of(a.map.dims[0]),
            scales: 0,
        },
    ))
}

/// Checks a `sort_chunks_by_map` call.
pub fn sort_chunks_by_map(a: &SortChunksArgs) -> Result<Checked<'_, SortChunksArgs>, PermuteError> {
    check("input", &a.input, &DType::ALL, 2)?;
    let (t, h) = (a.input.dims[0], a.input.dims[1]);
    check("map", &a.map, &[DType::I64], 1)?;
    dim("map", &a.map, 0, t, "rows of input")?;
    check("output", &a.output, &[a.input.dtype], 2)?;
    dim("output", &a.output, 0, t, "rows, as input")?;
    dim("output", &a.output, 1, h, "hidden, as input")?;
    if let Some((p, pp)) = pair(("probs", &a.probs), ("permuted_probs", &a.permuted_probs))? {
        check("probs", p, &[DType::F32], 1)?;
        dim("probs", p, 0, t, "rows of input")?;
        check("permuted_probs", pp, &[DType::F32], 1)?;
        dim("permuted_probs", pp, 0, t, "rows of input")?;
    }
    check_overlap(Op::SortChunksByMap, a, a.in_place)?;
    Ok(Checked::new(
        a,
        Dims {
            tokens: usize_of(t),
            experts: 0,
            hidden: usize_of(h),
            out_rows: usize_of(t),
            scales: 0,
        },
    ))
}
