//! The CUDA handlers work on the device the runtime names for the call,
//! not on device 0: a fake runtime answers distinct ordinals that no
//! machine has, and each handler's error must name that device (the
//! ordinal is checked before any work, so nothing runs and nothing is
//! written). Its own test binary: checking a device loads CUDA, which
//! `xla_ffi.rs` asserts never happens there.

// The frames point into their parts: each part is boxed so its address
// stays put while the vectors that own them grow.
#![allow(clippy::vec_box)]

mod xla_fake;

use std::cell::Cell;
use std::ffi::c_void;

use xcall::xla::abi::*;
use xcall::*;
use xla_fake::*;

thread_local! {
    static ORDINAL: Cell<i32> = const { Cell::new(-1) };
}

unsafe extern "C" fn some_stream(args: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: a filled struct from the handler. The stream is never used:
    // the device check fails first.
    unsafe { (*args).stream = 0x5eed as *mut c_void };
    std::ptr::null_mut()
}

unsafe extern "C" fn the_ordinal(args: *mut XLA_FFI_DeviceOrdinal_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: a filled struct from the handler.
    unsafe { (*args).device_ordinal = ORDINAL.with(|o| o.get()) };
    std::ptr::null_mut()
}

#[test]
fn cuda_handlers_use_the_device_the_runtime_names() {
    for ordinal in [64, 100, 1000] {
        ORDINAL.with(|o| o.set(ordinal));
        let mut m = MapBufs::new(77);
        let mut f = m.frame(dtype::U8, &[]);
        f._api.stream_get = Some(some_stream);
        f._api.device_ordinal_get = Some(the_ordinal);
        let (code, message) = call(xcall_xla_make_row_id_map_cuda, &mut f).unwrap_err();
        let named = format!("the runtime's device cuda:{ordinal}");
        assert!(message.contains(&named), "{message} (want {named})");
        // INVALID_ARGUMENT (no such device) or UNAVAILABLE (no CUDA here).
        assert!(matches!(code, 3 | 14), "XLA error code {code}: {message}");
        assert_eq!(m.map, [77; 15], "nothing written");
        assert_eq!((m.tpe, m.off), ([77; 2], [77; 3]), "nothing written");
    }
}
