//! MoE token permutation kernels (permute, unpermute, chunk sort) for Host and CUDA, with published aliasing contracts.
//!
//! Platform-neutral types come from [`xcall_core`]; this crate adds
//! the capability itself, one module per part.

#![deny(missing_docs)]

pub mod alias;
pub mod ops;
pub mod row_id_map;

pub use xcall_core::{Device, Error, Platform, Result};
