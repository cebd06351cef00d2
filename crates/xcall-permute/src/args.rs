//! The arguments of the ops on raw addresses: where they run ([`Target`]),
//! the tensors they read and write ([`Tensor`]) and one `*Args` struct per
//! op. Plain data: the checks live in `check`, the work in the backends.

use std::ffi::c_void;

use xcall_core::{DType, Device};

use crate::alias::Region;
use crate::chunks::Direction;
use crate::error::PermuteError;
use crate::row_id_map::RowIdMapOptions;

/// Where an op runs.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The device every tensor lives on.
    pub device: Device,
    /// The `CUstream` on CUDA (not the legacy NULL stream); ignored on Host.
    pub stream: *mut c_void,
    /// Whether CUDA launches may autotune (see the crate docs). Defaults
    /// to on unless `XCALL_PERMUTE_AUTOTUNE=0`.
    pub autotune: bool,
    /// Checked mode on CUDA: ops that follow a row-id map check all of it
    /// on the device first (bounds, kept rows, unique rows, counts: what
    /// the Host checks) and, unless the stream is capturing, wait for the
    /// verdict, failing with nothing written. Under capture the check runs
    /// in the graph and records [`MapFaults`](crate::MapFaults) for
    /// [`take_faults`](crate::call::take_faults). Defaults
    /// to off unless `XCALL_PERMUTE_CHECK=1`. The Host always checks.
    pub checked: bool,
}

impl Target {
    /// The Host.
    pub fn host() -> Self {
        Target {
            device: Device::HOST,
            stream: std::ptr::null_mut(),
            autotune: false,
            checked: true,
        }
    }

    /// CUDA device `ordinal`, work enqueued on `stream`.
    pub fn cuda(ordinal: u32, stream: *mut c_void) -> Self {
        Target {
            device: Device::cuda(ordinal),
            stream,
            autotune: autotune_default(),
            checked: checked_default(),
        }
    }
}

/// Variable turning autotuning off (a boolean, see `xcall_core::env`).
pub const AUTOTUNE_ENV: &str = "XCALL_PERMUTE_AUTOTUNE";
/// Variable turning checked mode on (a boolean).
pub const CHECK_ENV: &str = "XCALL_PERMUTE_CHECK";

/// Autotuning unless `XCALL_PERMUTE_AUTOTUNE` is false (a value that is not
/// a boolean counts as unset here, and [`env_settings`] refuses it).
pub fn autotune_default() -> bool {
    xcall_core::env::flag(AUTOTUNE_ENV)
        .ok()
        .flatten()
        .unwrap_or(true)
}

/// Checked mode when `XCALL_PERMUTE_CHECK` is true (see
/// [`autotune_default`] for a malformed value).
pub fn checked_default() -> bool {
    xcall_core::env::flag(CHECK_ENV)
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Refuses a malformed `XCALL_PERMUTE_AUTOTUNE` or `XCALL_PERMUTE_CHECK`
/// (every CUDA op checks this before it runs), naming the variable.
pub fn env_settings() -> Result<(), PermuteError> {
    for name in [AUTOTUNE_ENV, CHECK_ENV] {
        xcall_core::env::flag(name).map_err(|e| PermuteError::Shape(e.to_string()))?;
    }
    Ok(())
}

/// A tensor: address (a host pointer or a `CUdeviceptr`), dtype, dims
/// (row-major, dense).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tensor {
    /// First byte.
    pub address: u64,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub dims: Vec<u64>,
}

impl Tensor {
    /// A tensor at `address`.
    pub fn new(address: u64, dtype: DType, dims: &[u64]) -> Self {
        Tensor {
            address,
            dtype,
            dims: dims.to_vec(),
        }
    }

    /// A tensor over a host slice.
    pub fn of<T>(data: &[T], dtype: DType, dims: &[u64]) -> Self {
        Self::new(data.as_ptr() as u64, dtype, dims)
    }

    /// Bytes, once the checks accepted the tensor.
    pub fn bytes(&self) -> u64 {
        self.dims.iter().product::<u64>() * self.dtype.size_bytes() as u64
    }

    pub(crate) fn region<'a>(&self, name: &'a str) -> Region<'a> {
        Region {
            name,
            address: self.address,
            bytes: self.bytes(),
        }
    }
}

/// The most segments a [`Segments`] may name (the CUDA kernels take the
/// bases as launch parameters).
pub const MAX_SEGMENTS: usize = 32;

/// The rows of a permuted `[N, H]` tensor split over separate
/// allocations (for example one per destination PE of a symmetric heap,
/// reached through peer pointers): row `r` lives in segment `r / rows`, at
/// row `r % rows` of it. Each segment holds `rows` dense rows; `N` is
/// `bases.len() * rows`. The tensor the segments stand for still gives
/// the dtype and the dims, and its address must be `bases[0]`.
///
/// On CUDA a base may be another device's memory that the target's
/// device reaches by peer access (enabled beforehand, as xcall-shmem's
/// worlds do); the checks refuse memory the device cannot reach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segments {
    /// The first byte of each segment, at most [`MAX_SEGMENTS`].
    pub bases: Vec<u64>,
    /// Rows per segment (at least 1).
    pub rows: u64,
}

impl Segments {
    /// The region of segment `s` for rows of `row_bytes` bytes (checked:
    /// the segments were accepted).
    pub(crate) fn region<'a>(&self, name: &'a str, s: usize, row_bytes: u64) -> Region<'a> {
        Region {
            name,
            address: self.bases[s],
            bytes: self.rows * row_bytes,
        }
    }
}

/// Arguments of [`make_row_id_map`](crate::call::make_row_id_map).
#[derive(Clone, Debug)]
pub struct MakeRowIdMapArgs {
    /// `[T, E]` u8 or bool; any nonzero byte is a route.
    pub routing: Tensor,
    /// See [`RowIdMapOptions`].
    pub options: RowIdMapOptions,
    /// Output `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// Output `[E]` i64: routes kept per expert.
    pub tokens_per_expert: Tensor,
    /// Output `[E + 1]` i64: first row of each expert's (padded) chunk,
    /// then the end of the last chunk.
    pub expert_offsets: Tensor,
}

/// Arguments of [`permute`](crate::call::permute).
#[derive(Clone, Debug)]
pub struct PermuteArgs {
    /// `[T, H]`, any dtype.
    pub input: Tensor,
    /// `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// `[E]` i64, from `make_row_id_map`.
    pub tokens_per_expert: Tensor,
    /// `[E + 1]` i64, from `make_row_id_map`.
    pub expert_offsets: Tensor,
    /// Optional `[T, E]` f32.
    pub probs: Option<Tensor>,
    /// Optional `[T, S]` f32.
    pub scales: Option<Tensor>,
    /// Output `[N, H]` of the input's dtype.
    pub output: Tensor,
    /// Output `[N]` f32, with `probs`.
    pub permuted_probs: Option<Tensor>,
    /// Output `[N, S]` f32, with `scales`.
    pub permuted_scales: Option<Tensor>,
    /// Outputs may overlap inputs (see [`call`](crate::call)).
    pub in_place: bool,
    /// `output`'s rows in segments (see [`Segments`]). Then only the
    /// routed rows are written: the rows no route writes are left as they
    /// are (the reader of a segmented output, such as a grouped op over
    /// each expert's routed rows, reads only those). Not with
    /// `permuted_probs`, `permuted_scales` or `in_place`.
    pub output_segments: Option<Segments>,
}

/// Arguments of [`unpermute`](crate::call::unpermute).
#[derive(Clone, Debug)]
pub struct UnpermuteArgs {
    /// `[N, H]` f32, f16 or bf16 (f8e4m3/f8e5m2 without merging probs).
    pub input: Tensor,
    /// `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// Optional `[T, E]` f32 merging weights.
    pub merging_probs: Option<Tensor>,
    /// Optional `[N]` f32 to scatter back.
    pub permuted_probs: Option<Tensor>,
    /// Output `[T, H]` of the input's dtype.
    pub output: Tensor,
    /// Output `[T, E]` f32, with `permuted_probs`.
    pub unpermuted_probs: Option<Tensor>,
    /// `input`'s rows in segments (see [`Segments`]). Not with
    /// `permuted_probs`.
    pub input_segments: Option<Segments>,
}

/// Arguments of [`unpermute_backward`](crate::call::unpermute_backward).
#[derive(Clone, Debug)]
pub struct UnpermuteBackwardArgs {
    /// `[T, H]` f32, f16 or bf16.
    pub grad: Tensor,
    /// `[N, H]`, the forward input of `unpermute`.
    pub fwd_input: Tensor,
    /// `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// `[E]` i64.
    pub tokens_per_expert: Tensor,
    /// `[E + 1]` i64.
    pub expert_offsets: Tensor,
    /// `[T, E]` f32.
    pub merging_probs: Tensor,
    /// Output `[N, H]`.
    pub act_grad: Tensor,
    /// Output `[T, E]` f32.
    pub probs_grad: Tensor,
}

/// Arguments of [`make_chunk_sort_map`](crate::call::make_chunk_sort_map).
#[derive(Clone, Debug)]
pub struct MakeChunkSortMapArgs {
    /// `[S]` i64 rows per chunk.
    pub split_sizes: Tensor,
    /// `[S]` i64, a permutation of `0..S`: the output order of the chunks.
    pub sorted_indices: Tensor,
    /// Output `[T]` i64.
    pub map: Tensor,
}

/// Arguments of [`sort_chunks_by_map`](crate::call::sort_chunks_by_map).
#[derive(Clone, Debug)]
pub struct SortChunksArgs {
    /// `[T, H]`, any dtype.
    pub input: Tensor,
    /// `[T]` i64, a permutation of `0..T` (from `make_chunk_sort_map`).
    pub map: Tensor,
    /// Optional `[T]` f32.
    pub probs: Option<Tensor>,
    /// Scatter (forward) or gather (backward).
    pub direction: Direction,
    /// Output `[T, H]` of the input's dtype.
    pub output: Tensor,
    /// Output `[T]` f32, with `probs`.
    pub permuted_probs: Option<Tensor>,
    /// Outputs may overlap inputs (see [`call`](crate::call)).
    pub in_place: bool,
}

/// An op's tensors by name, the ones a call left out skipped: what the
/// overlap check and the CUDA backend's device-memory check walk.
pub(crate) trait NamedTensors {
    /// The tensors the op reads.
    fn inputs(&self) -> Vec<(&'static str, &Tensor)>;
    /// The tensors the op writes.
    fn outputs(&self) -> Vec<(&'static str, &Tensor)>;
}

/// `(name, tensor)` for each field, the `Option` ones only when given.
macro_rules! named {
    ($a:ident: $($f:ident),* $(; $($o:ident),*)?) => {{
        #[allow(unused_mut)]
        let mut v: Vec<(&'static str, &Tensor)> = vec![$((stringify!($f), &$a.$f)),*];
        $($(v.extend($a.$o.as_ref().map(|t| (stringify!($o), t)));)*)?
        v
    }};
}

impl NamedTensors for MakeRowIdMapArgs {
    fn inputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: routing)
    }
    fn outputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: row_id_map, tokens_per_expert, expert_offsets)
    }
}

impl NamedTensors for PermuteArgs {
    fn inputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: input, row_id_map, tokens_per_expert, expert_offsets; probs, scales)
    }
    fn outputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: output; permuted_probs, permuted_scales)
    }
}

impl NamedTensors for UnpermuteArgs {
    fn inputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: input, row_id_map; merging_probs, permuted_probs)
    }
    fn outputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: output; unpermuted_probs)
    }
}

impl NamedTensors for UnpermuteBackwardArgs {
    fn inputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: grad, fwd_input, row_id_map, tokens_per_expert, expert_offsets, merging_probs)
    }
    fn outputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: act_grad, probs_grad)
    }
}

impl NamedTensors for MakeChunkSortMapArgs {
    fn inputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: split_sizes, sorted_indices)
    }
    fn outputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: map)
    }
}

impl NamedTensors for SortChunksArgs {
    fn inputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: input, map; probs)
    }
    fn outputs(&self) -> Vec<(&'static str, &Tensor)> {
        named!(self: output; permuted_probs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test owns both variables (tests of this crate run in parallel;
    /// no other reads them to a different end on Host).
    #[test]
    fn the_permute_switches_are_booleans_and_a_bad_one_is_refused_by_name() {
        std::env::set_var(AUTOTUNE_ENV, "maybe");
        let e = env_settings().unwrap_err();
        assert_eq!(e.status(), xcall_core::Status::InvalidArgument);
        assert!(
            e.to_string()
                .starts_with("XCALL_PERMUTE_AUTOTUNE=\"maybe\" is not a boolean"),
            "{e}"
        );
        assert!(autotune_default(), "a malformed value is not a choice");
        std::env::set_var(AUTOTUNE_ENV, "off");
        assert!(!autotune_default());
        std::env::set_var(CHECK_ENV, "2");
        assert!(env_settings().unwrap_err().to_string().contains(CHECK_ENV));
        assert!(!checked_default());
        std::env::set_var(CHECK_ENV, "Yes");
        assert!(checked_default());
        assert_eq!(env_settings(), Ok(()));
        std::env::remove_var(AUTOTUNE_ENV);
        std::env::remove_var(CHECK_ENV);
        assert!(autotune_default() && !checked_default());
        assert_eq!(env_settings(), Ok(()));
    }
}
