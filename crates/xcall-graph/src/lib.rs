//! Device-aware CUDA graph cache for custom calls: capture once, replay, exec-update on pointer churn; Host runs the call directly.
//!
//! Platform-neutral types come from [`xcall_core`]; this crate adds
//! the capability itself, one module per part.

#![deny(missing_docs)]

pub mod cache;
pub mod key;
pub mod policy;

pub use xcall_core::{Device, Error, Platform, Result};
