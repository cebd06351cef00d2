//! Where work runs: one `xcall_target` for every entry point that names a
//! device (permutation ops, graph-cache calls and queries, warp-specialized
//! ops, symmetric-memory worlds).

use std::ffi::c_void;

use static_assertions::{assert_eq_align, assert_eq_size};
use xcall_core::{Device, Platform, Status};

use crate::guard::{FfiError, PlatformCode};

/// Where work runs: a device and, for calls that enqueue work, a stream.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_target {
    /// An `xcall_platform` value.
    pub platform: PlatformCode,
    /// Device ordinal within the platform (0 on Host).
    pub ordinal: u32,
    /// The `CUstream` to enqueue on (CUDA); ignored on Host and by calls
    /// that enqueue nothing (graph-cache queries, world configuration).
    pub stream: *mut c_void,
}

assert_eq_size!(xcall_target, [u64; 2]);
assert_eq_align!(xcall_target, u64);

impl xcall_target {
    /// The target behind `p`; NULL is `XCALL_STATUS_NULL_ARGUMENT` naming
    /// `name`.
    pub(crate) fn read<'a>(p: *const xcall_target, name: &str) -> Result<&'a Self, FfiError> {
        // SAFETY: NULL or a readable xcall_target (header contract).
        unsafe { p.as_ref() }
            .ok_or_else(|| FfiError::new(Status::NullArgument, format!("{name} is NULL")))
    }

    /// The device, checked the same way by every entry point: an unknown
    /// platform is refused, and Host has one device, `host:0`. A CUDA
    /// ordinal is checked where the call needs the device (so that queries
    /// of a device never used load no driver).
    pub(crate) fn device(&self) -> Result<Device, FfiError> {
        let device = Device::new(self.platform.get()?, self.ordinal);
        if device.platform == Platform::Host {
            device.validate()?;
        }
        Ok(device)
    }

    /// The stream on CUDA, `None` on Host.
    pub(crate) fn cuda_stream(&self, device: Device) -> Option<*mut c_void> {
        (device.platform == Platform::Cuda).then_some(self.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(platform: u32, ordinal: u32, stream: usize) -> xcall_target {
        xcall_target {
            platform: PlatformCode(platform),
            ordinal,
            stream: stream as *mut c_void,
        }
    }

    #[test]
    fn one_device_rule_and_the_stream_only_on_cuda() {
        let host = target(0, 0, 0x40);
        let d = host.device().unwrap();
        assert_eq!(d, Device::new(Platform::Host, 0));
        assert_eq!(host.cuda_stream(d), None, "Host ignores the stream");
        let e = target(0, 1, 0).device().unwrap_err();
        assert_eq!(e.status, Status::NoSuchDevice);
        // A CUDA ordinal is not checked here (no driver is loaded).
        let cuda = target(1, 7, 0x1234);
        let d = cuda.device().unwrap();
        assert_eq!(d, Device::cuda(7));
        assert_eq!(cuda.cuda_stream(d), Some(0x1234 as *mut c_void));
        let e = target(5, 0, 0).device().unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument);
        assert!(
            e.message.contains("unknown platform code 5"),
            "{}",
            e.message
        );
        assert_eq!(
            xcall_target::read(std::ptr::null(), "target")
                .unwrap_err()
                .status,
            Status::NullArgument
        );
    }
}
