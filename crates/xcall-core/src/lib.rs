//! Shared types of xcall: [`Platform`], [`Device`], the per-device
//! [`DeviceMap`], [`DType`], [`Error`] with its stable [`Status`] codes, the
//! lazy CUDA probe ([`cuda::available`]) and the per-device NVRTC
//! [`KernelCache`].
//!
//! Everything here works on a machine without CUDA. Host work never loads
//! the CUDA driver; CUDA work loads it on first use and reports a clear
//! [`Error::CudaUnavailable`] when it cannot.

#![deny(missing_docs)]

pub mod alloc;
mod c_enum;
pub mod cuda;
mod device_map;
mod dtype;
pub mod env;
mod error;
pub mod host_pool;
pub mod kernel_cache;
pub mod log;
mod platform;
mod status;
pub mod testing;

pub use c_enum::CEnum;
pub use device_map::DeviceMap;
pub use dtype::{bf16_bits, fp8_decode, fp8_encode, DType, FloatCodec, Fp8};
pub use error::{Error, Result};
pub use kernel_cache::{KernelCache, KernelSource};
pub use log::LogLevel;
pub use platform::{Device, Platform};
pub use status::Status;

/// The text of a caught panic payload (`&str` or `String`), or a fixed
/// description for other payloads.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}
