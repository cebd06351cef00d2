//! Plans, model-checks and runs warp-specialized mbarrier pipelines on Host threads and as generated Hopper kernels.
//!
//! Platform-neutral types come from [`xcall_core`]; this crate adds
//! the capability itself, one module per part.

#![deny(missing_docs)]

pub mod host;
pub mod plan;
pub mod spec;
pub mod verify;

pub use xcall_core::{Device, Error, Platform, Result};
