//! XLA FFI handlers of the permutation ops: an XLA-like runtime (JAX's
//! `jax.ffi`, XLA's custom-call registry) registers them as they are.
//! The expert-parallel handlers (dispatch, combine and their gradients
//! across the devices of one process) and their groups are in `ep`.
//!
//! Every op has two handlers, one per platform, because the runtime's
//! metadata query carries no platform: `xcall_xla_<op>_host` for "cpu"
//! (never asks for a stream, never loads CUDA) and `xcall_xla_<op>_cuda`
//! for "CUDA" (stream and device ordinal from the call frame, never from
//! the calling thread). Operands and results are XLA buffers in the order
//! the header lists; scalar parameters are integer (or bool) attributes;
//! optional operands are switched on by `has_*` attributes. Unknown
//! attributes are refused, so a misspelt one cannot be silently ignored.
//! A 64-bit integer operand or result (`tokens_per_expert`,
//! `expert_offsets`, `split_sizes`, `sorted_indices`, `map`) may also be
//! an s32 buffer with one more trailing dim of 2: each pair of words is
//! one value, low word first, for runtimes without 64-bit types (JAX
//! without `jax_enable_x64`).
//!
//! Every failure, including the overlap refusal and bad shapes, returns an
//! XLA FFI error whose message is xcall's, prefixed with the target name
//! and suffixed with the xcall status; nothing is written then. Panics are
//! caught. The metadata query reports API version 0.3 and, on CUDA,
//! `COMMAND_BUFFER_COMPATIBLE` for every op that allocates nothing and
//! never waits for its stream (all but `make_chunk_sort_map`, which reads
//! the split back to check it unless the stream is capturing).
//!
//! The `graph_cache` attribute (CUDA): the call runs through one
//! process-wide graph cache ([`xcall_xla_graph_cache`]), keyed by (device
//! ordinal, op, attributes, buffers), unless the runtime is already
//! capturing the stream (then the work goes into the runtime's capture).

/// The mirrored C ABI of XLA FFI (XLA's types, not part of xcall's header).
///
/// cbindgen:ignore
pub mod abi;
mod ep;
mod ep_open;
mod frame;
mod specs;

use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use xcall_core::{DType, Device, Status};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{
    op_id, Attributes, Buffer, BufferRole, CacheConfig, GraphCache, OpCall, OpFailure,
};
use xcall_permute::call::{Target, Tensor};

use crate::graph::xcall_graph_cache;
use crate::guard::FfiError;
use crate::op_args::{self, Source};
use abi::*;
pub use ep::*;
pub use ep_open::*;
use frame::*;
use specs::*;

/// The graph cache of the XLA handlers (process-wide, sharded per device).
fn handler_cache() -> &'static xcall_graph_cache {
    static CACHE: OnceLock<xcall_graph_cache> = OnceLock::new();
    static PUBLISHED: std::sync::Once = std::sync::Once::new();
    let cache = CACHE.get_or_init(|| xcall_graph_cache {
        inner: GraphCache::new(CudaGraphs, CacheConfig::default())
            .unwrap_or_else(|e| unreachable!("the default config is valid: {e}")),
    });
    // A live handle owned by the library: usable with every
    // xcall_graph_cache_* call, left alone by xcall_graph_cache_free. Once
    // makes every thread wait until it is recorded.
    PUBLISHED.call_once(|| crate::handle::publish_static(cache));
    cache
}

/// The graph cache the XLA handlers use for calls with the `graph_cache`
/// attribute: pass it to `xcall_graph_cache_stats`, `_clear` or
/// `_invalidate_range`. It lives as long as the process;
/// `xcall_graph_cache_free` ignores it. Never NULL.
///
/// Bad input: none (no arguments).
#[no_mangle]
pub extern "C" fn xcall_xla_graph_cache() -> *const xcall_graph_cache {
    handler_cache()
}

/// Runs the op on CUDA through the handlers' graph cache: the call's key
/// is its op, its attributes (compared in full) and its buffers.
fn run_cached(spec: &Spec, target: &Target, d: &Decoded) -> Result<(), FfiError> {
    let buffers = d
        .args
        .iter()
        .map(|(_, t)| (t, BufferRole::In))
        .chain(d.rets.iter().map(|(_, t)| (t, BufferRole::Out)))
        .map(|(t, role)| Buffer::new(t.address, t.bytes(), role))
        .collect();
    let call = OpCall {
        device: target.device,
        op: op_id(spec.name),
        attributes: Attributes::named_ints(&d.attrs),
        buffers,
        stream: Some(CudaStreamHandle(target.stream.cast())),
    };
    let outcome = handler_cache().inner.run_op(call, |s| {
        let t = Target {
            stream: s.map_or(target.stream, |s| s.0.cast()),
            ..*target
        };
        // SAFETY: XLA's buffers are valid for their shapes on the call's
        // device until the call's stream work completes.
        unsafe { (spec.run)(&t, d) }
    });
    match outcome {
        Ok(_) => Ok(()),
        Err(OpFailure::Op(e)) => Err(e),
        Err(OpFailure::Cache(e)) => Err(FfiError::new(e.status(), e.to_string())),
    }
}

fn execute(spec: &Spec, side: Side, frame: &XLA_FFI_CallFrame) -> Result<(), FfiError> {
    let api = api_of(frame)?;
    let target = match side {
        Side::Host => Target::host(),
        Side::Cuda => cuda_target(frame, api)?,
    };
    let d = decode(spec, frame)?;
    if side == Side::Cuda && d.flag("graph_cache") {
        return run_cached(spec, &target, &d);
    }
    // SAFETY: as in run_cached.
    unsafe { (spec.run)(&target, &d) }
}

/// The XLA error code of an xcall status.
fn error_code(status: Status) -> ErrorCode {
    match status {
        Status::NullArgument | Status::InvalidArgument | Status::Aliased | Status::NoSuchDevice => {
            ErrorCode::InvalidArgument
        }
        Status::Unsupported => ErrorCode::Unimplemented,
        Status::CudaUnavailable => ErrorCode::Unavailable,
        Status::OutOfMemory => ErrorCode::ResourceExhausted,
        Status::Timeout => ErrorCode::DeadlineExceeded,
        Status::InvalidState
        | Status::CollectiveMismatch
        | Status::PeerFailed
        | Status::InvalidHandle
        | Status::Busy => ErrorCode::FailedPrecondition,
        Status::Limit => ErrorCode::ResourceExhausted,
        Status::Panic
        | Status::CudaDriver
        | Status::CompileFailed
        | Status::CallbackFailed
        | Status::System => ErrorCode::Internal,
        Status::Ok => ErrorCode::Unknown,
    }
}

/// The message an XLA error carries for `e`.
fn error_message(spec: &Spec, e: &FfiError) -> String {
    format!(
        "{}: {} [{}]",
        spec.name,
        e.message,
        e.status.c_name().to_string_lossy()
    )
}

/// Creates the runtime's error for `e`; NULL when the frame has no
/// `Error_Create` (nothing else could carry the message: XLA always passes
/// its table outside the metadata query).
fn to_xla_error(spec: &Spec, frame: &XLA_FFI_CallFrame, e: &FfiError) -> *mut XLA_FFI_Error {
    // Only Error_Create is needed here, which every version's table has at
    // the same place: an error about the table itself still gets through.
    // A frame that carries no way to make an error still must not read as
    // success: the handler returns the unreportable-error marker.
    // SAFETY: NULL or the runtime's table, valid for the call.
    let Some(api) = (unsafe { frame.api.as_ref() }) else {
        return unreportable(e);
    };
    let create = match api.error_create {
        Some(create) if api.struct_size >= API_SIZE_ERROR_CREATE => create,
        _ => return unreportable(e),
    };
    let message = CString::new(error_message(spec, e).replace('\0', "\\0")).unwrap_or_default();
    let mut args = XLA_FFI_Error_Create_Args {
        struct_size: ERROR_CREATE_ARGS_SIZE,
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        errc: error_code(e.status) as u32,
    };
    // SAFETY: the runtime's entry; it copies the message.
    let made = unsafe { create(&mut args) };
    if made.is_null() {
        // A runtime whose Error_Create gives NULL would turn the failure
        // into success.
        return unreportable(e);
    }
    made
}

/// What a handler returns for a failure it cannot report through the
/// runtime (no call frame, no API table, no Error_Create): never NULL, the
/// same pointer every time, and never dereferenced by xcall. The message
/// goes to the thread's `xcall_last_error_message()`.
fn unreportable(e: &FfiError) -> *mut XLA_FFI_Error {
    crate::guard::record_error(e);
    xcall_xla_unreportable_error()
}

/// The pointer an XLA handler returns for a failure the call frame gives
/// it no way to report (a NULL frame, no API table, a table too short for
/// `Error_Create`, or `Error_Create` returning NULL). It is not an error
/// the runtime made: never pass it to the runtime's `Error_*` functions.
/// `xcall_last_error_message()` on the handler's thread says what was
/// wrong. Never NULL; the same value for the life of the process.
///
/// Bad input: none (no arguments).
#[no_mangle]
pub extern "C" fn xcall_xla_unreportable_error() -> *mut XLA_FFI_Error {
    static MARKER: u64 = 0x7863_616c_6c5f_6572; // never read
    std::ptr::addr_of!(MARKER) as *mut XLA_FFI_Error
}

/// The most extensions a call frame's chain may hold: the walk stops
/// there (a chain that points back into itself would never end).
const MAX_EXTENSIONS: usize = 64;

/// Answers the metadata query when the frame carries one; `Ok(true)` if
/// it did. A malformed query (a short extension, no metadata, a short
/// metadata struct) or an endless chain is an error: nothing is written.
fn answer_metadata(spec: &Spec, side: Side, frame: &XLA_FFI_CallFrame) -> Result<bool, FfiError> {
    let mut ext = frame.extension_start;
    // SAFETY: the chain's nodes are the runtime's extensions, each starting
    // with an XLA_FFI_Extension_Base; sizes are checked before the metadata
    // extension and the metadata are touched.
    unsafe {
        let mut walked = 0;
        while let Some(base) = ext.as_ref() {
            walked += 1;
            if walked > MAX_EXTENSIONS {
                return Err(invalid(format!(
                    "the call frame's extension chain is longer than {MAX_EXTENSIONS} (does it point back into itself?)"
                )));
            }
            if base.kind == EXTENSION_METADATA {
                if base.struct_size < METADATA_EXTENSION_SIZE {
                    return Err(invalid(format!(
                        "the metadata extension has {} bytes, expected at least {METADATA_EXTENSION_SIZE}",
                        base.struct_size
                    )));
                }
                let m = (*(ext as *mut XLA_FFI_Metadata_Extension)).metadata;
                let m = m.as_mut().ok_or_else(|| {
                    invalid("the metadata extension has no metadata to fill".into())
                })?;
                if m.struct_size < METADATA_SIZE {
                    return Err(invalid(format!(
                        "XLA_FFI_Metadata of {} bytes, expected at least {METADATA_SIZE}",
                        m.struct_size
                    )));
                }
                m.api_version = XLA_FFI_Api_Version {
                    struct_size: API_VERSION_SIZE,
                    extension_start: std::ptr::null_mut(),
                    major_version: API_MAJOR,
                    minor_version: API_MINOR,
                };
                m.traits = match side {
                    Side::Host => 0,
                    Side::Cuda => spec.cuda_traits,
                };
                if m.struct_size >= METADATA_WITH_STATE_SIZE {
                    m.state_type_id = 0;
                }
                return Ok(true);
            }
            ext = base.next;
        }
    }
    Ok(false)
}

/// Every handler: checks the frame, answers the metadata query, runs the
/// op at the execute stage, turns failures and panics into XLA errors.
fn handle(spec: &Spec, side: Side, frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    // SAFETY: NULL or the runtime's call frame, valid for the call.
    let Some(frame) = (unsafe { frame.as_ref() }) else {
        return unreportable(&invalid(format!("{}: the call frame is NULL", spec.name)));
    };
    if frame.struct_size < FRAME_SIZE_WITH_API {
        // Even the API table's field is past the frame's end.
        return unreportable(&invalid(format!(
            "{}: XLA_FFI_CallFrame of {} bytes, expected at least {CALL_FRAME_SIZE}",
            spec.name, frame.struct_size
        )));
    }
    xcall_core::log::init_from_env_once();
    let result = catch_unwind(AssertUnwindSafe(|| {
        if frame.struct_size < CALL_FRAME_SIZE {
            return Err(invalid(format!(
                "XLA_FFI_CallFrame of {} bytes, expected at least {CALL_FRAME_SIZE}",
                frame.struct_size
            )));
        }
        if answer_metadata(spec, side, frame)? {
            return Ok(());
        }
        match frame.stage {
            STAGE_EXECUTE => execute(spec, side, frame),
            // Instantiate, prepare, initialize: nothing to do.
            s if s < STAGE_EXECUTE => Ok(()),
            s => Err(invalid(format!(
                "unknown execution stage {s} (instantiate 0, prepare 1, initialize 2, execute 3)"
            ))),
        }
    }));
    let e = match result {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(panic) => FfiError::new(
            Status::Panic,
            format!(
                "internal panic caught at the XLA FFI boundary: {}",
                xcall_core::panic_message(&*panic)
            ),
        ),
    };
    to_xla_error(spec, frame, &e)
}

/// XLA FFI handler of `make_row_id_map` for "cpu". Operand: `routing`
/// `[T, E]` pred/u8. Results: `row_id_map` `[T, 2E + 1]` s32,
/// `tokens_per_expert` `[E]` s64, `expert_offsets` `[E + 1]` s64.
/// Attributes (integers, optional): `num_out_tokens` (-1: no cap), `align`
/// (0: none), `capacity` (0: none), `group_experts` and `group_rows` (0:
/// no groups), `graph_cache`. See `xcall_make_row_id_map` and
/// `xcall_make_row_id_map_grouped`. Any s64 operand or result of the
/// permutation handlers may instead be an s32 buffer with a trailing dim
/// of 2 (one value per pair of words, low word first), for runtimes
/// without 64-bit types: `tokens_per_expert` `[E, 2]` s32.
///
/// Bad input: a malformed call frame (NULL, short structs, an unknown
/// stage, a NULL or short metadata extension, a looping extension chain,
/// more than 32 attributes, duplicate or unknown attributes, operands or
/// results of the wrong count, rank, dims or dtype) gets an XLA error
/// naming what is wrong and nothing is written; a frame that cannot report
/// an error gets `xcall_xla_unreportable_error()`. Then the rules of
/// `xcall_make_row_id_map`.
#[no_mangle]
pub extern "C" fn xcall_xla_make_row_id_map_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&MAKE_ROW_ID_MAP, Side::Host, call_frame)
}

/// `xcall_xla_make_row_id_map_host` for "CUDA".
///
/// Bad input: as `xcall_xla_make_row_id_map_host`; the runtime's device
/// ordinal is checked first (an error names the device).
#[no_mangle]
pub extern "C" fn xcall_xla_make_row_id_map_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&MAKE_ROW_ID_MAP, Side::Cuda, call_frame)
}

/// XLA FFI handler of `permute` for "cpu". Operands: `input` `[T, H]`,
/// `row_id_map`, `tokens_per_expert`, `expert_offsets`, then `probs`
/// `[T, E]` f32 if `has_probs`, then `scales` `[T, S]` f32 if `has_scales`.
/// Results: `output` `[N, H]`, then `permuted_probs` `[N]` if `has_probs`,
/// then `permuted_scales` `[N, S]` if `has_scales`. See `xcall_permute`.
///
/// Bad input: a malformed call frame (NULL, short structs, an unknown
/// stage, a NULL or short metadata extension, a looping extension chain,
/// more than 32 attributes, duplicate or unknown attributes, operands or
/// results of the wrong count, rank, dims or dtype) gets an XLA error
/// naming what is wrong and nothing is written; a frame that cannot report
/// an error gets `xcall_xla_unreportable_error()`. Then the rules of
/// `xcall_permute`.
#[no_mangle]
pub extern "C" fn xcall_xla_permute_host(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    handle(&PERMUTE, Side::Host, call_frame)
}

/// `xcall_xla_permute_host` for "CUDA".
///
/// Bad input: as `xcall_xla_permute_host`; the runtime's device ordinal is
/// checked first (an error names the device).
#[no_mangle]
pub extern "C" fn xcall_xla_permute_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    handle(&PERMUTE, Side::Cuda, call_frame)
}

/// XLA FFI handler of `unpermute` for "cpu". Operands: `input` `[N, H]`,
/// `row_id_map`, then `merging_probs` `[T, E]` f32 if `has_merging_probs`,
/// then `permuted_probs` `[N]` f32 if `has_permuted_probs`. Results:
/// `output` `[T, H]`, then `unpermuted_probs` `[T, E]` f32 if
/// `has_permuted_probs`. See `xcall_unpermute`.
///
/// Bad input: a malformed call frame (NULL, short structs, an unknown
/// stage, a NULL or short metadata extension, a looping extension chain,
/// more than 32 attributes, duplicate or unknown attributes, operands or
/// results of the wrong count, rank, dims or dtype) gets an XLA error
/// naming what is wrong and nothing is written; a frame that cannot report
/// an error gets `xcall_xla_unreportable_error()`. Then the rules of
/// `xcall_unpermute`.
#[no_mangle]
pub extern "C" fn xcall_xla_unpermute_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&UNPERMUTE, Side::Host, call_frame)
}

/// `xcall_xla_unpermute_host` for "CUDA".
///
/// Bad input: as `xcall_xla_unpermute_host`; the runtime's device ordinal
/// is checked first (an error names the device).
#[no_mangle]
pub extern "C" fn xcall_xla_unpermute_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&UNPERMUTE, Side::Cuda, call_frame)
}

/// XLA FFI handler of `unpermute_backward` for "cpu". Operands: `grad`
/// `[T, H]`, `fwd_input` `[N, H]`, `row_id_map`, `tokens_per_expert`,
/// `expert_offsets`, `merging_probs` `[T, E]` f32. Results: `act_grad`
/// `[N, H]`, `probs_grad` `[T, E]` f32. See `xcall_unpermute_backward`.
///
/// Bad input: a malformed call frame (NULL, short structs, an unknown
/// stage, a NULL or short metadata extension, a looping extension chain,
/// more than 32 attributes, duplicate or unknown attributes, operands or
/// results of the wrong count, rank, dims or dtype) gets an XLA error
/// naming what is wrong and nothing is written; a frame that cannot report
/// an error gets `xcall_xla_unreportable_error()`. Then the rules of
/// `xcall_unpermute_backward`.
#[no_mangle]
pub extern "C" fn xcall_xla_unpermute_backward_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&UNPERMUTE_BACKWARD, Side::Host, call_frame)
}

/// `xcall_xla_unpermute_backward_host` for "CUDA".
///
/// Bad input: as `xcall_xla_unpermute_backward_host`; the runtime's device
/// ordinal is checked first (an error names the device).
#[no_mangle]
pub extern "C" fn xcall_xla_unpermute_backward_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&UNPERMUTE_BACKWARD, Side::Cuda, call_frame)
}

/// XLA FFI handler of `make_chunk_sort_map` for "cpu". Operands:
/// `split_sizes` `[S]` s64, `sorted_indices` `[S]` s64. Result: `map` `[T]`
/// s64 (each s64 may be an s32 `[..., 2]` pair, as for
/// `xcall_xla_make_row_id_map_host`). See `xcall_make_chunk_sort_map`.
///
/// Bad input: a malformed call frame (NULL, short structs, an unknown
/// stage, a NULL or short metadata extension, a looping extension chain,
/// more than 32 attributes, duplicate or unknown attributes, operands or
/// results of the wrong count, rank, dims or dtype) gets an XLA error
/// naming what is wrong and nothing is written; a frame that cannot report
/// an error gets `xcall_xla_unreportable_error()`. Then the rules of
/// `xcall_make_chunk_sort_map`.
#[no_mangle]
pub extern "C" fn xcall_xla_make_chunk_sort_map_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&MAKE_CHUNK_SORT_MAP, Side::Host, call_frame)
}

/// `xcall_xla_make_chunk_sort_map_host` for "CUDA" (not command-buffer
/// compatible: outside a capture it reads the split back to check it).
///
/// Bad input: as `xcall_xla_make_chunk_sort_map_host`; the runtime's device
/// ordinal is checked first (an error names the device).
#[no_mangle]
pub extern "C" fn xcall_xla_make_chunk_sort_map_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&MAKE_CHUNK_SORT_MAP, Side::Cuda, call_frame)
}

/// XLA FFI handler of `sort_chunks_by_map` for "cpu". Operands: `input`
/// `[T, H]`, `map` `[T]` s64, then `probs` `[T]` f32 if `has_probs`.
/// Results: `output` `[T, H]`, then `permuted_probs` `[T]` if `has_probs`.
/// Attribute `backward` (0: scatter, 1: gather). See
/// `xcall_sort_chunks_by_map`.
///
/// Bad input: a malformed call frame (NULL, short structs, an unknown
/// stage, a NULL or short metadata extension, a looping extension chain,
/// more than 32 attributes, duplicate or unknown attributes, operands or
/// results of the wrong count, rank, dims or dtype) gets an XLA error
/// naming what is wrong and nothing is written; a frame that cannot report
/// an error gets `xcall_xla_unreportable_error()`. Then the rules of
/// `xcall_sort_chunks_by_map`.
#[no_mangle]
pub extern "C" fn xcall_xla_sort_chunks_by_map_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&SORT_CHUNKS_BY_MAP, Side::Host, call_frame)
}

/// `xcall_xla_sort_chunks_by_map_host` for "CUDA".
///
/// Bad input: as `xcall_xla_sort_chunks_by_map_host`; the runtime's device
/// ordinal is checked first (an error names the device).
#[no_mangle]
pub extern "C" fn xcall_xla_sort_chunks_by_map_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&SORT_CHUNKS_BY_MAP, Side::Cuda, call_frame)
}

/// XLA FFI handler of expert-parallel dispatch for "cpu" (see the module
/// docs of groups). Operands: `x` `[T, H]` (f32 or bf16, the group's
/// precision), `ids` `[T, k]` s32 (-1: no route), `probs` `[T, k]` f32,
/// `rank` s32 scalar (this PE's rank; host memory). Results: `rows`
/// `[expert_rows, H]` (the expert-major layout of `xcall_ep_dispatch`),
/// `tokens_per_expert` `[L]` s64 (or s32 `[L, 2]` pairs), `routing` u8
/// `[routing_bytes]` (this dispatch's routing, for the combine and
/// backward handlers). Attributes: `group` (the id of
/// `xcall_xla_ep_open`), `zero_unused` (0/1: zero `rows` first, so rows
/// no route fills read as zeros). Collective over the group's PEs; begins
/// with an empty phase.
///
/// Bad input: a malformed call frame (as for `xcall_xla_permute_host`);
/// no open group of that id; a group of the other platform; a rank
/// outside the group; an operand or result whose dtype or dims are not
/// the group's: an XLA error naming it, nothing written. Then the rules
/// of `xcall_ep_dispatch` (ids outside `-1..E` or repeated: an error after
/// the call completed on every PE).
#[no_mangle]
pub extern "C" fn xcall_xla_ep_dispatch_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_DISPATCH, Side::Host, call_frame)
}

/// `xcall_xla_ep_dispatch_host` for "CUDA": the PE is the frame's device,
/// looked up in the group's devices (the `rank` operand is ignored).
///
/// Bad input: as `xcall_xla_ep_dispatch_host`; a device that is not one of the
/// group's: an XLA error naming it.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_dispatch_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_DISPATCH, Side::Cuda, call_frame)
}

/// XLA FFI handler of expert-parallel combine for "cpu". Operands:
/// `expert_out` `[expert_rows, H]` (expert-major, the group's precision),
/// `routing` (a dispatch handler's result), `rank`. Result: `y` `[T, H]`:
/// each token the sum of its experts' rows weighted by the probs given to
/// that dispatch. Attribute `group`. Collective; puts the dispatch's
/// routing back first, so it follows that dispatch whatever came between.
///
/// Bad input: as `xcall_xla_ep_dispatch_host`; then the rules of
/// `xcall_ep_combine`.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_combine_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_COMBINE, Side::Host, call_frame)
}

/// `xcall_xla_ep_combine_host` for "CUDA": the PE is the frame's device,
/// looked up in the group's devices (the `rank` operand is ignored).
///
/// Bad input: as `xcall_xla_ep_combine_host`; a device that is not one of the
/// group's: an XLA error naming it.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_combine_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_COMBINE, Side::Cuda, call_frame)
}

/// XLA FFI handler of the gradient of expert-parallel combine for "cpu".
/// Operands: `grad_y` `[T, H]`, `expert_out` `[expert_rows, H]` (as
/// combine read it), `routing`, `rank`. Results: `grad_expert_out`
/// `[expert_rows, H]` (rows no route fills are zero), `grad_probs` `[T, k]`
/// f32. Attribute `group`. Collective; puts the routing back first.
///
/// Bad input: as `xcall_xla_ep_dispatch_host`; then the rules of
/// `xcall_ep_combine_backward`.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_combine_backward_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_COMBINE_BACKWARD, Side::Host, call_frame)
}

/// `xcall_xla_ep_combine_backward_host` for "CUDA": the PE is the frame's device,
/// looked up in the group's devices (the `rank` operand is ignored).
///
/// Bad input: as `xcall_xla_ep_combine_backward_host`; a device that is not one of the
/// group's: an XLA error naming it.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_combine_backward_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_COMBINE_BACKWARD, Side::Cuda, call_frame)
}

/// XLA FFI handler of the gradient of expert-parallel dispatch for "cpu".
/// Operands: `grad_rows` `[expert_rows, H]`, `routing`, `rank`. Result:
/// `grad_x` `[T, H]`: each token the sum of its routes' rows, unweighted.
/// Attribute `group`. Collective; puts the routing back first.
///
/// Bad input: as `xcall_xla_ep_dispatch_host`; then the rules of
/// `xcall_ep_dispatch_backward`.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_dispatch_backward_host(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_DISPATCH_BACKWARD, Side::Host, call_frame)
}

/// `xcall_xla_ep_dispatch_backward_host` for "CUDA": the PE is the frame's device,
/// looked up in the group's devices (the `rank` operand is ignored).
///
/// Bad input: as `xcall_xla_ep_dispatch_backward_host`; a device that is not one of the
/// group's: an XLA error naming it.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_dispatch_backward_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    handle(&ep::EP_DISPATCH_BACKWARD, Side::Cuda, call_frame)
}
