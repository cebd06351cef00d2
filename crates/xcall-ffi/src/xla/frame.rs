//! Reading an XLA FFI call frame: the API table, the CUDA target, buffers,
//! scalars and attributes, each checked before use.

use super::*;

pub(super) fn invalid(message: String) -> FfiError {
    FfiError::new(Status::InvalidArgument, message)
}

/// The runtime's API table, with `Error_Create`.
pub(super) fn api_of(frame: &XLA_FFI_CallFrame) -> Result<&XLA_FFI_Api, FfiError> {
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
pub(super) fn require_entry(api: &XLA_FFI_Api, entry: &str, needed: usize) -> Result<(), FfiError> {
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
pub(super) fn runtime_failed(api: &XLA_FFI_Api, entry: &str, err: *mut XLA_FFI_Error) -> FfiError {
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
pub(super) fn cuda_target(
    frame: &XLA_FFI_CallFrame,
    api: &XLA_FFI_Api,
) -> Result<Target, FfiError> {
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

pub(super) fn dtype_of(code: u32) -> Option<DType> {
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
pub(super) const MAX_ATTRS: i64 = 32;

/// Bytes of a call frame up to and including its `api` field: a frame
/// shorter than this cannot even name the table to report an error with.
pub(super) const FRAME_SIZE_WITH_API: usize = std::mem::offset_of!(XLA_FFI_CallFrame, api) + 8;

/// Largest rank accepted (the ops use rank 1 and 2).
pub(super) const MAX_RANK: i64 = 8;

/// One buffer operand or result.
pub(super) fn buffer(
    kind: &str,
    name: &str,
    ty: u32,
    ptr: *mut c_void,
) -> Result<Tensor, FfiError> {
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
    if let Some(scalars) = int32_pairs(name, dtype, &dims) {
        return Ok(Tensor::new(b.data as u64, DType::I64, scalars));
    }
    Ok(Tensor::new(b.data as u64, dtype, &dims))
}

/// The operands and results that hold 64-bit integers (chunk sizes,
/// offsets, chunk-sort maps).
pub(super) const INT64_SLOTS: [&str; 5] = [
    "tokens_per_expert",
    "expert_offsets",
    "split_sizes",
    "sorted_indices",
    "map",
];

/// The dims of the s64 tensor an s32 buffer `[..., 2]` in a 64-bit slot
/// stands for: each pair is one value, low word first (a runtime without
/// 64-bit types, such as JAX without `jax_enable_x64`, passes them so).
/// `None` for any other buffer. Little-endian targets only.
pub(super) fn int32_pairs<'d>(name: &str, dtype: DType, dims: &'d [u64]) -> Option<&'d [u64]> {
    let (&last, scalars) = dims.split_last()?;
    (cfg!(target_endian = "little")
        && dtype == DType::I32
        && last == 2
        && INT64_SLOTS.contains(&name))
    .then_some(scalars)
}

/// The slots of `slots` the flags switch on.
pub(super) fn present(slots: &'static [Slot], attrs: &[(String, i64)]) -> Vec<&'static str> {
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
pub(super) fn buffers(
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
pub(super) fn scalar(name: &str, ty: u32, ptr: *mut c_void) -> Result<i64, FfiError> {
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
pub(super) fn is_slot_flag(spec: &Spec, name: &str) -> bool {
    spec.args
        .iter()
        .chain(spec.rets)
        .any(|s| s.when == Some(name))
}

/// Whether `spec` takes attribute `name`.
pub(super) fn takes(spec: &Spec, name: &str) -> bool {
    spec.scalars.contains(&name) || COMMON_ATTRS.contains(&name) || is_slot_flag(spec, name)
}

/// The attributes `spec` takes, as its error message lists them.
pub(super) fn attribute_names(spec: &Spec) -> Vec<&'static str> {
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

pub(super) fn attributes(spec: &Spec, a: &XLA_FFI_Attrs) -> Result<Vec<(String, i64)>, FfiError> {
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

pub(super) fn decode(spec: &Spec, frame: &XLA_FFI_CallFrame) -> Result<Decoded, FfiError> {
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
