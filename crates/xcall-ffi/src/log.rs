//! Routing xcall's log lines: the filter and the host application's
//! callback (see `xcall_core::log`).

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Arc;

use xcall_core::log::{LogLevel, Sink};
use xcall_core::Status;

use crate::guard::{ffi_call, FfiError};

/// Receives one log line: `level` (an `xcall_log_level`), `target` (the
/// module that logged, for example "xcall_graph::cache") and `message`
/// (the text: what happened, then `name=value` fields; no trailing
/// newline). Both strings are valid only during the call: copy them to
/// keep them.
///
/// It is called on the thread that logs, possibly from several threads at
/// once, so it must be thread-safe. It should return quickly; xcall holds
/// no lock while it runs. It should not call xcall functions: a line
/// those calls would log is dropped rather than delivered re-entrantly.
pub type xcall_log_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        level: LogLevel,
        target: *const c_char,
        message: *const c_char,
    ),
>;

/// The callback and its pointer, shared with logging threads.
struct CCallback {
    f: unsafe extern "C" fn(*mut c_void, LogLevel, *const c_char, *const c_char),
    user_data: *mut c_void,
}

// SAFETY: `xcall_log_configure`'s contract makes the callback thread-safe
// with its `user_data`; xcall only passes the pointer back to it.
unsafe impl Send for CCallback {}
// SAFETY: as above: the pointer is never dereferenced by xcall.
unsafe impl Sync for CCallback {}

impl CCallback {
    fn deliver(&self, level: LogLevel, target: &str, message: &str) {
        let c = |s: &str| CString::new(s.replace('\0', "\\0")).unwrap_or_default();
        let (target, message) = (c(target), c(message));
        // SAFETY: the application gave this function and pointer for this
        // use; the strings live until the call returns.
        unsafe { (self.f)(self.user_data, level, target.as_ptr(), message.as_ptr()) }
    }
}

/// Sets where xcall's log lines go and which are kept. Logging is off by
/// default; the environment variable `XCALL_LOG` (read on the first call
/// into the library) turns it on with stderr as the sink.
///
/// - `filter`: which lines to keep, in tracing's EnvFilter syntax: a level
///   (`"info"`, `"debug"`, `"trace"`), per-target levels
///   (`"xcall_graph=debug,xcall_shmem=trace,warn"`), or `"off"` / `""`.
///   NULL keeps the current filter (`XCALL_LOG`'s, or off). A filter set
///   here replaces `XCALL_LOG`'s.
/// - `callback`: the function that receives each line (see
///   `xcall_log_fn`), with `user_data` passed back to it; NULL sends lines
///   to stderr, one per line, prefixed with `[xcall +SECONDS LEVEL TARGET]`.
///
/// Levels: error (something failed), warn, info (a shmem world starts or
/// ends), debug (graph-cache decisions other than a replay, with the
/// reason for eager runs; the transport per peer pair; bootstrap steps and
/// timeouts; autotune choices; kernel compile times), trace (every graph
/// replay).
///
/// Thread-safe; lines already being delivered may still reach the previous
/// callback. Keep `user_data` valid until another call replaces the
/// callback and the calls that were logging have returned.
///
/// Errors: `XCALL_STATUS_INVALID_ARGUMENT` (a filter that does not parse,
/// or is not UTF-8; the message quotes it), `XCALL_STATUS_UNSUPPORTED`
/// (another tracing subscriber is installed in the process already, by a
/// Rust component of the application: xcall's events go to it).
///
/// Bad input: as listed under Errors; nothing changes.
#[no_mangle]
pub extern "C" fn xcall_log_configure(
    filter: *const c_char,
    callback: xcall_log_fn,
    user_data: *mut c_void,
) -> Status {
    ffi_call!({
        let filter =
            if filter.is_null() {
                None
            } else {
                // SAFETY: the caller promises a NUL-terminated string; it is not
                // NULL.
                let text = unsafe { CStr::from_ptr(filter) };
                Some(text.to_str().map_err(|_| {
                    FfiError::new(Status::InvalidArgument, "filter is not valid UTF-8")
                })?)
            };
        let sink = match callback {
            None => Sink::Stderr,
            Some(f) => {
                let c = CCallback { f, user_data };
                Sink::Callback(Arc::new(move |level, target, message| {
                    c.deliver(level, target, message)
                }))
            }
        };
        xcall_core::log::configure(filter, Some(sink))?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_that_is_not_utf8_is_refused() {
        let bad = [0xffu8, 0];
        let status = xcall_log_configure(bad.as_ptr().cast(), None, std::ptr::null_mut());
        assert_eq!(status, Status::InvalidArgument);
    }

    #[test]
    fn a_filter_that_does_not_parse_is_refused_and_named() {
        let status = xcall_log_configure(c"xcall_graph=loud".as_ptr(), None, std::ptr::null_mut());
        assert_eq!(status, Status::InvalidArgument);
        // SAFETY: a static or thread-local C string.
        let message = unsafe { CStr::from_ptr(crate::guard::last_error_ptr()) };
        assert!(
            message.to_string_lossy().contains("xcall_graph=loud"),
            "{message:?}"
        );
    }
}
