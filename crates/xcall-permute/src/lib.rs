//! MoE token permutation ops with published aliasing contracts.
//!
//! `make_row_id_map` turns a `[T, E]` routing map into the row-id map that
//! drives `permute` (group tokens by expert) and `unpermute` (restore token
//! order, merging each token's routes). Every op publishes its alias table
//! ([`alias::alias_table`]: none may alias) and refuses overlapping buffers
//! before writing anything (incident 4).
//!
//! This crate currently provides the Host implementation of every op
//! (forward, backward, chunk sort); the CUDA kernels and the C ABI build on
//! it.

#![deny(missing_docs)]

pub mod alias;
pub mod chunks;
mod error;
pub mod ops;
pub mod row_id_map;

pub use error::PermuteError;
pub use row_id_map::{make_row_id_map, RowIdMap, RowIdMapOptions, RowIdMapRef};
pub use xcall_core::{Device, Error, Platform, Result};
