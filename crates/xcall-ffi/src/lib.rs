//! The C ABI of xcall. This crate is the only one with `extern "C"`; it is a
//! thin translation layer over the capability crates and builds
//! `libxcall.a` and `libxcall.so`. The header `include/xcall.h` is generated
//! from it by cbindgen.
//!
//! Conventions of every entry point (see the header for the C view):
//! - fallible functions return `xcall_status` (0 = `XCALL_STATUS_OK`);
//! - pointer arguments are checked for NULL (`XCALL_STATUS_NULL_ARGUMENT`);
//! - outputs come last and are written only on success;
//! - panics are caught and returned as `XCALL_STATUS_PANIC`;
//! - `xcall_last_error_message()` gives the calling thread's detail.

// The exported names follow C conventions (xcall_status), not Rust's.
#![allow(non_camel_case_types)]
// C entry points take raw pointers by design: every one is checked for NULL
// and its contract is documented in the header.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod ep;
mod graph;
mod guard;
mod handle;
mod log;
mod op_args;
mod permute;
mod shmem;
mod target;
mod warpspec;
pub mod xla;

pub use ep::*;
pub use graph::*;
pub use guard::{DTypeCode, PlatformCode};
pub use log::*;
pub use op_args::{xcall_tensor, XCALL_TENSOR_MAX_RANK};
pub use permute::*;
pub use shmem::*;
pub use target::xcall_target;
pub use warpspec::*;
pub use xla::{
    xcall_xla_ep_check, xcall_xla_ep_close, xcall_xla_ep_combine_backward_cuda,
    xcall_xla_ep_combine_backward_host, xcall_xla_ep_combine_cuda, xcall_xla_ep_combine_host,
    xcall_xla_ep_dispatch_backward_cuda, xcall_xla_ep_dispatch_backward_host,
    xcall_xla_ep_dispatch_cuda, xcall_xla_ep_dispatch_host, xcall_xla_ep_dropped_routes,
    xcall_xla_ep_open, xcall_xla_ep_open_ranks, xcall_xla_graph_cache,
    xcall_xla_make_chunk_sort_map_cuda, xcall_xla_make_chunk_sort_map_host,
    xcall_xla_make_row_id_map_cuda, xcall_xla_make_row_id_map_host, xcall_xla_permute_cuda,
    xcall_xla_permute_host, xcall_xla_sort_chunks_by_map_cuda, xcall_xla_sort_chunks_by_map_host,
    xcall_xla_unpermute_backward_cuda, xcall_xla_unpermute_backward_host, xcall_xla_unpermute_cuda,
    xcall_xla_unpermute_host, xcall_xla_unreportable_error,
};

use std::ffi::c_char;

use guard::{ffi_call, out_ptr};
use static_assertions::{assert_eq_align, assert_eq_size};
use xcall_core::{DType, Status};

// The header declares these enums as uint32_t typedefs.
assert_eq_size!(Status, u32);
assert_eq_align!(Status, u32);
assert_eq_size!(xcall_core::Platform, u32);
assert_eq_align!(xcall_core::Platform, u32);
assert_eq_size!(DType, u32);
assert_eq_align!(DType, u32);

/// The version of the linked library, for example "0.1.0". Compare with
/// `XCALL_VERSION_STRING` to detect a header/library mismatch. The string is
/// static.
///
/// Bad input: none (no arguments).
#[no_mangle]
pub extern "C" fn xcall_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The name of a status code, for example "XCALL_STATUS_NULL_ARGUMENT", or
/// "XCALL_STATUS_UNKNOWN" for a code this library does not define. The
/// string is static; never NULL.
///
/// `status` is an `xcall_status` value.
///
/// Bad input: any code is accepted; one this library does not define gets
/// "XCALL_STATUS_UNKNOWN".
#[no_mangle]
pub extern "C" fn xcall_status_name(status: u32) -> *const c_char {
    match Status::from_code(status) {
        Some(s) => s.c_name().as_ptr(),
        None => c"XCALL_STATUS_UNKNOWN".as_ptr(),
    }
}

/// Detail of the most recent xcall call on the calling thread: empty ("")
/// when it succeeded, otherwise a message that says what was wrong. Never
/// NULL. The pointer stays valid until the next xcall call on this thread;
/// copy the text to keep it.
///
/// Bad input: none (no arguments).
#[no_mangle]
pub extern "C" fn xcall_last_error_message() -> *const c_char {
    guard::last_error_ptr()
}

/// Number of devices of `platform` (an `xcall_platform` value) in
/// `*out_count`: 1 for `XCALL_PLATFORM_HOST`; the CUDA driver's count for
/// `XCALL_PLATFORM_CUDA`.
///
/// Errors: `XCALL_STATUS_NULL_ARGUMENT` (out_count), `XCALL_STATUS_INVALID_ARGUMENT`
/// (unknown platform), `XCALL_STATUS_CUDA_UNAVAILABLE` (no driver or no device;
/// the message says which). Asking for Host never loads the CUDA driver.
/// Thread-safe.
///
/// Bad input: as listed under Errors; `*out_count` is written only on
/// success.
#[no_mangle]
pub extern "C" fn xcall_device_count(platform: PlatformCode, out_count: *mut usize) -> Status {
    ffi_call!({
        let out = out_ptr(out_count, "out_count")?;
        let count = platform.get()?.device_count()?;
        *out = count;
        Ok(())
    })
}

/// Whether this process has tried to load the CUDA driver. Host-only use of
/// xcall leaves it false; the first CUDA request makes it true.
///
/// Bad input: none (no arguments).
#[no_mangle]
pub extern "C" fn xcall_cuda_load_attempted() -> bool {
    xcall_core::cuda::driver_load_attempted()
}

/// Size in bytes of one element of `dtype` (an `xcall_dtype` value) in
/// `*out_size`.
///
/// Errors: `XCALL_STATUS_NULL_ARGUMENT`, `XCALL_STATUS_INVALID_ARGUMENT`
/// (unknown dtype).
///
/// Bad input: as listed under Errors; `*out_size` is written only on
/// success.
#[no_mangle]
pub extern "C" fn xcall_dtype_size(dtype: DTypeCode, out_size: *mut usize) -> Status {
    ffi_call!({
        let out = out_ptr(out_size, "out_size")?;
        let dtype = dtype.get()?;
        *out = dtype.size_bytes();
        Ok(())
    })
}

/// Short name of `dtype` (an `xcall_dtype` value), for example "bf16", or
/// NULL for an unknown code. The string is static.
///
/// Bad input: an unknown code gets NULL (no error is recorded).
#[no_mangle]
pub extern "C" fn xcall_dtype_name(dtype: DTypeCode) -> *const c_char {
    DType::from_code(dtype.0).map_or(std::ptr::null(), |d| d.c_name().as_ptr())
}

/// A 64-bit digest of `len` bytes at `bytes` with `seed`, in `*out`: XXH3
/// 64-bit (the xxHash library's `XXH3_64bits_withSeed` gives the same
/// value), stable across processes, machines and xcall versions. Use it to
/// make the graph cache's keys: `target_id` from the custom call's name,
/// `attributes` from its serialized attributes. Chain several fields by
/// passing one digest as the next one's seed.
///
/// Bad input: NULL `out`, or NULL `bytes` with `len` > 0:
/// `XCALL_STATUS_NULL_ARGUMENT`; `len` above `PTRDIFF_MAX`:
/// `XCALL_STATUS_INVALID_ARGUMENT`; `*out` is written only on success.
#[no_mangle]
pub extern "C" fn xcall_digest(
    bytes: *const std::ffi::c_void,
    len: usize,
    seed: u64,
    out: *mut u64,
) -> Status {
    ffi_call!({
        let out = out_ptr(out, "out")?;
        if len > isize::MAX as usize {
            return Err(guard::FfiError::new(
                Status::InvalidArgument,
                format!("len {len} is above PTRDIFF_MAX"),
            ));
        }
        let data: &[u8] = match (bytes.is_null(), len) {
            (_, 0) => &[],
            (true, _) => {
                return Err(guard::FfiError::new(
                    Status::NullArgument,
                    format!("bytes is NULL with len {len}"),
                ))
            }
            // SAFETY: the caller promises `bytes` points to `len` readable
            // bytes; it is not NULL and `len` is at most isize::MAX.
            (false, n) => unsafe { std::slice::from_raw_parts(bytes.cast::<u8>(), n) },
        };
        *out = xxhash_rust::xxh3::xxh3_64_with_seed(data, seed);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn text(p: *const c_char) -> String {
        // SAFETY: the functions under test return static or thread-local C strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    #[test]
    fn version_is_the_crate_version() {
        assert_eq!(text(xcall_version()), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn status_names() {
        assert_eq!(text(xcall_status_name(0)), "XCALL_STATUS_OK");
        assert_eq!(text(xcall_status_name(3)), "XCALL_STATUS_PANIC");
        assert_eq!(text(xcall_status_name(999)), "XCALL_STATUS_UNKNOWN");
    }

    #[test]
    fn outputs_are_untouched_on_failure() {
        let mut count = 12345usize;
        assert_eq!(
            xcall_device_count(PlatformCode(7), &mut count),
            Status::InvalidArgument
        );
        assert_eq!(count, 12345);
        assert!(text(xcall_last_error_message()).contains("unknown platform code 7"));
        assert_eq!(
            xcall_device_count(PlatformCode(0), std::ptr::null_mut()),
            Status::NullArgument
        );
        assert_eq!(text(xcall_last_error_message()), "out_count is NULL");
        assert_eq!(xcall_device_count(PlatformCode(0), &mut count), Status::Ok);
        assert_eq!(count, 1);
        assert_eq!(text(xcall_last_error_message()), "");
    }

    #[test]
    fn digest_is_xxh3_64_with_seed() {
        // Known answers of the xxHash C library (XXH3_64bits_withSeed),
        // one per length class of the algorithm: 0, 1-3, 4-8, 9-16,
        // 17-128, 129-240 and longer.
        let sequence = |n: usize| (0..n).map(|i| i as u8).collect::<Vec<u8>>();
        let cases: Vec<(Vec<u8>, u64, u64)> = vec![
            (vec![], 0, 0x2d06_8005_38d3_94c2),
            (vec![], 0x9e37_79b1_85eb_ca87, 0x07f7_0f81_9703_314d),
            (b"ab".to_vec(), 1, 0xad9e_b8f4_efd9_807b),
            (b"xcall".to_vec(), 42, 0x80ca_c66c_e253_ea5c),
            (b"permute".to_vec(), 0, 0xf015_f9cf_d964_01f0),
            (b"0123456789abcdef".to_vec(), 0, 0x6443_9946_d8fa_212d),
            (sequence(100), 0, 0x004e_4f92_1a64_bd1c),
            (sequence(200), 3, 0x3148_b77a_72e5_d10a),
            (sequence(256).repeat(5), 7, 0xc7f6_83f9_f97c_c6e6),
        ];
        for (data, seed, want) in cases {
            let mut got = 0u64;
            assert_eq!(
                xcall_digest(data.as_ptr().cast(), data.len(), seed, &mut got),
                Status::Ok
            );
            assert_eq!(got, want, "{} bytes, seed {seed}", data.len());
        }
    }

    #[test]
    fn digest_refuses_bad_input_and_leaves_out_alone() {
        let mut got = 5u64;
        assert_eq!(
            xcall_digest(std::ptr::null(), 3, 0, &mut got),
            Status::NullArgument
        );
        assert_eq!(text(xcall_last_error_message()), "bytes is NULL with len 3");
        assert_eq!(
            xcall_digest(b"x".as_ptr().cast(), usize::MAX, 0, &mut got),
            Status::InvalidArgument
        );
        assert!(text(xcall_last_error_message()).contains("PTRDIFF_MAX"));
        assert_eq!(got, 5);
        assert_eq!(
            xcall_digest(b"x".as_ptr().cast(), 1, 0, std::ptr::null_mut()),
            Status::NullArgument
        );
        // NULL with no bytes is the empty input.
        assert_eq!(xcall_digest(std::ptr::null(), 0, 0, &mut got), Status::Ok);
        assert_eq!(got, 0x2d06_8005_38d3_94c2);
    }

    #[test]
    fn dtype_sizes_and_names() {
        let mut size = 0usize;
        assert_eq!(
            xcall_dtype_size(DTypeCode(DType::Bf16 as u32), &mut size),
            Status::Ok
        );
        assert_eq!(size, 2);
        assert_eq!(
            xcall_dtype_size(DTypeCode(0), &mut size),
            Status::InvalidArgument
        );
        assert_eq!(size, 2);
        assert_eq!(
            text(xcall_dtype_name(DTypeCode(DType::F8E4M3 as u32))),
            "f8e4m3"
        );
        assert!(xcall_dtype_name(DTypeCode(42)).is_null());
    }
}
