//! The parts of the XLA FFI C ABI (`xla/ffi/api/c_api.h`, API 0.3) that
//! xcall's handlers use, mirrored field for field.
//!
//! Every struct crosses the boundary with its `struct_size`: XLA's size of
//! a struct is `offsetof(last field) + sizeof(last field)`, which
//! [`struct_size!`] computes the same way. A reader checks the size the
//! other side wrote before touching a field past the common prefix, so an
//! older runtime's shorter table is refused with a message instead of read
//! past its end. The layout is pinned below with `static_assertions` (x86-64
//! and aarch64 Linux, LP64) and checked against the installed jaxlib's
//! `c_api.h` by `tests/xla_layout.rs` when one is available.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_void};
use std::marker::{PhantomData, PhantomPinned};
use std::mem::{offset_of, size_of};

use static_assertions::const_assert_eq;

/// API version of the header this mirror follows.
pub const API_MAJOR: i32 = 0;
/// See [`API_MAJOR`].
pub const API_MINOR: i32 = 3;

/// `XLA_FFI_Extension_Metadata`.
pub const EXTENSION_METADATA: u32 = 1;
/// `XLA_FFI_ExecutionStage_EXECUTE`.
pub const STAGE_EXECUTE: u32 = 3;
/// `XLA_FFI_ArgType_BUFFER` (and `XLA_FFI_RetType_BUFFER`).
pub const BUFFER: u32 = 1;
/// `XLA_FFI_AttrType_SCALAR`.
pub const ATTR_SCALAR: u32 = 3;
/// `XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE`.
pub const TRAIT_COMMAND_BUFFER_COMPATIBLE: u32 = 1;

/// `XLA_FFI_Error_Code` values xcall reports.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    /// `UNKNOWN`.
    Unknown = 2,
    /// `INVALID_ARGUMENT`.
    InvalidArgument = 3,
    /// `DEADLINE_EXCEEDED`.
    DeadlineExceeded = 4,
    /// `RESOURCE_EXHAUSTED`.
    ResourceExhausted = 8,
    /// `FAILED_PRECONDITION`.
    FailedPrecondition = 9,
    /// `UNIMPLEMENTED`.
    Unimplemented = 12,
    /// `INTERNAL`.
    Internal = 13,
    /// `UNAVAILABLE`.
    Unavailable = 14,
}

/// `XLA_FFI_DataType` codes xcall maps to its dtypes.
pub mod dtype {
    /// `PRED`.
    pub const PRED: u32 = 1;
    /// `S32`.
    pub const S32: u32 = 4;
    /// `S64`.
    pub const S64: u32 = 5;
    /// `U8`.
    pub const U8: u32 = 6;
    /// `F16`.
    pub const F16: u32 = 10;
    /// `F32`.
    pub const F32: u32 = 11;
    /// `BF16`.
    pub const BF16: u32 = 16;
    /// `F8E5M2`.
    pub const F8E5M2: u32 = 19;
    /// `F8E4M3FN`.
    pub const F8E4M3FN: u32 = 20;
    /// Integer scalar types an attribute may carry: (code, bytes, signed).
    pub const INTEGERS: [(u32, usize, bool); 9] = [
        (PRED, 1, false),
        (2, 1, true),
        (3, 2, true),
        (S32, 4, true),
        (S64, 8, true),
        (U8, 1, false),
        (7, 2, false),
        (8, 4, false),
        (9, 8, false),
    ];
}

/// XLA's struct size: offset of `$field` plus its size.
macro_rules! struct_size {
    ($ty:ty, $field:ident, $field_ty:ty) => {
        std::mem::offset_of!($ty, $field) + std::mem::size_of::<$field_ty>()
    };
}

/// An opaque type of the runtime.
#[repr(C)]
pub struct Opaque {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

/// `XLA_FFI_Error` (opaque; created by the runtime's `Error_Create`).
pub type XLA_FFI_Error = Opaque;
/// `XLA_FFI_ExecutionContext` (opaque).
pub type XLA_FFI_ExecutionContext = Opaque;

/// `XLA_FFI_Extension_Base`.
#[repr(C)]
pub struct XLA_FFI_Extension_Base {
    /// Size of the whole extension struct.
    pub struct_size: usize,
    /// `XLA_FFI_Extension_Type`.
    pub kind: u32,
    /// Next extension of the chain, or NULL.
    pub next: *mut XLA_FFI_Extension_Base,
}

/// `XLA_FFI_Api_Version`.
#[repr(C)]
pub struct XLA_FFI_Api_Version {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Extensions (NULL).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// API major version (a change breaks the layout).
    pub major_version: i32,
    /// API minor version (adds fields at the end).
    pub minor_version: i32,
}

/// `XLA_FFI_Error_Create_Args`.
#[repr(C)]
pub struct XLA_FFI_Error_Create_Args {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Extensions (NULL).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// NUL-terminated message; the runtime copies it.
    pub message: *const c_char,
    /// `XLA_FFI_Error_Code`.
    pub errc: u32,
}

/// `XLA_FFI_Error_GetMessage_Args`.
#[repr(C)]
pub struct XLA_FFI_Error_GetMessage_Args {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Extensions (NULL).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The error to read.
    pub error: *mut XLA_FFI_Error,
    /// Out: its NUL-terminated message, owned by the error.
    pub message: *const c_char,
}

/// `XLA_FFI_Error_Destroy_Args`.
#[repr(C)]
pub struct XLA_FFI_Error_Destroy_Args {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Extensions (NULL).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The error to destroy.
    pub error: *mut XLA_FFI_Error,
}

/// An API entry that returns nothing.
pub type ApiVoidFn<A> = Option<unsafe extern "C" fn(*mut A)>;

/// `XLA_FFI_Stream_Get_Args`.
#[repr(C)]
pub struct XLA_FFI_Stream_Get_Args {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Extensions (NULL).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's execution context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Out: the platform stream (`CUstream` on CUDA).
    pub stream: *mut c_void,
}

/// `XLA_FFI_DeviceOrdinal_Get_Args`.
#[repr(C)]
pub struct XLA_FFI_DeviceOrdinal_Get_Args {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Extensions (NULL).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The call's execution context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Out: the device ordinal.
    pub device_ordinal: i32,
}

/// `XLA_FFI_Buffer`.
#[repr(C)]
pub struct XLA_FFI_Buffer {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Optional extensions, a linked list (NULL when none).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// `XLA_FFI_DataType`.
    pub dtype: u32,
    /// First element (device memory on CUDA).
    pub data: *mut c_void,
    /// Number of dimensions.
    pub rank: i64,
    /// `rank` dimensions, outermost first.
    pub dims: *mut i64,
}

/// `XLA_FFI_Args`.
#[repr(C)]
pub struct XLA_FFI_Args {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Optional extensions, a linked list (NULL when none).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// Number of arguments.
    pub size: i64,
    /// `XLA_FFI_ArgType` of each.
    pub types: *mut u32,
    /// Each argument (an `XLA_FFI_Buffer*` for buffers).
    pub args: *mut *mut c_void,
}

/// `XLA_FFI_Rets`.
#[repr(C)]
pub struct XLA_FFI_Rets {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Optional extensions, a linked list (NULL when none).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// Number of results.
    pub size: i64,
    /// `XLA_FFI_RetType` of each.
    pub types: *mut u32,
    /// Each result (an `XLA_FFI_Buffer*` for buffers).
    pub rets: *mut *mut c_void,
}

/// `XLA_FFI_ByteSpan`.
#[repr(C)]
pub struct XLA_FFI_ByteSpan {
    /// First byte (not NUL-terminated).
    pub ptr: *const c_char,
    /// Length in bytes.
    pub len: usize,
}

/// `XLA_FFI_Scalar`.
#[repr(C)]
pub struct XLA_FFI_Scalar {
    /// `XLA_FFI_DataType`.
    pub dtype: u32,
    /// The value.
    pub value: *mut c_void,
}

/// `XLA_FFI_Attrs` (sorted by name).
#[repr(C)]
pub struct XLA_FFI_Attrs {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Optional extensions, a linked list (NULL when none).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// Number of attributes.
    pub size: i64,
    /// `XLA_FFI_AttrType` of each.
    pub types: *mut u32,
    /// Name of each.
    pub names: *mut *mut XLA_FFI_ByteSpan,
    /// Each attribute (an `XLA_FFI_Scalar*` for scalars).
    pub attrs: *mut *mut c_void,
}

/// `XLA_FFI_CallFrame`.
#[repr(C)]
pub struct XLA_FFI_CallFrame {
    /// `sizeof` the struct as its filler built it: fields past it are absent.
    pub struct_size: usize,
    /// Extensions (the metadata query puts its extension here).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The runtime's API table (NULL in the metadata query).
    pub api: *const XLA_FFI_Api,
    /// The call's execution context.
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// `XLA_FFI_ExecutionStage`.
    pub stage: u32,
    /// The call's input buffers.
    pub args: XLA_FFI_Args,
    /// The call's output buffers.
    pub rets: XLA_FFI_Rets,
    /// The call's named attributes.
    pub attrs: XLA_FFI_Attrs,
    /// Out: a future for asynchronous handlers (xcall leaves it NULL).
    pub future: *mut c_void,
}

/// `XLA_FFI_Metadata`.
#[repr(C)]
pub struct XLA_FFI_Metadata {
    /// Struct size (the runtime's).
    pub struct_size: usize,
    /// Out: the API version the handler was built against.
    pub api_version: XLA_FFI_Api_Version,
    /// Out: `XLA_FFI_Handler_Traits` bits.
    pub traits: u32,
    /// Out (API 0.3): the state type id, 0 for stateless handlers.
    pub state_type_id: i64,
}

/// `XLA_FFI_Metadata_Extension`.
#[repr(C)]
pub struct XLA_FFI_Metadata_Extension {
    /// Extension header (`kind` = [`EXTENSION_METADATA`]).
    pub extension_base: XLA_FFI_Extension_Base,
    /// Where the handler writes its metadata.
    pub metadata: *mut XLA_FFI_Metadata,
}

/// An API entry xcall calls: takes its argument struct, returns an error
/// or NULL.
pub type ApiFn<A> = Option<unsafe extern "C" fn(*mut A) -> *mut XLA_FFI_Error>;
/// An API entry xcall never calls.
pub type Unused = *const c_void;

/// `XLA_FFI_Api`, the runtime's function table.
#[repr(C)]
pub struct XLA_FFI_Api {
    /// Struct size: which entries this runtime has.
    pub struct_size: usize,
    /// Optional extensions, a linked list (NULL when none).
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// The runtime's API version.
    pub api_version: XLA_FFI_Api_Version,
    /// Internal API (not used).
    pub internal_api: Unused,
    /// `XLA_FFI_Error_Create`.
    pub error_create: ApiFn<XLA_FFI_Error_Create_Args>,
    /// `XLA_FFI_Error_GetMessage`.
    pub error_get_message: ApiVoidFn<XLA_FFI_Error_GetMessage_Args>,
    /// `XLA_FFI_Error_Destroy`.
    pub error_destroy: ApiVoidFn<XLA_FFI_Error_Destroy_Args>,
    /// `XLA_FFI_Handler_Register`.
    pub handler_register: Unused,
    /// `XLA_FFI_Stream_Get`.
    pub stream_get: ApiFn<XLA_FFI_Stream_Get_Args>,
    /// `XLA_FFI_Type_Register`.
    pub type_register: Unused,
    /// `XLA_FFI_ExecutionContext_Get`.
    pub execution_context_get: Unused,
    /// `XLA_FFI_State_Set`.
    pub state_set: Unused,
    /// `XLA_FFI_State_Get`.
    pub state_get: Unused,
    /// `XLA_FFI_DeviceMemory_Allocate`.
    pub device_memory_allocate: Unused,
    /// `XLA_FFI_DeviceMemory_Free`.
    pub device_memory_free: Unused,
    /// `XLA_FFI_ThreadPool_Schedule`.
    pub thread_pool_schedule: Unused,
    /// `XLA_FFI_ThreadPool_NumThreads`.
    pub thread_pool_num_threads: Unused,
    /// `XLA_FFI_Future_Create`.
    pub future_create: Unused,
    /// `XLA_FFI_Future_SetAvailable`.
    pub future_set_available: Unused,
    /// `XLA_FFI_Future_SetError`.
    pub future_set_error: Unused,
    /// `XLA_FFI_RunId_Get`.
    pub run_id_get: Unused,
    /// `XLA_FFI_DeviceOrdinal_Get`.
    pub device_ordinal_get: ApiFn<XLA_FFI_DeviceOrdinal_Get_Args>,
}

/// `XLA_FFI_Api_Version_STRUCT_SIZE`.
pub const API_VERSION_SIZE: usize = struct_size!(XLA_FFI_Api_Version, minor_version, i32);
/// `XLA_FFI_Error_Create_Args_STRUCT_SIZE`.
pub const ERROR_CREATE_ARGS_SIZE: usize = struct_size!(XLA_FFI_Error_Create_Args, errc, u32);
/// `XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE`.
pub const ERROR_GET_MESSAGE_ARGS_SIZE: usize =
    struct_size!(XLA_FFI_Error_GetMessage_Args, message, *const c_char);
/// `XLA_FFI_Error_Destroy_Args_STRUCT_SIZE`.
pub const ERROR_DESTROY_ARGS_SIZE: usize =
    struct_size!(XLA_FFI_Error_Destroy_Args, error, *mut XLA_FFI_Error);
/// API table size that includes `Error_Destroy`.
pub const API_SIZE_ERROR_DESTROY: usize = struct_size!(
    XLA_FFI_Api,
    error_destroy,
    ApiVoidFn<XLA_FFI_Error_Destroy_Args>
);
/// `XLA_FFI_Stream_Get_Args_STRUCT_SIZE`.
pub const STREAM_GET_ARGS_SIZE: usize = struct_size!(XLA_FFI_Stream_Get_Args, stream, *mut c_void);
/// `XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE`.
pub const DEVICE_ORDINAL_GET_ARGS_SIZE: usize =
    struct_size!(XLA_FFI_DeviceOrdinal_Get_Args, device_ordinal, i32);
/// `XLA_FFI_Buffer_STRUCT_SIZE`.
pub const BUFFER_SIZE: usize = struct_size!(XLA_FFI_Buffer, dims, *mut i64);
/// `XLA_FFI_Args_STRUCT_SIZE`.
pub const ARGS_SIZE: usize = struct_size!(XLA_FFI_Args, args, *mut *mut c_void);
/// `XLA_FFI_Rets_STRUCT_SIZE`.
pub const RETS_SIZE: usize = struct_size!(XLA_FFI_Rets, rets, *mut *mut c_void);
/// `XLA_FFI_Attrs_STRUCT_SIZE`.
pub const ATTRS_SIZE: usize = struct_size!(XLA_FFI_Attrs, attrs, *mut *mut c_void);
/// `XLA_FFI_CallFrame_STRUCT_SIZE` (XLA counts through `attrs`).
pub const CALL_FRAME_SIZE: usize = struct_size!(XLA_FFI_CallFrame, attrs, XLA_FFI_Attrs);
/// `XLA_FFI_Metadata_STRUCT_SIZE` (XLA counts through `traits`).
pub const METADATA_SIZE: usize = struct_size!(XLA_FFI_Metadata, traits, u32);
/// Metadata size that includes `state_type_id` (API 0.3).
pub const METADATA_WITH_STATE_SIZE: usize = struct_size!(XLA_FFI_Metadata, state_type_id, i64);
/// `XLA_FFI_Metadata_Extension_STRUCT_SIZE`.
pub const METADATA_EXTENSION_SIZE: usize =
    struct_size!(XLA_FFI_Metadata_Extension, metadata, *mut XLA_FFI_Metadata);
/// API table size that includes `Error_Create`.
pub const API_SIZE_ERROR_CREATE: usize =
    struct_size!(XLA_FFI_Api, error_create, ApiFn<XLA_FFI_Error_Create_Args>);
/// API table size that includes `Stream_Get`.
pub const API_SIZE_STREAM_GET: usize =
    struct_size!(XLA_FFI_Api, stream_get, ApiFn<XLA_FFI_Stream_Get_Args>);
/// API table size that includes `DeviceOrdinal_Get` (`XLA_FFI_Api_STRUCT_SIZE`
/// of API 0.3).
pub const API_SIZE_DEVICE_ORDINAL_GET: usize = struct_size!(
    XLA_FFI_Api,
    device_ordinal_get,
    ApiFn<XLA_FFI_DeviceOrdinal_Get_Args>
);

// The layout of c_api.h (API 0.3) on LP64 targets, field by field.
const_assert_eq!(size_of::<usize>(), 8);
const_assert_eq!(offset_of!(XLA_FFI_Extension_Base, kind), 8);
const_assert_eq!(offset_of!(XLA_FFI_Extension_Base, next), 16);
const_assert_eq!(size_of::<XLA_FFI_Extension_Base>(), 24);
const_assert_eq!(offset_of!(XLA_FFI_Api_Version, major_version), 16);
const_assert_eq!(API_VERSION_SIZE, 24);
const_assert_eq!(offset_of!(XLA_FFI_Error_Create_Args, message), 16);
const_assert_eq!(ERROR_CREATE_ARGS_SIZE, 28);
const_assert_eq!(ERROR_GET_MESSAGE_ARGS_SIZE, 32);
const_assert_eq!(ERROR_DESTROY_ARGS_SIZE, 24);
const_assert_eq!(offset_of!(XLA_FFI_Api, error_get_message), 56);
const_assert_eq!(API_SIZE_ERROR_DESTROY, 72);
const_assert_eq!(offset_of!(XLA_FFI_Stream_Get_Args, ctx), 16);
const_assert_eq!(STREAM_GET_ARGS_SIZE, 32);
const_assert_eq!(offset_of!(XLA_FFI_DeviceOrdinal_Get_Args, ctx), 16);
const_assert_eq!(DEVICE_ORDINAL_GET_ARGS_SIZE, 28);
const_assert_eq!(offset_of!(XLA_FFI_Buffer, dtype), 16);
const_assert_eq!(offset_of!(XLA_FFI_Buffer, data), 24);
const_assert_eq!(offset_of!(XLA_FFI_Buffer, rank), 32);
const_assert_eq!(BUFFER_SIZE, 48);
const_assert_eq!(offset_of!(XLA_FFI_Args, size), 16);
const_assert_eq!(offset_of!(XLA_FFI_Args, types), 24);
const_assert_eq!(ARGS_SIZE, 40);
const_assert_eq!(RETS_SIZE, 40);
const_assert_eq!(offset_of!(XLA_FFI_Attrs, names), 32);
const_assert_eq!(ATTRS_SIZE, 48);
const_assert_eq!(size_of::<XLA_FFI_ByteSpan>(), 16);
const_assert_eq!(offset_of!(XLA_FFI_Scalar, value), 8);
const_assert_eq!(offset_of!(XLA_FFI_CallFrame, api), 16);
const_assert_eq!(offset_of!(XLA_FFI_CallFrame, ctx), 24);
const_assert_eq!(offset_of!(XLA_FFI_CallFrame, stage), 32);
const_assert_eq!(offset_of!(XLA_FFI_CallFrame, args), 40);
const_assert_eq!(offset_of!(XLA_FFI_CallFrame, rets), 80);
const_assert_eq!(offset_of!(XLA_FFI_CallFrame, attrs), 120);
const_assert_eq!(CALL_FRAME_SIZE, 168);
const_assert_eq!(offset_of!(XLA_FFI_CallFrame, future), 168);
const_assert_eq!(offset_of!(XLA_FFI_Metadata, api_version), 8);
const_assert_eq!(offset_of!(XLA_FFI_Metadata, traits), 32);
const_assert_eq!(METADATA_SIZE, 36);
const_assert_eq!(METADATA_WITH_STATE_SIZE, 48);
const_assert_eq!(METADATA_EXTENSION_SIZE, 32);
const_assert_eq!(offset_of!(XLA_FFI_Api, api_version), 16);
const_assert_eq!(offset_of!(XLA_FFI_Api, error_create), 48);
const_assert_eq!(offset_of!(XLA_FFI_Api, stream_get), 80);
const_assert_eq!(offset_of!(XLA_FFI_Api, device_ordinal_get), 184);
const_assert_eq!(API_SIZE_DEVICE_ORDINAL_GET, 192);
