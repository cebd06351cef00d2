//! A device-aware CUDA graph cache for custom calls.
//!
//! A custom-call handler gets a device, a stream and buffers, and has a
//! function that enqueues its kernels on a stream. Instead of launching
//! directly it calls [`GraphCache::execute`]: on CUDA the first call captures
//! the work into a graph and launches it, later identical calls replay it,
//! and a call that differs only in buffer addresses updates a cached
//! executable in place: for graphs of xcall's own kernels by moving their
//! pointer parameters (no capture), otherwise by capturing again and
//! `cuGraphExecUpdate`. On Host the function runs directly and nothing
//! touches CUDA; one code path serves both platforms.
//!
//! The key is the full tuple (platform, device, target, attributes,
//! buffers) compared exactly ([`CallKey`]); state is sharded per device; the
//! cache is bounded per device; [`GraphCache::invalidate_range`] evicts
//! graphs before their memory is freed.

#![deny(missing_docs)]

pub mod backend;
pub mod cache;
mod call;
pub mod cuda;
mod error;
pub mod key;
mod op;
pub mod policy;
mod shard;
pub mod sim;

pub use backend::{GraphBackend, StreamState};
pub use cache::{Call, GraphCache, Outcome, Stats};
pub use error::{GraphError, GraphResult};
pub use key::{Attributes, Buffer, BufferRole, CallKey};
pub use op::{op_id, OpCall, OpFailure};
pub use policy::{CacheConfig, Policy};
pub use xcall_core::{Device, Error, Platform, Result};
