//! Capture policies and cache limits.

use xcall_core::{Error, Result};

/// What the cache does with a call it has not seen with these exact buffers.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// When a cached graph differs only in buffer addresses: if the call is
    /// [relocatable](crate::Call::relocatable), the graph was captured by
    /// one, and it is made only of kernels launched through xcall's launcher (whose parameter
    /// structs say which fields are pointers) and the new buffers keep the
    /// old ones' alignment modulo 256 and their placement relative to each
    /// other, move its kernels' pointers to the new buffers in place
    /// (`cuGraphExecKernelNodeSetParams`, no capture; the record function
    /// does not run); otherwise capture a new graph and update the
    /// executable with `cuGraphExecUpdate` instead of instantiating a new
    /// one (falls back to instantiating when refused).
    ExecUpdate = 0,
    /// Capture and instantiate a new graph for every new key.
    Recapture = 1,
    /// Never capture: every call runs eagerly on its stream.
    Disabled = 2,
}

xcall_core::c_enum!(Policy, "graph policy", [ExecUpdate, Recapture, Disabled]);

/// Limits and behaviour of a [`crate::GraphCache`]. Every limit applies per
/// device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Graphs kept per device; the least recently used is evicted (default 64).
    pub capacity: usize,
    /// Optional limit on the total nodes of the graphs kept per device.
    pub max_nodes: Option<usize>,
    /// Capture policy (default [`Policy::ExecUpdate`]).
    pub policy: Policy,
    /// After a failed capture, the key runs eagerly this many times before
    /// capture is tried again (default 16).
    pub retry_after: u32,
    /// Executables kept per topology (key without addresses) before new
    /// addresses update one in place under [`Policy::ExecUpdate`]
    /// (default 1; 2 suits ping-pong buffers).
    pub variants_per_topology: usize,
    /// The bits of a key's hash that pick its bucket (default all). A test
    /// hook: narrowing it forces hash collisions, which lookups must
    /// survive (keys are compared in full).
    pub bucket_mask: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            capacity: 64,
            max_nodes: None,
            policy: Policy::ExecUpdate,
            retry_after: 16,
            variants_per_topology: 1,
            bucket_mask: u64::MAX,
        }
    }
}

impl CacheConfig {
    /// Checks the limits.
    pub fn validate(&self) -> Result<()> {
        if self.capacity == 0 {
            return Err(Error::InvalidArgument(
                "graph cache capacity must be at least 1".into(),
            ));
        }
        if self.max_nodes == Some(0) {
            return Err(Error::InvalidArgument(
                "max_nodes must be at least 1 when set".into(),
            ));
        }
        if self.variants_per_topology == 0 {
            return Err(Error::InvalidArgument(
                "variants_per_topology must be at least 1".into(),
            ));
        }
        Ok(())
    }
}
