//! The discipline every entry point follows: catch panics, record the
//! thread's last error message, check pointers, write outputs only on
//! success.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use xcall_core::{CEnum, Platform, Status};

/// An error on its way out through the C boundary.
#[derive(Debug)]
pub(crate) struct FfiError {
    pub(crate) status: Status,
    pub(crate) message: String,
}

impl FfiError {
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Self {
        FfiError {
            status,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for FfiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<xcall_core::Error> for FfiError {
    fn from(e: xcall_core::Error) -> Self {
        FfiError::new(e.status(), e.to_string())
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // Interior NULs would cut the message short in C; show them instead.
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = text);
}

/// Records `e` as this thread's last error (for paths that report through
/// something other than a status).
pub(crate) fn record_error(e: &FfiError) {
    set_last_error(&e.message);
}

/// Pointer to this thread's last error message (empty when the last call
/// succeeded). Valid until the next xcall call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

fn clear_last_error() {
    // Every call passes here: allocate nothing when there is nothing to clear.
    LAST_ERROR.with(|slot| {
        if !slot.borrow().is_empty() {
            *slot.borrow_mut() = CString::default();
        }
    });
}

/// Runs an entry point's body: clears the last error, turns `Err` into its
/// status with the message recorded, and a panic into [`Status::Panic`].
pub(crate) fn run(body: impl FnOnce() -> Result<(), FfiError>) -> Status {
    // XCALL_LOG is read on the first call into the library.
    xcall_core::log::init_from_env_once();
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(body)) {
        // Empty after success, as the header says, even when the body ran a
        // caller's callback that made a failing xcall call of its own.
        Ok(Ok(())) => {
            clear_last_error();
            Status::Ok
        }
        Ok(Err(e)) => {
            set_last_error(&e.message);
            e.status
        }
        Err(panic) => {
            set_last_error(&format!(
                "internal panic caught at the C boundary: {}",
                xcall_core::panic_message(&*panic)
            ));
            Status::Panic
        }
    }
}

/// The body of every fallible `extern "C"` function: see [`run`]. A macro
/// inside the function keeps the signature visible to cbindgen.
macro_rules! ffi_call {
    ($body:block) => {
        $crate::guard::run(|| -> Result<(), $crate::guard::FfiError> { $body })
    };
}
pub(crate) use ffi_call;

/// A non-NULL output pointer, or [`Status::NullArgument`] naming it.
pub(crate) fn out_ptr<'a, T>(ptr: *mut T, name: &str) -> Result<&'a mut T, FfiError> {
    // SAFETY: the C caller promises `ptr` is NULL or points to a writable T
    // (the header documents every output this way); NULL is refused here.
    unsafe { ptr.as_mut() }
        .ok_or_else(|| FfiError::new(Status::NullArgument, format!("{name} is NULL")))
}

/// A platform code from C, checked (C may pass any integer).
/// Declares the parameter type a C enum arrives as: the bits the caller
/// passed (`#[repr(transparent)]` over `u32`, so any value is sound to
/// receive), shown in the header as the enum's own type by a rename in
/// cbindgen.toml. `.get()` decodes it.
macro_rules! c_code {
    ($(#[$meta:meta])* $code:ident => $enum:ty) => {
        $(#[$meta])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $code(pub u32);

        impl $code {
            /// The enum value, or `InvalidArgument` naming the code.
            pub(crate) fn get(self) -> Result<$enum, FfiError> {
                code_arg(self.0)
            }
        }
    };
}
pub(crate) use c_code;

c_code!(
    /// An `xcall_platform` as passed.
    PlatformCode => Platform
);
c_code!(
    /// An `xcall_dtype` as passed.
    DTypeCode => xcall_core::DType
);

/// The value of C enum `T` with this code; an unknown code is
/// `InvalidArgument` naming the code and the valid ones.
pub(crate) fn code_arg<T: CEnum>(code: u32) -> Result<T, FfiError> {
    T::decode(code).ok_or_else(|| FfiError::new(Status::InvalidArgument, T::unknown(code)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: last_error_ptr is always a valid NUL-terminated string.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_with_its_message() {
        let status = ffi_call!({
            let v: Vec<u8> = Vec::new();
            let _ = v[std::hint::black_box(5)];
            Ok(())
        });
        assert_eq!(status, Status::Panic);
        assert!(
            last().starts_with("internal panic caught at the C boundary: index out of bounds"),
            "{}",
            last()
        );
    }

    #[test]
    fn errors_set_and_success_clears_the_message() {
        let status = ffi_call!({ Err(FfiError::new(Status::InvalidArgument, "bad\0thing")) });
        assert_eq!(status, Status::InvalidArgument);
        assert_eq!(last(), "bad\\0thing");
        assert_eq!(ffi_call!({ Ok(()) }), Status::Ok);
        assert_eq!(last(), "");
    }

    #[test]
    fn messages_are_per_thread() {
        let _ = ffi_call!({ Err(FfiError::new(Status::Unsupported, "main thread")) });
        std::thread::spawn(|| assert_eq!(last(), ""))
            .join()
            .unwrap();
        assert_eq!(last(), "main thread");
    }
}
