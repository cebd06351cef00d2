//! C ABI of the MoE permutation ops (xcall-permute).

use std::ffi::{c_char, c_void};

use static_assertions::{assert_eq_size, const_assert_eq};
use xcall_core::Status;
use xcall_permute::alias::{alias_table, Op};
use xcall_permute::call::{self, Target};
use xcall_permute::{MapFaults, PermuteError};

use crate::guard::{c_code, code_arg, ffi_call, out_ptr, FfiError};
use crate::op_args::{self, xcall_tensor, CArgs};
use crate::target::xcall_target;

/// One (input, output) pair of an op that may share memory.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_alias_pair {
    /// Input name (static string).
    pub input: *const c_char,
    /// Output name (static string).
    pub output: *const c_char,
}

assert_eq_size!(xcall_alias_pair, [u64; 2]);
assert_eq_size!(Op, u32);
const_assert_eq!(XCALL_PERMUTE_FAULT_ROUTE_COUNT, MapFaults::ROUTE_COUNT);
const_assert_eq!(XCALL_PERMUTE_FAULT_EXPERT, MapFaults::EXPERT);
const_assert_eq!(XCALL_PERMUTE_FAULT_ROW, MapFaults::ROW);
const_assert_eq!(XCALL_PERMUTE_FAULT_CHUNK_ROW, MapFaults::CHUNK_ROW);
const_assert_eq!(XCALL_PERMUTE_FAULT_DUPLICATE_ROW, MapFaults::DUPLICATE_ROW);
const_assert_eq!(XCALL_PERMUTE_FAULT_COUNTS, MapFaults::COUNTS);
const_assert_eq!(XCALL_PERMUTE_FAULT_SORT_MAP, MapFaults::SORT_MAP);

impl From<PermuteError> for FfiError {
    fn from(e: PermuteError) -> Self {
        FfiError::new(e.status(), e.to_string())
    }
}

/// A NUL-terminated copy of a buffer name, made once per name and kept
/// for the life of the process (names are few and static).
fn static_c_name(name: &'static str) -> *const c_char {
    use std::collections::HashMap;
    use std::ffi::CString;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashMap<&'static str, &'static std::ffi::CStr>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    names
        .entry(name)
        .or_insert_with(|| Box::leak(CString::new(name).unwrap_or_default().into_boxed_c_str()))
        .as_ptr()
}

fn target_arg(target: *const xcall_target) -> Result<Target, FfiError> {
    let t = xcall_target::read(target, "target")?;
    let device = t.device()?.validate()?;
    Ok(match t.cuda_stream(device) {
        None => Target::host(),
        Some(stream) => Target::cuda(device.ordinal, stream),
    })
}

/// Runs `$op` (an `op_args` function) on a C entry point's target and
/// tensors (named by the parameters themselves) and integer parameters.
macro_rules! run_c_op {
    ($op:path, $target:expr, [$($t:ident),* $(,)?] $(, $i:ident = $v:expr)* $(,)?) => {{
        let t = target_arg($target)?;
        let args = CArgs {
            target: &t,
            tensors: &[$((stringify!($t), $t as *const xcall_tensor)),*],
            ints: &[$((stringify!($i), $v)),*],
            segments: None,
        };
        // SAFETY: the header's contract: every tensor's data is valid for
        // its size on the target's device.
        unsafe { $op(&t, &args) }
    }};
}

/// The (input, output) pairs of permutation op `op` (an
/// `xcall_permute_op`) that may share memory: writes up to `capacity`
/// pairs to `out_pairs` (may be NULL when `capacity` is 0) and the number
/// of pairs to `out_count`. For every op of this family the table is
/// empty: no output may overlap an input or another output.
///
/// Bad input: an unknown op or a table larger than `capacity`:
/// `XCALL_STATUS_INVALID_ARGUMENT`; NULL `out_count` (or NULL `out_pairs`
/// for a non-empty table): `XCALL_STATUS_NULL_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_permute_alias_table(
    op: PermuteOpCode,
    out_pairs: *mut xcall_alias_pair,
    capacity: usize,
    out_count: *mut usize,
) -> Status {
    ffi_call!({
        let op = op.get()?;
        let table = alias_table(op);
        let count = out_ptr(out_count, "out_count")?;
        if table.len() > capacity {
            return Err(FfiError::new(
                Status::InvalidArgument,
                format!("{} pairs do not fit capacity {capacity}", table.len()),
            ));
        }
        if !table.is_empty() && out_pairs.is_null() {
            return Err(FfiError::new(Status::NullArgument, "out_pairs is NULL"));
        }
        for (i, (input, output)) in table.iter().enumerate() {
            // SAFETY: out_pairs holds `capacity` >= table.len() pairs.
            unsafe {
                *out_pairs.add(i) = xcall_alias_pair {
                    input: static_c_name(input),
                    output: static_c_name(output),
                }
            };
        }
        *count = table.len();
        Ok(())
    })
}

/// Map fault: a token's route count is outside `[0, E]` (see
/// `xcall_permute_take_faults`).
pub const XCALL_PERMUTE_FAULT_ROUTE_COUNT: u32 = 1;
/// Map fault: a route's expert is outside `[0, E)`.
pub const XCALL_PERMUTE_FAULT_EXPERT: u32 = 2;
/// Map fault: a route's destination row is outside `[0, N)`.
pub const XCALL_PERMUTE_FAULT_ROW: u32 = 4;
/// Map fault (checked mode): a route's row is outside its expert's kept
/// rows.
pub const XCALL_PERMUTE_FAULT_CHUNK_ROW: u32 = 8;
/// Map fault (checked mode): two routes write one row.
pub const XCALL_PERMUTE_FAULT_DUPLICATE_ROW: u32 = 16;
/// Map fault (checked mode): an expert chunk is invalid or
/// `tokens_per_expert` differs from the routes the map sends to it.
pub const XCALL_PERMUTE_FAULT_COUNTS: u32 = 32;
/// Map fault: a chunk-sort map entry is outside `[0, T)`.
pub const XCALL_PERMUTE_FAULT_SORT_MAP: u32 = 64;

/// Map faults found on the target's device since the last call, as
/// `XCALL_PERMUTE_FAULT_*` bits in `*out_faults` (then cleared); waits
/// for the target's stream first. On CUDA a kernel cannot fail a call:
/// every kernel that follows a row-id or chunk-sort map skips an entry
/// pointing outside its tensors (nothing is written out of range) and
/// records the fault here. Checked mode (environment
/// `XCALL_PERMUTE_CHECK=1`, read at each call) makes `xcall_permute`,
/// `xcall_unpermute` and `xcall_unpermute_backward` on CUDA check the whole
/// map on the device first, as the Host does (bounds, kept rows, unique
/// rows, `tokens_per_expert`), wait for the stream and fail with
/// `XCALL_STATUS_INVALID_ARGUMENT`, nothing written; under stream capture
/// the check is captured and its faults are recorded here instead
/// (waiting for a stream is refused while another thread of the process
/// captures in `CU_STREAM_CAPTURE_MODE_GLOBAL`). The record is per device,
/// shared by its streams. Always 0 on Host, which
/// refuses a bad map before any work. NULL `target` or `out_faults`:
/// `XCALL_STATUS_NULL_ARGUMENT`.
///
/// Bad input: as described above; `*out_faults` is written only on success.
#[no_mangle]
pub extern "C" fn xcall_permute_take_faults(
    target: *const xcall_target,
    out_faults: *mut u32,
) -> Status {
    ffi_call!({
        let target = target_arg(target)?;
        let out = out_ptr(out_faults, "out_faults")?;
        *out = call::take_faults(&target)?.0;
        Ok(())
    })
}

/// Builds the row-id map of `routing` (`[T, E]` u8 or bool; any nonzero
/// byte is a route): `row_id_map` `[T, 2E + 1]` i32, `tokens_per_expert`
/// `[E]` i64 (routes kept), `expert_offsets` `[E + 1]` i64 (first row of
/// each expert's chunk, then the end). `num_out_tokens` < 0: no cap;
/// otherwise routes whose row falls at or past it are dropped. `align` 0:
/// no padding; otherwise every chunk is padded to a multiple of it (not
/// combinable with a cap). `capacity` 0: none; otherwise every expert's
/// chunk is exactly `capacity` rows (expert e starts at row e * capacity,
/// E * capacity rows in all, whatever the routing: the layout a captured
/// graph needs), routes past an expert's capacity are dropped (later
/// tokens first) and free rows are padding (not combinable with a cap or
/// align).
///
/// Bad input: see the permutation ops' rules above `xcall_permute`; also
/// `align` or `capacity` so large that a row index or offset would
/// overflow, `align` combined with a cap, `capacity` with a cap or align:
/// `XCALL_STATUS_INVALID_ARGUMENT`, nothing written.
#[no_mangle]
pub extern "C" fn xcall_make_row_id_map(
    target: *const xcall_target,
    routing: *const xcall_tensor,
    num_out_tokens: i64,
    align: i64,
    capacity: i64,
    row_id_map: *mut xcall_tensor,
    tokens_per_expert: *mut xcall_tensor,
    expert_offsets: *mut xcall_tensor,
) -> Status {
    ffi_call!({
        run_c_op!(
            op_args::make_row_id_map,
            target,
            [routing, row_id_map, tokens_per_expert, expert_offsets],
            num_out_tokens = num_out_tokens,
            align = align,
            capacity = capacity
        )
    })
}

/// `xcall_make_row_id_map` with the experts in groups whose chunks start at
/// fixed rows (no cap, no capacity): group `g` (experts `[g *
/// group_experts, (g + 1) * group_experts)`) owns the rows `[g *
/// group_rows, (g + 1) * group_rows)` and packs its experts' chunks
/// densely from its first row, in expert order, each padded to `align`
/// (0: no padding). `E / group_experts * group_rows` output rows in all,
/// whatever the routing, e.g. one group per destination of an
/// expert-parallel exchange, each sized for the worst case. A route whose
/// row would reach its group's end is dropped (the tail of the group's
/// expert-major order); with `group_rows >= T * min(topk, group_experts)`
/// (plus `group_experts * (align - 1)` when padded) no route of a top-k
/// routing is dropped. A group's rows past its last chunk's kept routes
/// are padding of its last expert (`expert_offsets[e + 1]` of the group's
/// last expert is the next group's first row).
///
/// Bad input: as `xcall_make_row_id_map`; also `group_experts` or
/// `group_rows` below 1, `group_experts` not dividing E, or more than
/// 2^31 - 1 rows in all: `XCALL_STATUS_INVALID_ARGUMENT`, nothing written.
#[no_mangle]
pub extern "C" fn xcall_make_row_id_map_grouped(
    target: *const xcall_target,
    routing: *const xcall_tensor,
    align: i64,
    group_experts: i64,
    group_rows: i64,
    row_id_map: *mut xcall_tensor,
    tokens_per_expert: *mut xcall_tensor,
    expert_offsets: *mut xcall_tensor,
) -> Status {
    ffi_call!({
        if group_experts < 1 || group_rows < 1 {
            return Err(FfiError::new(
                Status::InvalidArgument,
                format!(
                    "group_experts {group_experts} and group_rows {group_rows}: both must be at least 1"
                ),
            ));
        }
        run_c_op!(
            op_args::make_row_id_map,
            target,
            [routing, row_id_map, tokens_per_expert, expert_offsets],
            align = align,
            group_experts = group_experts,
            group_rows = group_rows
        )
    })
}

/// Groups tokens by expert: `output[dst] = input[t]` for every route,
/// `permuted_probs[dst] = probs[t, e]`, `permuted_scales[dst] =
/// scales[t]`; rows no route writes are zeroed. `input` `[T, H]` (any
/// dtype), `output` `[N, H]`; `probs` `[T, E]` f32 with `permuted_probs`
/// `[N]`, `scales` `[T, S]` f32 with `permuted_scales` `[N, S]` (each pair
/// both NULL or both given). `in_place`: outputs may overlap inputs (the
/// overlapped inputs are copied to scratch first).
///
/// Bad input: a NULL required tensor: `XCALL_STATUS_NULL_ARGUMENT` naming
/// it; a rank, dim or pairing (probs without permuted_probs, ...) that does
/// not fit: `XCALL_STATUS_INVALID_ARGUMENT` naming the tensor and dim; a
/// dtype the op does not take: `XCALL_STATUS_UNSUPPORTED`; an unknown dtype
/// code, `reserved` not 0, a tensor on another device or (CUDA) not device
/// memory of the target: `XCALL_STATUS_INVALID_ARGUMENT`; an output
/// overlapping an input or another output (without `in_place`):
/// `XCALL_STATUS_ALIASED`; a row-id map whose routes leave their tensors,
/// leave their expert's kept rows, share a row or disagree with
/// `tokens_per_expert`: `XCALL_STATUS_INVALID_ARGUMENT` on Host, checked
/// before anything is written (CUDA: see `xcall_permute_take_faults`).
/// Nothing is written on an error.
#[no_mangle]
pub extern "C" fn xcall_permute(
    target: *const xcall_target,
    input: *const xcall_tensor,
    row_id_map: *const xcall_tensor,
    tokens_per_expert: *const xcall_tensor,
    expert_offsets: *const xcall_tensor,
    probs: *const xcall_tensor,
    scales: *const xcall_tensor,
    output: *mut xcall_tensor,
    permuted_probs: *mut xcall_tensor,
    permuted_scales: *mut xcall_tensor,
    in_place: bool,
) -> Status {
    ffi_call!({
        run_c_op!(
            op_args::permute,
            target,
            [
                input,
                row_id_map,
                tokens_per_expert,
                expert_offsets,
                probs,
                scales,
                output,
                permuted_probs,
                permuted_scales
            ],
            in_place = in_place as i64
        )
    })
}

/// Restores token order: `output[t] = sum_k input[dst_k] *
/// merging_probs[t, e_k]` accumulated in f32 (weight 1 when
/// `merging_probs` is NULL); `unpermuted_probs[t, e] = permuted_probs[dst]`
/// (0 where no route). `input` `[N, H]` f32/f16/bf16, `output` `[T, H]`.
///
/// Bad input: as `xcall_permute` (the map is checked for bounds: route
/// counts, rows and experts).
#[no_mangle]
pub extern "C" fn xcall_unpermute(
    target: *const xcall_target,
    input: *const xcall_tensor,
    row_id_map: *const xcall_tensor,
    merging_probs: *const xcall_tensor,
    permuted_probs: *const xcall_tensor,
    output: *mut xcall_tensor,
    unpermuted_probs: *mut xcall_tensor,
) -> Status {
    ffi_call!({
        run_c_op!(
            op_args::unpermute,
            target,
            [
                input,
                row_id_map,
                merging_probs,
                permuted_probs,
                output,
                unpermuted_probs
            ]
        )
    })
}

/// The most segments `xcall_permute_segmented` and
/// `xcall_unpermute_segmented` take.
pub const XCALL_PERMUTE_MAX_SEGMENTS: usize = 32;
const_assert_eq!(XCALL_PERMUTE_MAX_SEGMENTS, call::MAX_SEGMENTS);

/// `segments` (`count` bases) as the library's segments of `rows` rows;
/// the bases are read only once `count` is bounded.
fn segments_arg(
    segments: *const *const c_void,
    count: usize,
    rows: i64,
) -> Result<call::Segments, FfiError> {
    if count == 0 || count > XCALL_PERMUTE_MAX_SEGMENTS {
        return Err(FfiError::new(
            Status::InvalidArgument,
            format!("num_segments is {count}, expected 1 to {XCALL_PERMUTE_MAX_SEGMENTS}"),
        ));
    }
    if segments.is_null() {
        return Err(FfiError::new(Status::NullArgument, "segments is NULL"));
    }
    if rows < 0 {
        return Err(FfiError::new(
            Status::InvalidArgument,
            format!("rows_per_segment is negative ({rows})"),
        ));
    }
    // SAFETY: the header's contract: `segments` holds `count` pointers
    // (bounded above).
    let bases = unsafe { std::slice::from_raw_parts(segments, count) };
    Ok(call::Segments {
        bases: bases.iter().map(|&b| b as u64).collect(),
        rows: rows as u64,
    })
}

/// `xcall_permute` (no probs or scales) into an output split over
/// `num_segments` allocations of `rows_per_segment` rows each: row `r` of
/// `output` (`[N, H]`, N = `num_segments * rows_per_segment`) is row `r %
/// rows_per_segment` of `segments[r / rows_per_segment]`. `output` gives
/// the dtype and dims; its `data` must be `segments[0]`. Only the routed
/// rows are written: the rows no route writes keep their bytes. On CUDA a
/// segment may be a peer GPU's memory the target's device reaches
/// (`xcall_shmem_ptr` of a world's object, peer access enabled by the
/// world). This is how a MoE layer's dispatch writes each destination PE's
/// receive slot directly.
///
/// Bad input: as `xcall_permute`, each segment checked like a tensor (NULL,
/// alignment, overlap with every other buffer and segment; on CUDA memory
/// the device cannot reach: `XCALL_STATUS_INVALID_ARGUMENT`); also
/// `num_segments` 0 or past `XCALL_PERMUTE_MAX_SEGMENTS`, a negative or
/// mismatched `rows_per_segment`, or `output.data` not `segments[0]`:
/// `XCALL_STATUS_INVALID_ARGUMENT`; NULL `segments`:
/// `XCALL_STATUS_NULL_ARGUMENT`. Nothing is written on an error.
#[no_mangle]
pub extern "C" fn xcall_permute_segmented(
    target: *const xcall_target,
    input: *const xcall_tensor,
    row_id_map: *const xcall_tensor,
    tokens_per_expert: *const xcall_tensor,
    expert_offsets: *const xcall_tensor,
    output: *mut xcall_tensor,
    segments: *const *const c_void,
    num_segments: usize,
    rows_per_segment: i64,
) -> Status {
    ffi_call!({
        let segs = segments_arg(segments, num_segments, rows_per_segment)?;
        let t = target_arg(target)?;
        let args = CArgs {
            target: &t,
            tensors: &[
                ("input", input),
                ("row_id_map", row_id_map),
                ("tokens_per_expert", tokens_per_expert),
                ("expert_offsets", expert_offsets),
                ("probs", std::ptr::null()),
                ("scales", std::ptr::null()),
                ("output", output as *const xcall_tensor),
                ("permuted_probs", std::ptr::null()),
                ("permuted_scales", std::ptr::null()),
            ],
            ints: &[],
            segments: Some(segs),
        };
        // SAFETY: the header's contract: every tensor's data and every
        // segment is valid for its size on (or reachable from) the
        // target's device.
        unsafe { op_args::permute(&t, &args) }
    })
}

/// `xcall_unpermute` (no permuted probs) of an input split over
/// `num_segments` allocations of `rows_per_segment` rows each (as in
/// `xcall_permute_segmented`; `input.data` must be `segments[0]`): how a
/// MoE layer's combine reads each destination PE's results where they lie.
///
/// Bad input: as `xcall_permute_segmented`.
#[no_mangle]
pub extern "C" fn xcall_unpermute_segmented(
    target: *const xcall_target,
    input: *const xcall_tensor,
    segments: *const *const c_void,
    num_segments: usize,
    rows_per_segment: i64,
    row_id_map: *const xcall_tensor,
    merging_probs: *const xcall_tensor,
    output: *mut xcall_tensor,
) -> Status {
    ffi_call!({
        let segs = segments_arg(segments, num_segments, rows_per_segment)?;
        let t = target_arg(target)?;
        let args = CArgs {
            target: &t,
            tensors: &[
                ("input", input),
                ("row_id_map", row_id_map),
                ("merging_probs", merging_probs),
                ("permuted_probs", std::ptr::null()),
                ("output", output as *const xcall_tensor),
                ("unpermuted_probs", std::ptr::null()),
            ],
            ints: &[],
            segments: Some(segs),
        };
        // SAFETY: as in `xcall_permute_segmented`.
        unsafe { op_args::unpermute(&t, &args) }
    })
}

/// The backward of `xcall_unpermute` with merging probs: `act_grad[dst] =
/// grad[t] * merging_probs[t, e]` (`[N, H]`, unwritten rows zeroed) and
/// `probs_grad[t, e] = dot(fwd_input[dst], grad[t])` in f32 (`[T, E]`).
///
/// Bad input: as `xcall_permute`.
#[no_mangle]
pub extern "C" fn xcall_unpermute_backward(
    target: *const xcall_target,
    grad: *const xcall_tensor,
    fwd_input: *const xcall_tensor,
    row_id_map: *const xcall_tensor,
    tokens_per_expert: *const xcall_tensor,
    expert_offsets: *const xcall_tensor,
    merging_probs: *const xcall_tensor,
    act_grad: *mut xcall_tensor,
    probs_grad: *mut xcall_tensor,
) -> Status {
    ffi_call!({
        run_c_op!(
            op_args::unpermute_backward,
            target,
            [
                grad,
                fwd_input,
                row_id_map,
                tokens_per_expert,
                expert_offsets,
                merging_probs,
                act_grad,
                probs_grad
            ]
        )
    })
}

/// Chunk-sort map: `split_sizes` `[S]` i64 and `sorted_indices` `[S]` i64
/// (a permutation of the chunks) give `map` `[T]` i64, each row's
/// destination (rows past the chunks map to themselves). On CUDA the split
/// is read back and checked (waiting for the stream) unless the stream is
/// capturing.
///
/// Bad input: as `xcall_permute` for the tensors; sizes that are negative
/// or sum past T, or indices that are not a permutation:
/// `XCALL_STATUS_INVALID_ARGUMENT`, map untouched (on CUDA under capture
/// the kernel leaves the map untouched instead and the call cannot report
/// it).
#[no_mangle]
pub extern "C" fn xcall_make_chunk_sort_map(
    target: *const xcall_target,
    split_sizes: *const xcall_tensor,
    sorted_indices: *const xcall_tensor,
    map: *mut xcall_tensor,
) -> Status {
    ffi_call!({
        run_c_op!(
            op_args::make_chunk_sort_map,
            target,
            [split_sizes, sorted_indices, map]
        )
    })
}

/// Reorders rows by a chunk-sort map: `backward` false scatters
/// (`output[map[t]] = input[t]`), true gathers (`output[t] =
/// input[map[t]]`); `probs`/`permuted_probs` `[T]` f32 move alike.
/// `in_place`: outputs may overlap inputs (copied to scratch first).
///
/// Bad input: as `xcall_permute` for the tensors; a map that is not a
/// permutation of [0, T): `XCALL_STATUS_INVALID_ARGUMENT` on Host, nothing
/// written; on CUDA an entry outside [0, T) is skipped and recorded (see
/// `xcall_permute_take_faults`).
#[no_mangle]
pub extern "C" fn xcall_sort_chunks_by_map(
    target: *const xcall_target,
    input: *const xcall_tensor,
    map: *const xcall_tensor,
    probs: *const xcall_tensor,
    backward: bool,
    output: *mut xcall_tensor,
    permuted_probs: *mut xcall_tensor,
    in_place: bool,
) -> Status {
    ffi_call!({
        run_c_op!(
            op_args::sort_chunks_by_map,
            target,
            [input, map, probs, output, permuted_probs],
            backward = backward as i64,
            in_place = in_place as i64
        )
    })
}

c_code!(
    /// An `xcall_permute_op` as passed.
    PermuteOpCode => Op
);
