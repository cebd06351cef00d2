//! Stable status codes shared by every crate and by the C ABI.
//!
//! The numbers are part of the ABI: a code is never renumbered and a retired
//! code is never reused. New codes are appended.

use std::ffi::CStr;

/// Result code of an xcall operation (`xcall_status` in C; 0 means success).
///
/// Codes are stable across releases and never reused.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// The call succeeded.
    Ok = 0,
    /// A required pointer argument was NULL.
    NullArgument = 1,
    /// An argument had a value outside its documented domain.
    InvalidArgument = 2,
    /// An internal panic was caught at the C boundary; no state was changed
    /// knowingly, but the handle involved should be freed.
    Panic = 3,
    /// CUDA was requested but no usable driver or device exists on this machine.
    CudaUnavailable = 4,
    /// A CUDA driver call failed.
    CudaDriver = 5,
    /// NVRTC could not compile a kernel; the message carries NVRTC's log.
    CompileFailed = 6,
    /// A device ordinal is outside the range of devices found at run time.
    NoSuchDevice = 7,
    /// The operation is not supported for these arguments (dtype, platform, ...).
    Unsupported = 8,
    /// A caller-supplied callback (for example a graph cache's record
    /// function) reported failure; the message carries its code.
    CallbackFailed = 9,
    /// A wait did not complete in time (a stalled pipeline, a peer that never
    /// arrived); the message says who waited for what.
    Timeout = 10,
    /// An output overlaps an input or another output of an op that
    /// publishes no such alias; nothing was written. The message names both.
    Aliased = 11,
    /// The object is not in a state that allows this call (used before
    /// init, initialised twice, used after finalize).
    InvalidState = 12,
    /// A memory pool (for example a symmetric heap) has no free block large
    /// enough; the message gives the request, the largest free block and
    /// the total free.
    OutOfMemory = 13,
    /// The processing elements of a collective call disagree (different
    /// sizes, order or arguments); reported on every one of them.
    CollectiveMismatch = 14,
    /// An operating-system call failed (socket, shared memory, mapping).
    System = 15,
    /// A PE of the world left without finalize, or failed in finalize: the
    /// world is failed, and every later transfer, signal, wait or
    /// collective on any of its PEs returns this code without touching
    /// memory. Only finalize (or freeing the handle) remains.
    PeerFailed = 16,
    /// A handle argument is not a live handle of the expected type (freed
    /// already, or never made by xcall, or a handle of another type).
    InvalidHandle = 17,
    /// A bounded piece of work reached its bound (states or memory of the
    /// model checker, a time budget); the message gives the numbers reached.
    Limit = 18,
    /// The handle is in use by another thread, and it is not safe to share:
    /// nothing was done.
    Busy = 19,
}

crate::c_enum!(
    Status,
    "status code",
    [
        Ok,
        NullArgument,
        InvalidArgument,
        Panic,
        CudaUnavailable,
        CudaDriver,
        CompileFailed,
        NoSuchDevice,
        Unsupported,
        CallbackFailed,
        Timeout,
        Aliased,
        InvalidState,
        OutOfMemory,
        CollectiveMismatch,
        System,
        PeerFailed,
        InvalidHandle,
        Limit,
        Busy
    ]
);

impl Status {
    /// The numeric code.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The name of the C constant for this status, NUL-terminated.
    pub fn c_name(self) -> &'static CStr {
        match self {
            Status::Ok => c"XCALL_STATUS_OK",
            Status::NullArgument => c"XCALL_STATUS_NULL_ARGUMENT",
            Status::InvalidArgument => c"XCALL_STATUS_INVALID_ARGUMENT",
            Status::Panic => c"XCALL_STATUS_PANIC",
            Status::CudaUnavailable => c"XCALL_STATUS_CUDA_UNAVAILABLE",
            Status::CudaDriver => c"XCALL_STATUS_CUDA_DRIVER",
            Status::CompileFailed => c"XCALL_STATUS_COMPILE_FAILED",
            Status::NoSuchDevice => c"XCALL_STATUS_NO_SUCH_DEVICE",
            Status::Unsupported => c"XCALL_STATUS_UNSUPPORTED",
            Status::CallbackFailed => c"XCALL_STATUS_CALLBACK_FAILED",
            Status::Timeout => c"XCALL_STATUS_TIMEOUT",
            Status::Aliased => c"XCALL_STATUS_ALIASED",
            Status::InvalidState => c"XCALL_STATUS_INVALID_STATE",
            Status::OutOfMemory => c"XCALL_STATUS_OUT_OF_MEMORY",
            Status::CollectiveMismatch => c"XCALL_STATUS_COLLECTIVE_MISMATCH",
            Status::System => c"XCALL_STATUS_SYSTEM",
            Status::PeerFailed => c"XCALL_STATUS_PEER_FAILED",
            Status::InvalidHandle => c"XCALL_STATUS_INVALID_HANDLE",
            Status::Limit => c"XCALL_STATUS_LIMIT",
            Status::Busy => c"XCALL_STATUS_BUSY",
        }
    }

    /// The name of the C constant for this status.
    pub fn name(self) -> &'static str {
        // The names are ASCII literals, so the conversion cannot fail.
        self.c_name().to_str().unwrap_or("XCALL_STATUS_UNKNOWN")
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_published_numbers() {
        // The ABI promise, written out independently of the enum.
        let published = [
            (0, "XCALL_STATUS_OK"),
            (1, "XCALL_STATUS_NULL_ARGUMENT"),
            (2, "XCALL_STATUS_INVALID_ARGUMENT"),
            (3, "XCALL_STATUS_PANIC"),
            (4, "XCALL_STATUS_CUDA_UNAVAILABLE"),
            (5, "XCALL_STATUS_CUDA_DRIVER"),
            (6, "XCALL_STATUS_COMPILE_FAILED"),
            (7, "XCALL_STATUS_NO_SUCH_DEVICE"),
            (8, "XCALL_STATUS_UNSUPPORTED"),
            (9, "XCALL_STATUS_CALLBACK_FAILED"),
            (10, "XCALL_STATUS_TIMEOUT"),
            (11, "XCALL_STATUS_ALIASED"),
            (12, "XCALL_STATUS_INVALID_STATE"),
            (13, "XCALL_STATUS_OUT_OF_MEMORY"),
            (14, "XCALL_STATUS_COLLECTIVE_MISMATCH"),
            (15, "XCALL_STATUS_SYSTEM"),
            (16, "XCALL_STATUS_PEER_FAILED"),
            (17, "XCALL_STATUS_INVALID_HANDLE"),
            (18, "XCALL_STATUS_LIMIT"),
            (19, "XCALL_STATUS_BUSY"),
        ];
        assert_eq!(Status::ALL.len(), published.len());
        for (code, name) in published {
            let status = Status::from_code(code).expect("published code exists");
            assert_eq!(status.code(), code);
            assert_eq!(status.name(), name);
        }
        assert_eq!(Status::from_code(published.len() as u32), None);
    }
}
