//! Symmetric memory for one process driving many GPUs (one thread per GPU) and for many processes.
//!
//! Platform-neutral types come from [`xcall_core`]; this crate adds
//! the capability itself, one module per part.

#![deny(missing_docs)]

pub mod bootstrap;
pub mod heap;
pub mod world;

pub use xcall_core::{Device, Error, Platform, Result};
