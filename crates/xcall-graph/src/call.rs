//! What one call to the cache is ([`Call`]), what came of it ([`Outcome`])
//! and the counters of a device ([`Stats`]).

use std::any::Any;
use std::sync::Arc;

use crate::key::CallKey;

/// One call: its key, the stream to run on (required for CUDA, ignored on
/// Host), and objects the cached graph must keep alive (for example the
/// loaded modules its kernels come from).
pub struct Call<S> {
    /// The exact key.
    pub key: CallKey,
    /// The caller's stream.
    pub stream: Option<S>,
    /// Kept alive as long as a graph captured for this call is cached.
    pub keep_alive: Vec<Arc<dyn Any + Send + Sync>>,
    /// The work depends on the buffers only through their addresses: for
    /// calls of one topology the record function enqueues the same kernels
    /// with the same parameters except pointers into the buffers, given
    /// the same alignment modulo 256 and the same placement of the buffers
    /// relative to each other (xcall's own ops do). Lets
    /// [`Policy::ExecUpdate`] move a cached graph's kernel pointers to new
    /// buffers without running the record function ([`Outcome::Patched`]).
    /// Default `false`.
    pub relocatable: bool,
}

impl<S> Call<S> {
    /// A call with nothing to keep alive.
    pub fn new(key: CallKey, stream: Option<S>) -> Self {
        Call {
            key,
            stream,
            keep_alive: Vec::new(),
            relocatable: false,
        }
    }

    /// The same call, declared [relocatable](Call::relocatable).
    pub fn relocatable(self) -> Self {
        Call {
            relocatable: true,
            ..self
        }
    }
}

/// What the cache did with a call (`xcall_graph_outcome` in C).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A cached graph was launched.
    Replayed = 0,
    /// A cached executable was updated to the new buffers and launched.
    Updated = 1,
    /// The work was captured into a new graph, instantiated and launched.
    Captured = 2,
    /// Host platform: the record function ran directly.
    EagerHost = 3,
    /// CUDA, but the record function ran directly on the stream (policy
    /// disabled, caller already capturing, capture in progress elsewhere,
    /// key not capturable, or this capture failed; see the stats).
    EagerFallback = 4,
    /// A cached executable of xcall's own kernels had its pointers moved
    /// to the new buffers in place and was launched: no capture, and the
    /// record function did not run.
    Patched = 5,
}

xcall_core::c_enum!(
    Outcome,
    "graph outcome",
    [
        Replayed,
        Updated,
        Captured,
        EagerHost,
        EagerFallback,
        Patched
    ]
);

impl Outcome {
    /// The outcome's name in reports, snake_case (`"eager_host"`): the C
    /// enumerator's suffix in lower case.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Replayed => "replayed",
            Outcome::Updated => "updated",
            Outcome::Captured => "captured",
            Outcome::EagerHost => "eager_host",
            Outcome::EagerFallback => "eager_fallback",
            Outcome::Patched => "patched",
        }
    }
}

/// Counters of one device (`xcall_graph_stats` in C).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Calls answered by launching a cached graph.
    pub hits: u64,
    /// Successful captures (each followed by an update or an instantiation).
    pub captures: u64,
    /// Cached executables updated in place (`cuGraphExecUpdate`).
    pub updates: u64,
    /// Exec-updates the driver refused (an instantiation followed).
    pub update_refusals: u64,
    /// Executables instantiated.
    pub instantiations: u64,
    /// Executables evicted by the LRU capacity or the node limit.
    pub evictions: u64,
    /// Executables removed by `invalidate_range` or `clear`.
    pub invalidations: u64,
    /// Calls run directly on the Host platform.
    pub eager_host: u64,
    /// Eager runs because the policy is `Disabled`.
    pub eager_disabled: u64,
    /// Eager runs because the caller's stream was already capturing (the
    /// work went into the caller's capture).
    pub eager_caller_capturing: u64,
    /// Eager runs because another thread was capturing the same key.
    pub eager_capture_in_progress: u64,
    /// Eager runs of a key remembered as not capturable.
    pub eager_not_capturable: u64,
    /// Eager runs after this call's capture failed.
    pub eager_capture_failed: u64,
    /// Graphs currently cached.
    pub entries: u64,
    /// Nodes of the graphs currently cached.
    pub nodes: u64,
    /// Cached executables whose kernels' pointers were moved in place to a
    /// call's new buffers (no capture).
    pub patches: u64,
}
