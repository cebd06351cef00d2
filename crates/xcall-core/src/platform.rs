//! Platforms and devices.

use crate::{cuda, Error, Result};

/// Where work runs (`xcall_platform` in C).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Platform {
    /// The CPU. Always available; never touches CUDA.
    Host = 0,
    /// NVIDIA GPUs through the CUDA driver, loaded on first use.
    Cuda = 1,
}

crate::c_enum!(Platform, "platform code", [Host, Cuda]);

impl Platform {
    /// Lower-case name: `host` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            Platform::Host => "host",
            Platform::Cuda => "cuda",
        }
    }

    /// Number of devices of this platform. Host has exactly one; CUDA asks the
    /// driver (loading it on first use) and fails with
    /// [`Error::CudaUnavailable`] when there is no driver or no device.
    pub fn device_count(self) -> Result<usize> {
        match self {
            Platform::Host => Ok(1),
            Platform::Cuda => cuda::device_count(),
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Platform {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "host" | "cpu" => Ok(Platform::Host),
            "cuda" | "gpu" => Ok(Platform::Cuda),
            _ => Err(Error::InvalidArgument(format!(
                "unknown platform {s:?} (expected \"host\" or \"cuda\")"
            ))),
        }
    }
}

/// One device: a platform and an ordinal within it. Every xcall call names
/// its device explicitly; nothing is inferred from the calling thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device {
    /// The platform the device belongs to.
    pub platform: Platform,
    /// The ordinal within the platform (CUDA's device ordinal).
    pub ordinal: u32,
}

impl Device {
    /// The single Host device.
    pub const HOST: Device = Device {
        platform: Platform::Host,
        ordinal: 0,
    };

    /// A device of `platform` with `ordinal`.
    pub const fn new(platform: Platform, ordinal: u32) -> Device {
        Device { platform, ordinal }
    }

    /// CUDA device `ordinal`.
    pub const fn cuda(ordinal: u32) -> Device {
        Device::new(Platform::Cuda, ordinal)
    }

    /// Checks that the device exists on this machine (loads CUDA only for a
    /// CUDA device).
    pub fn validate(self) -> Result<Device> {
        let count = self.platform.device_count()?;
        if (self.ordinal as usize) < count {
            Ok(self)
        } else {
            Err(Error::NoSuchDevice {
                device: self,
                count,
            })
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.platform, self.ordinal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_codes_and_parsing() {
        assert_eq!(Platform::from_code(0), Some(Platform::Host));
        assert_eq!(Platform::from_code(1), Some(Platform::Cuda));
        assert_eq!(Platform::from_code(2), None);
        assert_eq!("CUDA".parse::<Platform>().unwrap(), Platform::Cuda);
        assert_eq!("cpu".parse::<Platform>().unwrap(), Platform::Host);
        let err = "tpu".parse::<Platform>().unwrap_err();
        assert_eq!(err.status(), crate::Status::InvalidArgument);
        assert_eq!(Device::cuda(7).to_string(), "cuda:7");
        assert_eq!(Device::HOST.to_string(), "host:0");
    }

    #[test]
    fn host_has_exactly_one_device() {
        assert_eq!(Platform::Host.device_count().unwrap(), 1);
        assert_eq!(Device::HOST.validate().unwrap(), Device::HOST);
        let err = Device::new(Platform::Host, 1).validate().unwrap_err();
        assert_eq!(
            err,
            Error::NoSuchDevice {
                device: Device::new(Platform::Host, 1),
                count: 1
            }
        );
    }
}
