//! The permutation ops' argument structs, filled in one place for both
//! front ends: a C entry point's parameters ([`CArgs`]) and an XLA call
//! frame (`xla::specs::Decoded`). Each front end only says how to find a
//! tensor or an integer by name ([`Source`]); which names an op takes, and
//! which are optional, is written once here. The C side's tensors are
//! `xcall_tensor`s, decoded here too. A segmented call (`permute`'s output
//! or `unpermute`'s input split over several allocations) is one option of
//! the arguments ([`Source::segments`]), not an op of its own.

use std::ffi::c_void;

use static_assertions::{assert_eq_align, assert_eq_size};
use xcall_core::{CEnum, DType, Status};
use xcall_permute::call::{self, Target, Tensor};
use xcall_permute::chunks::Direction;
use xcall_permute::{ExpertGroups, RowIdMapOptions};

use crate::guard::{DTypeCode, FfiError};

/// Largest tensor rank an `xcall_tensor` holds.
pub const XCALL_TENSOR_MAX_RANK: u32 = 4;

/// A dense row-major tensor.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_tensor {
    /// First element: a host pointer on Host, a `CUdeviceptr` on CUDA. May
    /// be NULL only when the tensor holds no elements.
    pub data: *mut c_void,
    /// Dimensions, outermost first; the first `rank` are used, none negative.
    pub dims: [i64; 4],
    /// Number of dimensions (at most `XCALL_TENSOR_MAX_RANK`).
    pub rank: u32,
    /// An `xcall_dtype` value.
    pub dtype: DTypeCode,
    /// Ordinal of the device holding the data; must equal the target's.
    pub device: u32,
    /// Must be 0 (`XCALL_STATUS_INVALID_ARGUMENT` otherwise).
    pub reserved: u32,
}

assert_eq_size!(xcall_tensor, [u64; 7]);
assert_eq_align!(xcall_tensor, u64);

/// The tensor `t` (named `name` in errors) as the library's [`Tensor`], on
/// `target`'s device.
pub(crate) fn tensor_arg(
    name: &str,
    t: &xcall_tensor,
    target: &Target,
) -> Result<Tensor, FfiError> {
    let bad = |m: String| FfiError::new(Status::InvalidArgument, format!("{name}: {m}"));
    if t.rank > XCALL_TENSOR_MAX_RANK {
        return Err(bad(format!(
            "rank {} exceeds {XCALL_TENSOR_MAX_RANK}",
            t.rank
        )));
    }
    if t.reserved != 0 {
        // Refused now so the field can take a meaning later.
        return Err(bad(format!("reserved is {}, must be 0", t.reserved)));
    }
    let dtype =
        DType::from_code(t.dtype.0).ok_or_else(|| bad(<DType as CEnum>::unknown(t.dtype.0)))?;
    let mut dims = Vec::with_capacity(t.rank as usize);
    for (i, &d) in t.dims[..t.rank as usize].iter().enumerate() {
        if d < 0 {
            return Err(bad(format!("dims[{i}] is negative ({d})")));
        }
        dims.push(d as u64);
    }
    if t.device != target.device.ordinal {
        return Err(bad(format!(
            "lives on device {} but the target is {}",
            t.device, target.device
        )));
    }
    Ok(Tensor::new(t.data as u64, dtype, &dims))
}

/// Where an op's tensors and integer parameters come from.
pub(crate) trait Source {
    /// How an integer parameter is named in an error ("align",
    /// "attribute align").
    fn int_label(&self, name: &str) -> String;

    /// A tensor the op takes; `None` when the call left it out.
    fn tensor(&self, name: &'static str) -> Result<Option<Tensor>, FfiError>;

    /// An integer parameter, `default` when the call gave none.
    fn int(&self, name: &'static str, default: i64) -> i64;

    /// Where the rows of the op's split tensor lie (`permute`'s output,
    /// `unpermute`'s input), when the call splits it; `None` by default.
    fn segments(&self) -> Option<call::Segments> {
        None
    }

    /// A tensor the op always takes: left out is
    /// `XCALL_STATUS_NULL_ARGUMENT` naming it.
    fn required(&self, name: &'static str) -> Result<Tensor, FfiError> {
        self.tensor(name)?
            .ok_or_else(|| FfiError::new(Status::NullArgument, format!("{name} is NULL")))
    }

    /// `None` for 0, the value for a positive one, an error naming the
    /// parameter for a negative one.
    fn non_negative(&self, name: &'static str) -> Result<Option<usize>, FfiError> {
        match self.int(name, 0) {
            0 => Ok(None),
            v if v < 0 => Err(FfiError::new(
                Status::InvalidArgument,
                format!("{} is negative ({v})", self.int_label(name)),
            )),
            v => Ok(Some(v as usize)),
        }
    }

    fn flag(&self, name: &'static str) -> bool {
        self.int(name, 0) != 0
    }
}

/// A C entry point's parameters: its tensors as `(name, pointer)` (NULL:
/// left out), its scalars as `(name, value)`, each decoded when the op
/// asks for it, and its segments (the `_segmented` entry points).
pub(crate) struct CArgs<'a> {
    pub(crate) target: &'a Target,
    pub(crate) tensors: &'a [(&'static str, *const xcall_tensor)],
    pub(crate) ints: &'a [(&'static str, i64)],
    pub(crate) segments: Option<call::Segments>,
}

impl Source for CArgs<'_> {
    fn int_label(&self, name: &str) -> String {
        name.to_string()
    }

    fn tensor(&self, name: &'static str) -> Result<Option<Tensor>, FfiError> {
        let (_, ptr) = self
            .tensors
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| unreachable!("{name} is a parameter of the entry point"));
        // SAFETY: NULL or a readable xcall_tensor (header contract).
        unsafe { ptr.as_ref() }
            .map(|t| tensor_arg(name, t, self.target))
            .transpose()
    }

    fn int(&self, name: &'static str, default: i64) -> i64 {
        self.ints
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(default, |(_, v)| *v)
    }

    fn segments(&self) -> Option<call::Segments> {
        self.segments.clone()
    }
}

/// Runs `make_row_id_map` on `s`'s arguments.
///
/// # Safety
/// Every tensor `s` yields is valid for its size on `t`'s device until
/// the work enqueued on `t`'s stream completes.
pub(crate) unsafe fn make_row_id_map(t: &Target, s: &impl Source) -> Result<(), FfiError> {
    let cap = s.int("num_out_tokens", -1);
    let args = call::MakeRowIdMapArgs {
        routing: s.required("routing")?,
        options: RowIdMapOptions {
            num_out_tokens: (cap >= 0).then_some(cap as usize),
            align: s.non_negative("align")?,
            capacity: s.non_negative("capacity")?,
            groups: match (
                s.non_negative("group_experts")?,
                s.non_negative("group_rows")?,
            ) {
                (None, None) => None,
                (Some(experts), Some(rows)) => Some(ExpertGroups { experts, rows }),
                _ => {
                    return Err(FfiError::new(
                        Status::InvalidArgument,
                        "group_experts and group_rows are both 0 (no groups) or both positive",
                    ))
                }
            },
        },
        row_id_map: s.required("row_id_map")?,
        tokens_per_expert: s.required("tokens_per_expert")?,
        expert_offsets: s.required("expert_offsets")?,
    };
    // SAFETY: the caller's promise on the tensors.
    Ok(unsafe { call::make_row_id_map(t, &args) }?)
}

/// Runs `permute` on `s`'s arguments (into its segments, if any).
///
/// # Safety
/// As [`make_row_id_map`], and every segment holds its rows.
pub(crate) unsafe fn permute(t: &Target, s: &impl Source) -> Result<(), FfiError> {
    let args = call::PermuteArgs {
        input: s.required("input")?,
        row_id_map: s.required("row_id_map")?,
        tokens_per_expert: s.required("tokens_per_expert")?,
        expert_offsets: s.required("expert_offsets")?,
        probs: s.tensor("probs")?,
        scales: s.tensor("scales")?,
        output: s.required("output")?,
        permuted_probs: s.tensor("permuted_probs")?,
        permuted_scales: s.tensor("permuted_scales")?,
        in_place: s.flag("in_place"),
        output_segments: s.segments(),
    };
    // SAFETY: the caller's promise on the tensors and segments.
    Ok(unsafe { call::permute(t, &args) }?)
}

/// Runs `unpermute` on `s`'s arguments (from its segments, if any).
///
/// # Safety
/// As [`permute`].
pub(crate) unsafe fn unpermute(t: &Target, s: &impl Source) -> Result<(), FfiError> {
    let args = call::UnpermuteArgs {
        input: s.required("input")?,
        row_id_map: s.required("row_id_map")?,
        merging_probs: s.tensor("merging_probs")?,
        permuted_probs: s.tensor("permuted_probs")?,
        output: s.required("output")?,
        unpermuted_probs: s.tensor("unpermuted_probs")?,
        input_segments: s.segments(),
    };
    // SAFETY: the caller's promise on the tensors and segments.
    Ok(unsafe { call::unpermute(t, &args) }?)
}

/// Runs `unpermute_backward` on `s`'s arguments.
///
/// # Safety
/// As [`make_row_id_map`].
pub(crate) unsafe fn unpermute_backward(t: &Target, s: &impl Source) -> Result<(), FfiError> {
    let args = call::UnpermuteBackwardArgs {
        grad: s.required("grad")?,
        fwd_input: s.required("fwd_input")?,
        row_id_map: s.required("row_id_map")?,
        tokens_per_expert: s.required("tokens_per_expert")?,
        expert_offsets: s.required("expert_offsets")?,
        merging_probs: s.required("merging_probs")?,
        act_grad: s.required("act_grad")?,
        probs_grad: s.required("probs_grad")?,
    };
    // SAFETY: the caller's promise on the tensors.
    Ok(unsafe { call::unpermute_backward(t, &args) }?)
}

/// Runs `make_chunk_sort_map` on `s`'s arguments.
///
/// # Safety
/// As [`make_row_id_map`].
pub(crate) unsafe fn make_chunk_sort_map(t: &Target, s: &impl Source) -> Result<(), FfiError> {
    let args = call::MakeChunkSortMapArgs {
        split_sizes: s.required("split_sizes")?,
        sorted_indices: s.required("sorted_indices")?,
        map: s.required("map")?,
    };
    // SAFETY: the caller's promise on the tensors.
    Ok(unsafe { call::make_chunk_sort_map(t, &args) }?)
}

/// Runs `sort_chunks_by_map` on `s`'s arguments.
///
/// # Safety
/// As [`make_row_id_map`].
pub(crate) unsafe fn sort_chunks_by_map(t: &Target, s: &impl Source) -> Result<(), FfiError> {
    let args = call::SortChunksArgs {
        input: s.required("input")?,
        map: s.required("map")?,
        probs: s.tensor("probs")?,
        direction: if s.flag("backward") {
            Direction::Backward
        } else {
            Direction::Forward
        },
        output: s.required("output")?,
        permuted_probs: s.tensor("permuted_probs")?,
        in_place: s.flag("in_place"),
    };
    // SAFETY: the caller's promise on the tensors.
    Ok(unsafe { call::sort_chunks_by_map(t, &args) }?)
}
