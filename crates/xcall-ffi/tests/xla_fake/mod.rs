//! A fake XLA runtime for the handler tests: an API table whose entries
//! record what a handler asked, and call frames built as a runtime builds
//! them. Shared by the test binaries that drive the handlers; each uses a
//! part of it.
#![allow(dead_code)]

use std::cell::Cell;
use std::ffi::{c_char, c_void, CStr};

use xcall::xla::abi::*;

/// What the fake `Error_Create` made: code and message.
pub struct FakeError {
    pub code: u32,
    pub message: String,
}

pub unsafe extern "C" fn fake_error_create(
    args: *mut XLA_FFI_Error_Create_Args,
) -> *mut XLA_FFI_Error {
    // SAFETY: the handler passes a filled struct with a NUL-terminated message.
    let args = unsafe { &*args };
    assert_eq!(args.struct_size, 28);
    // SAFETY: as above.
    let message = unsafe { CStr::from_ptr(args.message) }
        .to_string_lossy()
        .into_owned();
    Box::into_raw(Box::new(FakeError {
        code: args.errc,
        message,
    }))
    .cast()
}

thread_local! {
    /// Errors the fake destroyed on this thread.
    pub static ERRORS_DESTROYED: Cell<usize> = const { Cell::new(0) };
}

pub unsafe extern "C" fn fake_error_get_message(args: *mut XLA_FFI_Error_GetMessage_Args) {
    // SAFETY: a filled struct with an error from this file's fakes.
    let args = unsafe { &mut *args };
    assert_eq!(args.struct_size, 32);
    let e = args.error as *mut FakeError;
    // SAFETY: the error is live; the message is NUL-terminated below.
    unsafe {
        (*e).message.push('\0');
        args.message = (*e).message.as_ptr().cast();
    }
}

pub unsafe extern "C" fn fake_error_destroy(args: *mut XLA_FFI_Error_Destroy_Args) {
    // SAFETY: a filled struct with an error from this file's fakes.
    let args = unsafe { &*args };
    assert_eq!(args.struct_size, 24);
    // SAFETY: made by Box::into_raw in a fake, destroyed once.
    drop(unsafe { Box::from_raw(args.error as *mut FakeError) });
    ERRORS_DESTROYED.with(|c| c.set(c.get() + 1));
}

thread_local! {
    /// Stream_Get / DeviceOrdinal_Get calls the fakes answered on this
    /// thread (a handler asks on its caller's thread; tests run in
    /// parallel, so process-wide counters would mix them).
    pub static STREAM_GETS: Cell<usize> = const { Cell::new(0) };
    pub static ORDINAL_GETS: Cell<usize> = const { Cell::new(0) };
}

/// A Stream_Get that fails (returns an error object).
pub unsafe extern "C" fn failing_stream_get(_: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error {
    STREAM_GETS.with(|c| c.set(c.get() + 1));
    Box::into_raw(Box::new(FakeError {
        code: 12,
        message: "unimplemented".into(),
    }))
    .cast()
}

pub unsafe extern "C" fn counting_ordinal_get(
    args: *mut XLA_FFI_DeviceOrdinal_Get_Args,
) -> *mut XLA_FFI_Error {
    ORDINAL_GETS.with(|c| c.set(c.get() + 1));
    // SAFETY: a filled struct from the handler.
    unsafe { (*args).device_ordinal = 0 };
    std::ptr::null_mut()
}

pub fn fake_api(struct_size: usize) -> Box<XLA_FFI_Api> {
    // SAFETY: every field is an integer, a raw pointer or an Option of a
    // function pointer: all-zero is a valid value for each.
    let mut api: Box<XLA_FFI_Api> = Box::new(unsafe { std::mem::zeroed() });
    api.struct_size = struct_size;
    api.api_version = XLA_FFI_Api_Version {
        struct_size: API_VERSION_SIZE,
        extension_start: std::ptr::null_mut(),
        major_version: 0,
        minor_version: 3,
    };
    api.error_create = Some(fake_error_create);
    api.error_get_message = Some(fake_error_get_message);
    api.error_destroy = Some(fake_error_destroy);
    api.stream_get = Some(failing_stream_get);
    api.device_ordinal_get = Some(counting_ordinal_get);
    api
}

/// One buffer with its dims.
pub struct Buf {
    pub dims: Vec<i64>,
    pub raw: XLA_FFI_Buffer,
}

pub fn buf(dtype: u32, data: *mut c_void, dims: &[i64]) -> Box<Buf> {
    let mut b = Box::new(Buf {
        dims: dims.to_vec(),
        // SAFETY: integers and raw pointers; all-zero is valid.
        raw: unsafe { std::mem::zeroed() },
    });
    b.raw = XLA_FFI_Buffer {
        struct_size: BUFFER_SIZE,
        extension_start: std::ptr::null_mut(),
        dtype,
        data,
        rank: dims.len() as i64,
        dims: b.dims.as_mut_ptr(),
    };
    b
}

/// A call frame and everything it points at.
pub struct Frame {
    pub _api: Box<XLA_FFI_Api>,
    pub _bufs: Vec<Box<Buf>>,
    pub _types: Vec<Vec<u32>>,
    pub _ptrs: Vec<Vec<*mut c_void>>,
    pub _names: Vec<Box<XLA_FFI_ByteSpan>>,
    pub _name_ptrs: Vec<*mut XLA_FFI_ByteSpan>,
    pub _scalars: Vec<Box<(XLA_FFI_Scalar, i64)>>,
    pub frame: Box<XLA_FFI_CallFrame>,
}

pub const NAMES: &[&str] = &[
    "align",
    "backward",
    "capacity",
    "capacityy",
    "graph_cache",
    "group",
    "has_probs",
    "has_scales",
    "num_out_tokens",
    "zero_unused",
];

/// Attribute value types the frames carry.
pub enum Attr {
    I64(i64),
    Pred(bool),
    F32(f32),
}

pub fn frame(
    api: Box<XLA_FFI_Api>,
    args: Vec<Box<Buf>>,
    rets: Vec<Box<Buf>>,
    attrs: &[(&str, Attr)],
) -> Frame {
    let mut attrs: Vec<&(&str, Attr)> = attrs.iter().collect();
    attrs.sort_by_key(|(n, _)| *n); // XLA sorts attributes by name
    let mut names: Vec<Box<XLA_FFI_ByteSpan>> = attrs
        .iter()
        .map(|(n, _)| {
            let name = NAMES.iter().find(|k| *k == n).expect("name in NAMES");
            Box::new(XLA_FFI_ByteSpan {
                ptr: name.as_ptr() as *const c_char,
                len: name.len(),
            })
        })
        .collect();
    let mut scalars: Vec<Box<(XLA_FFI_Scalar, i64)>> = attrs
        .iter()
        .map(|(_, v)| {
            let (dtype, bits) = match v {
                Attr::I64(v) => (5, *v),
                Attr::Pred(b) => (1, *b as i64),
                Attr::F32(f) => (11, f.to_bits() as i64),
            };
            let mut s = Box::new((
                XLA_FFI_Scalar {
                    dtype,
                    value: std::ptr::null_mut(),
                },
                bits,
            ));
            s.0.value = (&mut s.1 as *mut i64).cast();
            s
        })
        .collect();
    let name_ptrs: Vec<*mut XLA_FFI_ByteSpan> =
        names.iter_mut().map(|n| &mut **n as *mut _).collect();
    let mut attr_types = vec![ATTR_SCALAR; attrs.len()];
    let mut attr_ptrs: Vec<*mut c_void> = scalars
        .iter_mut()
        .map(|s| (&mut s.0 as *mut XLA_FFI_Scalar).cast())
        .collect();
    let mut bufs = Vec::new();
    let mut arg_ptrs: Vec<*mut c_void> = Vec::new();
    let mut ret_ptrs: Vec<*mut c_void> = Vec::new();
    let (n_args, n_rets) = (args.len(), rets.len());
    for (b, list) in args
        .into_iter()
        .map(|b| (b, 0))
        .chain(rets.into_iter().map(|b| (b, 1)))
    {
        let mut b = b;
        let p = (&mut b.raw as *mut XLA_FFI_Buffer).cast();
        if list == 0 {
            arg_ptrs.push(p)
        } else {
            ret_ptrs.push(p)
        }
        bufs.push(b);
    }
    let mut arg_types = vec![BUFFER; n_args];
    let mut ret_types = vec![BUFFER; n_rets];
    let mut name_ptrs = name_ptrs;
    let frame = Box::new(XLA_FFI_CallFrame {
        struct_size: CALL_FRAME_SIZE,
        extension_start: std::ptr::null_mut(),
        api: &*api,
        ctx: std::ptr::null_mut(),
        stage: STAGE_EXECUTE,
        args: XLA_FFI_Args {
            struct_size: ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            size: n_args as i64,
            types: arg_types.as_mut_ptr(),
            args: arg_ptrs.as_mut_ptr(),
        },
        rets: XLA_FFI_Rets {
            struct_size: RETS_SIZE,
            extension_start: std::ptr::null_mut(),
            size: n_rets as i64,
            types: ret_types.as_mut_ptr(),
            rets: ret_ptrs.as_mut_ptr(),
        },
        attrs: XLA_FFI_Attrs {
            struct_size: ATTRS_SIZE,
            extension_start: std::ptr::null_mut(),
            size: attrs.len() as i64,
            types: attr_types.as_mut_ptr(),
            names: name_ptrs.as_mut_ptr(),
            attrs: attr_ptrs.as_mut_ptr(),
        },
        future: std::ptr::null_mut(),
    });
    Frame {
        _api: api,
        _bufs: bufs,
        _types: vec![arg_types, ret_types, attr_types],
        _ptrs: vec![arg_ptrs, ret_ptrs, attr_ptrs],
        _names: names,
        _name_ptrs: name_ptrs,
        _scalars: scalars,
        frame,
    }
}

pub type Handler = extern "C" fn(*mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error;

/// Runs a handler; `Err((code, message))` when it returned an error.
pub fn call(h: Handler, f: &mut Frame) -> Result<(), (u32, String)> {
    let e = h(&mut *f.frame);
    if e.is_null() {
        return Ok(());
    }
    // SAFETY: errors come from fake_error_create.
    let e = unsafe { Box::from_raw(e as *mut FakeError) };
    Err((e.code, e.message))
}

pub fn ptr<T>(v: &mut [T]) -> *mut c_void {
    v.as_mut_ptr().cast()
}

/// Routing of 3 tokens over 2 experts: t0 -> {0, 1}, t1 -> {1}, t2 -> {0}.
pub const ROUTING: [u8; 6] = [1, 1, 0, 1, 1, 0];

/// The buffers of a make_row_id_map call over [`ROUTING`]: routing [3, 2],
/// row_id_map [3, 5], tokens_per_expert [2], expert_offsets [3].
pub struct MapBufs {
    pub routing: [u8; 6],
    pub map: [i32; 15],
    pub tpe: [i64; 2],
    pub off: [i64; 3],
}

impl MapBufs {
    /// Routing [`ROUTING`], every output element `fill`.
    pub fn new(fill: i32) -> Box<MapBufs> {
        Box::new(MapBufs {
            routing: ROUTING,
            map: [fill; 15],
            tpe: [fill as i64; 2],
            off: [fill as i64; 3],
        })
    }

    /// row_id_map, tokens_per_expert and expert_offsets as XLA buffers
    /// (results of make_row_id_map, operands of permute).
    pub fn maps(&mut self) -> Vec<Box<Buf>> {
        vec![
            buf(dtype::S32, ptr(&mut self.map), &[3, 5]),
            buf(dtype::S64, ptr(&mut self.tpe), &[2]),
            buf(dtype::S64, ptr(&mut self.off), &[3]),
        ]
    }

    /// A make_row_id_map frame with the routing as `routing_dtype`.
    pub fn frame(&mut self, routing_dtype: u32, attrs: &[(&str, Attr)]) -> Frame {
        let routing = buf(routing_dtype, ptr(&mut self.routing), &[3, 2]);
        let maps = self.maps();
        frame(
            fake_api(API_SIZE_DEVICE_ORDINAL_GET),
            vec![routing],
            maps,
            attrs,
        )
    }
}
