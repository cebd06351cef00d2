//! What the cache needs from a GPU platform. Implemented by the CUDA driver
//! ([`crate::cuda::CudaGraphs`]) and by a simulated multi-device backend
//! ([`crate::sim::SimBackend`]) that tests key separation, sharding and
//! eviction without a GPU. The Host platform needs no backend: the cache
//! runs Host calls directly.

use xcall_core::{Device, Result};

/// A stream's identity as the cache sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamState {
    /// The context the stream belongs to (an opaque handle value). Graphs
    /// are only replayed on streams of the context they were captured in.
    pub context: u64,
    /// Whether the stream is already being captured by the caller (a
    /// runtime recording its own command buffer).
    pub capturing: bool,
}

/// Graph capture and replay on one platform. Every method gets the device
/// of the call it serves (for its error messages and checks).
pub trait GraphBackend: Send + Sync + 'static {
    /// A stream handle.
    type Stream: Copy + Send + Sync + std::fmt::Debug;
    /// A captured graph (the template).
    type Graph: Send;
    /// An executable graph; dropping it destroys it.
    type Exec: Send;
    /// What [`GraphBackend::recording`] learns about a capture's work.
    type Launches: Send;
    /// What an executable keeps to have its kernels' pointers moved in
    /// place (for CUDA: the template graph and its recorded launches).
    type Patchable: Send;

    /// The state of `stream`, after checking that it belongs to `device`
    /// (a stream of another device is an error, never a silent replay). A
    /// stream the caller is capturing may be reported as capturing without
    /// further checks: the cache only records work into it.
    fn stream_state(&self, device: Device, stream: Self::Stream) -> Result<StreamState>;
    /// Runs `f` with the stream's context current, restoring the caller's
    /// current context afterwards.
    fn with_context<T>(
        &self,
        device: Device,
        state: &StreamState,
        f: impl FnOnce() -> T,
    ) -> Result<T>;
    /// Starts capturing `stream` (work enqueued on it is recorded, not run).
    fn begin_capture(&self, device: Device, stream: Self::Stream) -> Result<()>;
    /// Ends the capture of `stream`, leaving capture mode in every case; an
    /// error when the driver invalidated the capture.
    fn end_capture(&self, device: Device, stream: Self::Stream) -> Result<Self::Graph>;
    /// Number of nodes of a graph.
    fn node_count(&self, device: Device, graph: &Self::Graph) -> Result<usize>;
    /// Instantiates an executable graph.
    fn instantiate(&self, device: Device, graph: &Self::Graph) -> Result<Self::Exec>;
    /// Updates `exec` in place to run `graph`; `Ok(false)` when the driver
    /// refuses (topology changed).
    fn update(&self, device: Device, exec: &mut Self::Exec, graph: &Self::Graph) -> Result<bool>;
    /// Launches `exec` on `stream`.
    fn launch(&self, device: Device, exec: &Self::Exec, stream: Self::Stream) -> Result<()>;
    /// Runs `f` (the record function, under capture), also returning what
    /// the backend learnt about the work it enqueued.
    fn recording<T>(&self, f: impl FnOnce() -> T) -> (T, Self::Launches);
    /// The patchable form of `graph` (already instantiated) when the
    /// backend knows the parameters of every node of it from `launches`;
    /// `None` when some node is foreign (for CUDA: not a kernel launched
    /// through xcall's launcher).
    fn patchable(
        &self,
        device: Device,
        graph: Self::Graph,
        launches: Self::Launches,
    ) -> Option<Self::Patchable>;
    /// Moves every device pointer `p` held by the nodes of `exec` to
    /// `relocate(p)`, in place. After an error some nodes may have moved
    /// and others not: the executable must not run again.
    fn patch(
        &self,
        device: Device,
        exec: &mut Self::Exec,
        patchable: &mut Self::Patchable,
        relocate: &dyn Fn(u64) -> u64,
    ) -> Result<()>;
}
