//! XLA FFI handlers of the permutation ops: an XLA-like runtime (JAX's
//! `jax.ffi`, XLA's custom-call registry) registers them as they are.
//!
//! Every op has two handlers, one per platform, because the runtime's
//! metadata query carries no platform: `xcall_xla_<op>_host` for "cpu"
//! (never asks for a stream, never loads CUDA) and `xcall_xla_<op>_cuda`
//! for "CUDA" (stream and device ordinal from the call frame, never from
//! the calling thread). Operands and results are XLA buffers in the order
//! the header lists; scalar parameters are integer (or bool) attributes;
//! optional operands are switched on by `has_*` attributes. Unknown
//! attributes are refused, so a misspelt one cannot be silently ignored.
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

use std::ffi::{c_void, CString};
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use xcall_core::{DType, Device, Status};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{Buffer, BufferRole, Call, CallKey, Config, GraphCache};
use xcall_permute::call::{self, Target, Tensor};
use xcall_permute::chunks::Direction;
use xcall_permute::{PermuteError, RowIdMapOptions};

use crate::graph::xcall_graph_cache;
use crate::guard::FfiError;
use abi::*;

/// The platform a handler serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Host,
    Cuda,
}

/// One operand or result: its name, and the `has_*` attribute that
/// switches it on (`None`: always present).
struct Slot {
    name: &'static str,
    when: Option<&'static str>,
}

const fn always(name: &'static str) -> Slot {
    Slot { name, when: None }
}

const fn with(name: &'static str, flag: &'static str) -> Slot {
    Slot {
        name,
        when: Some(flag),
    }
}

/// Attributes every handler accepts.
const COMMON_ATTRS: [&str; 1] = ["graph_cache"];

/// Attributes that are 0 or 1 (besides the `has_*` flags).
const BOOL_ATTRS: [&str; 2] = ["graph_cache", "backward"];

/// An op's handler: its signature and how it runs.
struct Spec {
    /// The target name (error prefix; the name `xcall_jax` registers).
    name: &'static str,
    args: &'static [Slot],
    rets: &'static [Slot],
    /// Integer attributes besides the `has_*` flags and [`COMMON_ATTRS`].
    scalars: &'static [&'static str],
    /// Traits reported on CUDA.
    cuda_traits: u32,
    run: fn(&Target, &Decoded) -> Result<(), PermuteError>,
}

/// A decoded call: operands, results and attributes by name.
struct Decoded {
    args: Vec<(&'static str, Tensor)>,
    rets: Vec<(&'static str, Tensor)>,
    attrs: Vec<(String, i64)>,
}

impl Decoded {
    fn find<'a>(list: &'a [(&'static str, Tensor)], name: &str) -> Option<&'a Tensor> {
        list.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
    }

    /// An operand or result the signature always has.
    fn req(&self, name: &str) -> Tensor {
        self.opt(name)
            .unwrap_or_else(|| unreachable!("{name} is in the signature"))
    }

    /// An operand or result switched on by a flag.
    fn opt(&self, name: &str) -> Option<Tensor> {
        Self::find(&self.args, name)
            .or_else(|| Self::find(&self.rets, name))
            .cloned()
    }

    fn attr(&self, name: &str, default: i64) -> i64 {
        self.attrs
            .iter()
            .find(|(n, _)| n == name)
            .map_or(default, |(_, v)| *v)
    }

    fn flag(&self, name: &str) -> bool {
        self.attr(name, 0) != 0
    }
}

fn non_negative(d: &Decoded, name: &str) -> Result<Option<usize>, PermuteError> {
    match d.attr(name, 0) {
        0 => Ok(None),
        v if v < 0 => Err(PermuteError::Shape(format!(
            "attribute {name} is negative ({v})"
        ))),
        v => Ok(Some(v as usize)),
    }
}

fn run_make_row_id_map(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let cap = d.attr("num_out_tokens", -1);
    let args = call::MakeRowIdMapArgs {
        routing: d.req("routing"),
        options: RowIdMapOptions {
            num_out_tokens: (cap >= 0).then_some(cap as usize),
            align: non_negative(d, "align")?,
            capacity: non_negative(d, "capacity")?,
        },
        row_id_map: d.req("row_id_map"),
        tokens_per_expert: d.req("tokens_per_expert"),
        expert_offsets: d.req("expert_offsets"),
    };
    // SAFETY: XLA's buffers are valid for their shapes on the call's device
    // until the call's stream work completes.
    unsafe { call::make_row_id_map(t, &args) }
}

fn run_permute(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::PermuteArgs {
        input: d.req("input"),
        row_id_map: d.req("row_id_map"),
        tokens_per_expert: d.req("tokens_per_expert"),
        expert_offsets: d.req("expert_offsets"),
        probs: d.opt("probs"),
        scales: d.opt("scales"),
        output: d.req("output"),
        permuted_probs: d.opt("permuted_probs"),
        permuted_scales: d.opt("permuted_scales"),
        in_place: false,
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::permute(t, &args) }
}

fn run_unpermute(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::UnpermuteArgs {
        input: d.req("input"),
        row_id_map: d.req("row_id_map"),
        merging_probs: d.opt("merging_probs"),
        permuted_probs: d.opt("permuted_probs"),
        output: d.req("output"),
        unpermuted_probs: d.opt("unpermuted_probs"),
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::unpermute(t, &args) }
}

fn run_unpermute_backward(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::UnpermuteBackwardArgs {
        grad: d.req("grad"),
        fwd_input: d.req("fwd_input"),
        row_id_map: d.req("row_id_map"),
        tokens_per_expert: d.req("tokens_per_expert"),
        expert_offsets: d.req("expert_offsets"),
        merging_probs: d.req("merging_probs"),
        act_grad: d.req("act_grad"),
        probs_grad: d.req("probs_grad"),
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::unpermute_backward(t, &args) }
}

fn run_make_chunk_sort_map(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::MakeChunkSortMapArgs {
        split_sizes: d.req("split_sizes"),
        sorted_indices: d.req("sorted_indices"),
        map: d.req("map"),
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::make_chunk_sort_map(t, &args) }
}

fn run_sort_chunks_by_map(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::SortChunksArgs {
        input: d.req("input"),
        map: d.req("map"),
        probs: d.opt("probs"),
        direction: if d.flag("backward") {
            Direction::Backward
        } else {
            Direction::Forward
        },
        output: d.req("output"),
        permuted_probs: d.opt("permuted_probs"),
        in_place: false,
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::sort_chunks_by_map(t, &args) }
}

const CBC: u32 = TRAIT_COMMAND_BUFFER_COMPATIBLE;

static MAKE_ROW_ID_MAP: Spec = Spec {
    name: "xcall_make_row_id_map",
    args: &[always("routing")],
    rets: &[
        always("row_id_map"),
        always("tokens_per_expert"),
        always("expert_offsets"),
    ],
    scalars: &["num_out_tokens", "align", "capacity"],
    cuda_traits: CBC,
    run: run_make_row_id_map,
};

static PERMUTE: Spec = Spec {
    name: "xcall_permute",
    args: &[
        always("input"),
        always("row_id_map"),
        always("tokens_per_expert"),
        always("expert_offsets"),
        with("probs", "has_probs"),
        with("scales", "has_scales"),
    ],
    rets: &[
        always("output"),
        with("permuted_probs", "has_probs"),
        with("permuted_scales", "has_scales"),
    ],
    scalars: &[],
    cuda_traits: CBC,
    run: run_permute,
};

static UNPERMUTE: Spec = Spec {
    name: "xcall_unpermute",
    args: &[
        always("input"),
        always("row_id_map"),
        with("merging_probs", "has_merging_probs"),
        with("permuted_probs", "has_permuted_probs"),
    ],
    rets: &[
        always("output"),
        with("unpermuted_probs", "has_permuted_probs"),
    ],
    scalars: &[],
    cuda_traits: CBC,
    run: run_unpermute,
};

static UNPERMUTE_BACKWARD: Spec = Spec {
    name: "xcall_unpermute_backward",
    args: &[
        always("grad"),
        always("fwd_input"),
        always("row_id_map"),
        always("tokens_per_expert"),
        always("expert_offsets"),
        always("merging_probs"),
    ],
    rets: &[always("act_grad"), always("probs_grad")],
    scalars: &[],
    cuda_traits: CBC,
    run: run_unpermute_backward,
};

static MAKE_CHUNK_SORT_MAP: Spec = Spec {
    name: "xcall_make_chunk_sort_map",
    args: &[always("split_sizes"), always("sorted_indices")],
    rets: &[always("map")],
    scalars: &[],
    // Outside a capture it reads the split back and waits for the stream.
    cuda_traits: 0,
    run: run_make_chunk_sort_map,
};

static SORT_CHUNKS_BY_MAP: Spec = Spec {
    name: "xcall_sort_chunks_by_map",
    args: &[always("input"), always("map"), with("probs", "has_probs")],
    rets: &[always("output"), with("permuted_probs", "has_probs")],
    scalars: &["backward"],
    cuda_traits: CBC,
    run: run_sort_chunks_by_map,
};

/// The graph cache of the XLA handlers (process-wide, sharded per device).
fn handler_cache() -> &'static xcall_graph_cache {
    static CACHE: OnceLock<xcall_graph_cache> = OnceLock::new();
    static PUBLISHED: std::sync::Once = std::sync::Once::new();
    let cache = CACHE.get_or_init(|| xcall_graph_cache {
        inner: GraphCache::new(CudaGraphs, Config::default())
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

fn invalid(message: String) -> FfiError {
    FfiError::new(Status::InvalidArgument, message)
}

/// The runtime's API table, with `Error_Create`.
fn api_of(frame: &XLA_FFI_CallFrame) -> Result<&XLA_FFI_Api, FfiError> {
    // SAFETY: NULL or the runtime's table, valid for the call.
    let api = unsafe { frame.api.as_ref() }
        .ok_or_else(|| invalid("the call frame has no XLA FFI API table".into()))?;
    if api.struct_size < API_SIZE_ERROR_CREATE || api.api_version.major_version != API_MAJOR {
        return Err(FfiError::new(
            Status::Unsupported,
            format!(
                "XLA FFI API {}.{} (table of {} bytes) is not one xcall speaks: it needs major version {API_MAJOR}",
                api.api_version.major_version, api.api_version.minor_version, api.struct_size
            ),
        ));
    }
    Ok(api)
}

/// Refuses a table too short to hold the entry ending at `needed` bytes.
fn require_entry(api: &XLA_FFI_Api, entry: &str, needed: usize) -> Result<(), FfiError> {
    if api.struct_size < needed {
        return Err(FfiError::new(
            Status::Unsupported,
            format!(
                "the runtime's XLA FFI API table ({}.{}, {} bytes) has no {entry} (needs {needed} bytes): xcall's CUDA handlers need XLA FFI API {API_MAJOR}.{API_MINOR}",
                api.api_version.major_version, api.api_version.minor_version, api.struct_size
            ),
        ));
    }
    Ok(())
}

/// An error for a failed runtime entry: the runtime's error `err` (may be
/// NULL) is read and destroyed, as its caller must.
fn runtime_failed(api: &XLA_FFI_Api, entry: &str, err: *mut XLA_FFI_Error) -> FfiError {
    let mut detail = String::new();
    if !err.is_null() && api.struct_size >= API_SIZE_ERROR_DESTROY {
        if let Some(get) = api.error_get_message {
            let mut m = XLA_FFI_Error_GetMessage_Args {
                struct_size: ERROR_GET_MESSAGE_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                error: err,
                message: std::ptr::null(),
            };
            // SAFETY: the runtime's entry on an error it returned; the
            // message lives as long as the error.
            unsafe { get(&mut m) };
            if !m.message.is_null() {
                // SAFETY: a NUL-terminated message of the live error.
                let text = unsafe { std::ffi::CStr::from_ptr(m.message) };
                detail = format!(": {}", text.to_string_lossy());
            }
        }
        if let Some(destroy) = api.error_destroy {
            let mut d = XLA_FFI_Error_Destroy_Args {
                struct_size: ERROR_DESTROY_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                error: err,
            };
            // SAFETY: destroys the error the runtime handed over, once.
            unsafe { destroy(&mut d) };
        }
    }
    FfiError::new(
        Status::InvalidState,
        format!(
            "the runtime's {entry} failed{detail} (is this handler registered for the right platform?)"
        ),
    )
}

/// The CUDA stream and device ordinal of the call, from the call frame.
fn cuda_target(frame: &XLA_FFI_CallFrame, api: &XLA_FFI_Api) -> Result<Target, FfiError> {
    require_entry(api, "Stream_Get", API_SIZE_STREAM_GET)?;
    require_entry(api, "DeviceOrdinal_Get", API_SIZE_DEVICE_ORDINAL_GET)?;
    let null = std::ptr::null_mut();
    let stream_get = api
        .stream_get
        .ok_or_else(|| runtime_failed(api, "Stream_Get", null))?;
    let ordinal_get = api
        .device_ordinal_get
        .ok_or_else(|| runtime_failed(api, "DeviceOrdinal_Get", null))?;
    let mut s = XLA_FFI_Stream_Get_Args {
        struct_size: STREAM_GET_ARGS_SIZE,
        extension_start: std::ptr::null_mut(),
        ctx: frame.ctx,
        stream: std::ptr::null_mut(),
    };
    // SAFETY: the runtime's entry with a filled argument struct.
    let err = unsafe { stream_get(&mut s) };
    if !err.is_null() || s.stream.is_null() {
        return Err(runtime_failed(api, "Stream_Get", err));
    }
    let mut o = XLA_FFI_DeviceOrdinal_Get_Args {
        struct_size: DEVICE_ORDINAL_GET_ARGS_SIZE,
        extension_start: std::ptr::null_mut(),
        ctx: frame.ctx,
        device_ordinal: -1,
    };
    // SAFETY: as above.
    let err = unsafe { ordinal_get(&mut o) };
    if !err.is_null() || o.device_ordinal < 0 {
        return Err(runtime_failed(api, "DeviceOrdinal_Get", err));
    }
    // The runtime's ordinal, checked before any work: an error names it.
    let device = Device::cuda(o.device_ordinal as u32)
        .validate()
        .map_err(|e| {
            FfiError::new(
                e.status(),
                format!(
                    "the runtime's device {}: {e}",
                    Device::cuda(o.device_ordinal as u32)
                ),
            )
        })?;
    Ok(Target::cuda(device.ordinal, s.stream))
}

fn dtype_of(code: u32) -> Option<DType> {
    Some(match code {
        dtype::PRED => DType::Bool,
        dtype::S32 => DType::I32,
        dtype::S64 => DType::I64,
        dtype::U8 => DType::U8,
        dtype::F16 => DType::F16,
        dtype::F32 => DType::F32,
        dtype::BF16 => DType::Bf16,
        dtype::F8E5M2 => DType::F8E5M2,
        dtype::F8E4M3FN => DType::F8E4M3,
        _ => return None,
    })
}

/// More attributes than any op takes (checked before anything is
/// allocated for them).
const MAX_ATTRS: i64 = 32;

/// Bytes of a call frame up to and including its `api` field: a frame
/// shorter than this cannot even name the table to report an error with.
const FRAME_SIZE_WITH_API: usize = std::mem::offset_of!(XLA_FFI_CallFrame, api) + 8;

/// Largest rank accepted (the ops use rank 1 and 2).
const MAX_RANK: i64 = 8;

/// One buffer operand or result.
fn buffer(kind: &str, name: &str, ty: u32, ptr: *mut c_void) -> Result<Tensor, FfiError> {
    if ty != BUFFER {
        return Err(invalid(format!(
            "{kind} {name} is not a buffer (type {ty})"
        )));
    }
    // SAFETY: a buffer entry points at the runtime's XLA_FFI_Buffer.
    let b = unsafe { (ptr as *const XLA_FFI_Buffer).as_ref() }
        .ok_or_else(|| invalid(format!("{kind} {name} is NULL")))?;
    if b.struct_size < BUFFER_SIZE {
        return Err(invalid(format!(
            "{kind} {name}: XLA_FFI_Buffer of {} bytes, expected at least {BUFFER_SIZE}",
            b.struct_size
        )));
    }
    let dtype = dtype_of(b.dtype).ok_or_else(|| {
        FfiError::new(
            Status::Unsupported,
            format!(
                "{kind} {name} has XLA dtype code {}, which xcall does not support",
                b.dtype
            ),
        )
    })?;
    if !(0..=MAX_RANK).contains(&b.rank) {
        return Err(invalid(format!(
            "{kind} {name} has rank {}, outside [0, {MAX_RANK}]",
            b.rank
        )));
    }
    if b.rank > 0 && b.dims.is_null() {
        return Err(invalid(format!(
            "{kind} {name} has rank {} but its dims pointer is NULL",
            b.rank
        )));
    }
    let dims: &[i64] = if b.rank == 0 {
        &[]
    } else {
        // SAFETY: `rank` dims at `dims`, per the runtime's contract.
        unsafe { std::slice::from_raw_parts(b.dims, b.rank as usize) }
    };
    if let Some(d) = dims.iter().find(|d| **d < 0) {
        return Err(invalid(format!("{kind} {name} has a negative dim {d}")));
    }
    let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    Ok(Tensor::new(b.data as u64, dtype, &dims))
}

/// The slots of `slots` the flags switch on.
fn present(slots: &'static [Slot], attrs: &[(String, i64)]) -> Vec<&'static str> {
    slots
        .iter()
        .filter(|s| {
            s.when
                .is_none_or(|f| attrs.iter().any(|(n, v)| n == f && *v != 0))
        })
        .map(|s| s.name)
        .collect()
}

/// Decodes a list of buffers against the expected names.
fn buffers(
    spec: &Spec,
    kind: &str,
    names: &[&'static str],
    size: i64,
    types: *const u32,
    ptrs: *const *mut c_void,
) -> Result<Vec<(&'static str, Tensor)>, FfiError> {
    if size != names.len() as i64 {
        return Err(invalid(format!(
            "{} takes {} {kind}s ({}) with these attributes, got {size}",
            spec.name,
            names.len(),
            names.join(", ")
        )));
    }
    if size > 0 && (types.is_null() || ptrs.is_null()) {
        return Err(invalid(format!("the {kind} list is NULL")));
    }
    names
        .iter()
        .enumerate()
        .map(|(i, &name)| {
            // SAFETY: `size` entries in both arrays, per the runtime.
            let (ty, ptr) = unsafe { (*types.add(i), *ptrs.add(i)) };
            Ok((name, buffer(kind, name, ty, ptr)?))
        })
        .collect()
}

/// An integer (or bool) scalar attribute's value.
fn scalar(name: &str, ty: u32, ptr: *mut c_void) -> Result<i64, FfiError> {
    let bad = |what: String| invalid(format!("attribute {name}: {what}"));
    if ty != ATTR_SCALAR {
        return Err(bad(format!(
            "expected an integer scalar, got attribute type {ty}"
        )));
    }
    // SAFETY: a scalar entry points at the runtime's XLA_FFI_Scalar.
    let s = unsafe { (ptr as *const XLA_FFI_Scalar).as_ref() }.ok_or_else(|| bad("NULL".into()))?;
    let (_, bytes, signed) = dtype::INTEGERS
        .iter()
        .copied()
        .find(|(code, _, _)| *code == s.dtype)
        .ok_or_else(|| {
            bad(format!(
                "expected an integer scalar, got XLA dtype code {}",
                s.dtype
            ))
        })?;
    if s.value.is_null() {
        return Err(bad("value is NULL".into()));
    }
    let mut raw = [0u8; 8];
    // SAFETY: the value holds `bytes` bytes of its dtype.
    unsafe { std::ptr::copy_nonoverlapping(s.value as *const u8, raw.as_mut_ptr(), bytes) };
    let unsigned = u64::from_le_bytes(raw);
    if signed {
        let shift = 64 - 8 * bytes as u32;
        Ok(((unsigned << shift) as i64) >> shift)
    } else {
        i64::try_from(unsigned).map_err(|_| bad(format!("{unsigned} does not fit i64")))
    }
}

/// Whether `name` is a `has_*` flag of `spec`'s signature.
fn is_slot_flag(spec: &Spec, name: &str) -> bool {
    spec.args
        .iter()
        .chain(spec.rets)
        .any(|s| s.when == Some(name))
}

/// Whether `spec` takes attribute `name`.
fn takes(spec: &Spec, name: &str) -> bool {
    spec.scalars.contains(&name) || COMMON_ATTRS.contains(&name) || is_slot_flag(spec, name)
}

/// The attributes `spec` takes, as its error message lists them.
fn attribute_names(spec: &Spec) -> Vec<&'static str> {
    let flags = spec.args.iter().chain(spec.rets).filter_map(|s| s.when);
    let mut names: Vec<&'static str> = Vec::new();
    for n in spec
        .scalars
        .iter()
        .copied()
        .chain(COMMON_ATTRS)
        .chain(flags)
    {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

fn attributes(spec: &Spec, a: &XLA_FFI_Attrs) -> Result<Vec<(String, i64)>, FfiError> {
    if a.size < 0 || (a.size > 0 && (a.types.is_null() || a.names.is_null() || a.attrs.is_null())) {
        return Err(invalid("the attribute list is malformed".into()));
    }
    // Every name must be one the op takes, once: no op takes this many.
    if a.size > MAX_ATTRS {
        return Err(invalid(format!(
            "{} attributes: {} takes at most {MAX_ATTRS} (it takes: {})",
            a.size,
            spec.name,
            attribute_names(spec).join(", ")
        )));
    }
    let mut out: Vec<(String, i64)> = Vec::with_capacity(a.size as usize);
    for i in 0..a.size as usize {
        // SAFETY: `size` entries in each array, per the runtime.
        let (ty, name, ptr) = unsafe { (*a.types.add(i), *a.names.add(i), *a.attrs.add(i)) };
        // SAFETY: a name is a byte span of the runtime.
        let name = unsafe { name.as_ref() }
            .filter(|n| !n.ptr.is_null() || n.len == 0)
            .map(|n| {
                // SAFETY: `len` bytes at `ptr`.
                let bytes = unsafe { std::slice::from_raw_parts(n.ptr as *const u8, n.len) };
                String::from_utf8_lossy(bytes).into_owned()
            })
            .ok_or_else(|| invalid(format!("attribute {i} has no name")))?;
        if !takes(spec, &name) {
            return Err(invalid(format!(
                "{} has no attribute {name:?} (it takes: {})",
                spec.name,
                attribute_names(spec).join(", ")
            )));
        }
        if out.iter().any(|(n, _)| *n == name) {
            return Err(invalid(format!("attribute {name:?} is given twice")));
        }
        let value = scalar(&name, ty, ptr)?;
        let is_flag = BOOL_ATTRS.contains(&name.as_str()) || is_slot_flag(spec, &name);
        if is_flag && !matches!(value, 0 | 1) {
            return Err(invalid(format!(
                "attribute {name} must be 0 or 1, got {value}"
            )));
        }
        out.push((name, value));
    }
    Ok(out)
}

fn decode(spec: &Spec, frame: &XLA_FFI_CallFrame) -> Result<Decoded, FfiError> {
    for (what, size, want) in [
        ("XLA_FFI_Args", frame.args.struct_size, ARGS_SIZE),
        ("XLA_FFI_Rets", frame.rets.struct_size, RETS_SIZE),
        ("XLA_FFI_Attrs", frame.attrs.struct_size, ATTRS_SIZE),
    ] {
        if size < want {
            return Err(invalid(format!(
                "{what} of {size} bytes, expected at least {want}"
            )));
        }
    }
    let attrs = attributes(spec, &frame.attrs)?;
    let args = buffers(
        spec,
        "operand",
        &present(spec.args, &attrs),
        frame.args.size,
        frame.args.types,
        frame.args.args,
    )?;
    let rets = buffers(
        spec,
        "result",
        &present(spec.rets, &attrs),
        frame.rets.size,
        frame.rets.types,
        frame.rets.rets,
    )?;
    Ok(Decoded { args, rets, attrs })
}

/// A stable id of an op for graph-cache keys (FNV-1a of its name).
fn op_id(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn attribute_digest(attrs: &[(String, i64)]) -> u64 {
    // Fixed keys: the same digest for the same attributes all process long.
    let mut h = std::hash::DefaultHasher::new();
    attrs.hash(&mut h);
    h.finish()
}

/// Runs the op on CUDA through the handlers' graph cache.
fn run_cached(spec: &Spec, target: &Target, d: &Decoded) -> Result<(), FfiError> {
    let buffers = d
        .args
        .iter()
        .map(|(_, t)| (t, BufferRole::In))
        .chain(d.rets.iter().map(|(_, t)| (t, BufferRole::Out)))
        .map(|(t, role)| Buffer::new(t.address, t.bytes(), role))
        .collect();
    let key = CallKey {
        device: target.device,
        target: op_id(spec.name),
        attributes: attribute_digest(&d.attrs),
        buffers,
    };
    let stream = CudaStreamHandle(target.stream.cast());
    // The op's own error, kept whole (status and message) rather than
    // boxed by the cache.
    let mut failure: Option<PermuteError> = None;
    let outcome = handler_cache()
        .inner
        .execute(&Call::new(key, Some(stream)), |s| {
            let t = Target {
                stream: s.map_or(target.stream, |s| s.0.cast()),
                ..*target
            };
            (spec.run)(&t, d).map_err(|e| {
                let message = e.to_string();
                failure = Some(e);
                message
            })
        });
    match (outcome, failure) {
        (Ok(_), _) => Ok(()),
        (Err(_), Some(e)) => Err(e.into()),
        (Err(e), None) => Err(FfiError::new(e.status(), e.to_string())),
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
    (spec.run)(&target, &d).map_err(FfiError::from)
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
/// (0: none), `capacity` (0: none), `graph_cache`. See
/// `xcall_make_row_id_map`.
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
/// s64. See `xcall_make_chunk_sort_map`.
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
