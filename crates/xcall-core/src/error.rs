//! The error type shared by the core and used by the capability crates.

use crate::{Device, Status};

/// An xcall error. Each variant maps to one stable [`Status`] code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument had a value outside its documented domain.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// CUDA was asked for but cannot be used on this machine.
    #[error("CUDA is unavailable: {reason}")]
    CudaUnavailable {
        /// Why: missing driver library, driver initialisation failure, no device.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed on {device}: {message}")]
    CudaDriver {
        /// The driver entry point or operation that failed.
        call: &'static str,
        /// The device the call was made for.
        device: Device,
        /// The driver's error name and description.
        message: String,
    },
    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile {name} for {arch} (options: {options:?}):\n{log}")]
    CompileFailed {
        /// The program name given to NVRTC.
        name: String,
        /// The target architecture, for example `sm_90`.
        arch: String,
        /// The options passed to NVRTC.
        options: Vec<String>,
        /// NVRTC's compile log.
        log: String,
    },
    /// A device ordinal outside the devices found at run time.
    #[error("no such device: {device} (this machine has {count} {platform} device(s))", platform = device.platform)]
    NoSuchDevice {
        /// The device asked for.
        device: Device,
        /// How many devices of that platform exist.
        count: usize,
    },
    /// The operation does not support these arguments.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Host memory for a caller-sized buffer could not be had; nothing was
    /// changed.
    #[error("out of host memory: {0}")]
    OutOfMemory(String),
}

impl Error {
    /// The stable status code of this error.
    pub fn status(&self) -> Status {
        match self {
            Error::InvalidArgument(_) => Status::InvalidArgument,
            Error::CudaUnavailable { .. } => Status::CudaUnavailable,
            Error::CudaDriver { .. } => Status::CudaDriver,
            Error::CompileFailed { .. } => Status::CompileFailed,
            Error::NoSuchDevice { .. } => Status::NoSuchDevice,
            Error::Unsupported(_) => Status::Unsupported,
            Error::OutOfMemory(_) => Status::OutOfMemory,
        }
    }

    /// The stable numeric code of this error (never 0).
    pub fn code(&self) -> u32 {
        self.status().code()
    }
}

/// Result with the core [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Platform;

    #[test]
    fn every_variant_has_a_distinct_nonzero_code() {
        let device = Device::new(Platform::Cuda, 3);
        let all = [
            Error::InvalidArgument("x".into()),
            Error::CudaUnavailable { reason: "x".into() },
            Error::CudaDriver {
                call: "cuInit",
                device,
                message: "x".into(),
            },
            Error::CompileFailed {
                name: "k".into(),
                arch: "sm_90".into(),
                options: vec![],
                log: "x".into(),
            },
            Error::NoSuchDevice { device, count: 1 },
            Error::Unsupported("x".into()),
        ];
        let mut codes: Vec<u32> = all.iter().map(Error::code).collect();
        assert!(codes.iter().all(|&c| c != 0));
        assert_eq!(codes, vec![2, 4, 5, 6, 7, 8]);
        codes.dedup();
        assert_eq!(codes.len(), all.len());
    }

    #[test]
    fn messages_name_the_device_and_the_log() {
        let e = Error::NoSuchDevice {
            device: Device::new(Platform::Cuda, 9),
            count: 2,
        };
        assert_eq!(
            e.to_string(),
            "no such device: cuda:9 (this machine has 2 cuda device(s))"
        );
        let e = Error::CompileFailed {
            name: "k.cu".into(),
            arch: "sm_90".into(),
            options: vec!["-G".into()],
            log: "k.cu(3): error: expected a \";\"".into(),
        };
        assert!(e.to_string().contains("expected a \";\""), "{e}");
    }
}
