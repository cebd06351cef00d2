//! MoE token permutation ops with published aliasing contracts.
//!
//! `make_row_id_map` turns a `[T, E]` routing map into the row-id map that
//! drives `permute` (group tokens by expert) and `unpermute` (restore token
//! order, merging each token's routes). Every op publishes its alias table
//! ([`alias::alias_table`]: none may alias) and refuses overlapping buffers
//! before writing anything (an output that shares memory with an input
//! would be corrupted silently; see [`alias`]).
//!
//! Two layers:
//! - safe Host functions on slices ([`ops`], [`chunks`],
//!   [`make_row_id_map`]), the reference the CUDA kernels are tested
//!   against;
//! - [`call`]: every op on raw addresses for Host and CUDA alike, with the
//!   full argument checks, the overlap refusal, in-place variants and (on
//!   CUDA) autotuned kernels ([`cuda`]). The C ABI is a thin layer over it.
//!
//! Results are deterministic: no atomics in any result, fixed summation
//! orders, the same bits on Host and CUDA and for every launch config.
//!
//! Maps on CUDA: the Host validates a row-id map fully before an op
//! follows it; a CUDA kernel cannot return an error, so every kernel that
//! follows a map checks each entry it uses, skips one that points outside
//! its tensors (nothing is written out of range) and records the fault on
//! the device ([`MapFaults`], read with [`call::take_faults`]). Checked mode
//! ([`call::Target::checked`], `XCALL_PERMUTE_CHECK=1`) runs the Host's
//! full check on the device first and fails the call, nothing written.

#![deny(missing_docs)]

pub mod alias;
mod args;
pub mod call;
mod check;
pub mod chunks;
pub mod cuda;
mod error;
mod host;
pub mod ops;
pub mod row_id_map;

pub use error::PermuteError;
pub use row_id_map::{
    make_row_id_map, ExpertGroups, MapFaults, RowIdMap, RowIdMapOptions, RowIdMapRef,
};
pub use xcall_core::{Device, Error, Platform, Result};
