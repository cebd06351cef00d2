//! The CUDA backend: stream capture, instantiation, exec-update and launch
//! through the driver API.

use xcall_core::cuda::{
    self, CaptureMode, ContextGuard, Graph, GraphExec, InstantiateFlags, RawStream, RecordedLaunch,
    Stream,
};
use xcall_core::{Device, Error, Result};

use crate::backend::{GraphBackend, StreamState};

/// A CUDA stream handle (`CUstream`) as the caller gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaStreamHandle(pub RawStream);

// SAFETY: a CUstream is an opaque driver handle; the driver API accepts it
// from any thread.
unsafe impl Send for CudaStreamHandle {}
// SAFETY: as above; the handle is only passed to driver calls.
unsafe impl Sync for CudaStreamHandle {}

impl CudaStreamHandle {
    /// The handle as a stream of `device`.
    fn on(self, device: Device) -> Stream {
        // SAFETY: the caller's stream, live for the cache call it came with
        // (the cache's contract with its caller); borrowed for that call.
        unsafe { Stream::from_raw(device, self.0) }
    }
}

/// A captured graph; destroyed on drop.
pub type CudaGraph = Graph;

/// An executable graph; destroyed on drop. The cache serialises every use
/// of an executable under its device's lock, as the driver requires for
/// graph objects.
pub type CudaExec = GraphExec;

/// A captured graph made only of kernels launched through xcall's launcher,
/// kept with their recorded launches: the executable instantiated from it
/// can have its kernels' pointers moved in place
/// (`cuGraphExecKernelNodeSetParams`), with no new capture.
#[derive(Debug)]
pub struct CudaPatchable {
    // The launches' nodes belong to the graph: it lives as long as they do.
    launches: Vec<RecordedLaunch>,
    _graph: CudaGraph,
}

/// The CUDA driver backend. Holding it loads nothing; the driver is loaded
/// by the first CUDA call.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaGraphs;

impl GraphBackend for CudaGraphs {
    type Stream = CudaStreamHandle;
    type Graph = CudaGraph;
    type Exec = CudaExec;
    type Launches = Vec<RecordedLaunch>;
    type Patchable = CudaPatchable;

    fn stream_state(&self, device: Device, stream: CudaStreamHandle) -> Result<StreamState> {
        cuda::check_device(device)?;
        if stream.0.is_null() {
            return Err(Error::InvalidArgument(
                "the legacy default stream (NULL) cannot be captured; pass a created stream".into(),
            ));
        }
        let stream = stream.on(device);
        // cuStreamIsCapturing is legal on a stream under capture.
        if stream.is_capturing()? {
            // The caller is recording its own graph: any further query could
            // invalidate that capture, and the cache will only record the
            // work into it (nothing is cached or launched), so stop here.
            return Ok(StreamState {
                context: 0,
                capturing: true,
            });
        }
        // Cached executables live in the device's context: keep it alive.
        cuda::retain_primary_context(device)?;
        // The stream handle is the caller's and is only queried.
        let dev = stream.driver_device()?;
        let expected = cuda::driver_device(device)?;
        let ctx = stream.context()?;
        if dev != expected {
            return Err(Error::InvalidArgument(format!(
                "the stream belongs to another device than {device} (CUdevice {dev})"
            )));
        }
        Ok(StreamState {
            context: ctx as u64,
            capturing: false,
        })
    }

    fn with_context<T>(
        &self,
        device: Device,
        state: &StreamState,
        f: impl FnOnce() -> T,
    ) -> Result<T> {
        let ctx = state.context as usize as cuda::RawContext;
        // SAFETY: the context is the caller's stream's own, alive while the
        // stream is; the guard restores the caller's context after `f`, also
        // when `f` panics.
        let guard = unsafe { ContextGuard::enter(device, ctx) }?;
        let value = f();
        guard.restore()?;
        Ok(value)
    }

    fn begin_capture(&self, device: Device, stream: CudaStreamHandle) -> Result<()> {
        // Thread-local mode: only this thread's unsafe calls are refused
        // during the capture, other threads (other devices) are unaffected.
        stream.on(device).begin_capture(CaptureMode::ThreadLocal)
    }

    fn end_capture(&self, device: Device, stream: CudaStreamHandle) -> Result<CudaGraph> {
        // Ends the capture begun by begin_capture; always leaves capture
        // mode, returning an error when the capture was invalidated.
        stream.on(device).end_capture()
    }

    fn node_count(&self, device: Device, graph: &CudaGraph) -> Result<usize> {
        graph.node_count(device)
    }

    fn instantiate(&self, device: Device, graph: &CudaGraph) -> Result<CudaExec> {
        // A replay launches each kernel at its captured stream's priority,
        // as the eager calls it recorded ran (work forked onto a stream of
        // greater priority keeps it).
        let flags = InstantiateFlags {
            use_node_priority: true,
            ..InstantiateFlags::default()
        };
        graph.instantiate_with(device, flags)
    }

    fn update(&self, device: Device, exec: &mut CudaExec, graph: &CudaGraph) -> Result<bool> {
        // The executable is not in use by another thread (the cache holds
        // the device's lock).
        exec.update(device, graph)
    }

    fn launch(&self, device: Device, exec: &CudaExec, stream: CudaStreamHandle) -> Result<()> {
        // The executable was instantiated in the stream's context (the
        // cache only replays within one context).
        stream.on(device).launch_graph(exec)
    }

    fn recording<T>(&self, f: impl FnOnce() -> T) -> (T, Vec<RecordedLaunch>) {
        cuda::recording_launches(f)
    }

    fn patchable(
        &self,
        device: Device,
        graph: CudaGraph,
        launches: Vec<RecordedLaunch>,
    ) -> Option<CudaPatchable> {
        let n = self.node_count(device, &graph).ok()?;
        if n != launches.len() || n == 0 {
            return None;
        }
        let mut nodes = graph.nodes(device, n).ok()?;
        if nodes.len() != launches.len() {
            return None;
        }
        // Every node is one recorded launch (distinct nodes, as many as
        // launches): nothing in the graph is foreign.
        nodes.sort();
        let mut recorded: Vec<cuda::RawGraphNode> = launches.iter().map(|l| l.node()).collect();
        recorded.sort();
        recorded.dedup();
        (recorded == nodes).then_some(CudaPatchable {
            launches,
            _graph: graph,
        })
    }

    fn patch(
        &self,
        device: Device,
        exec: &mut CudaExec,
        patchable: &mut CudaPatchable,
        relocate: &dyn Fn(u64) -> u64,
    ) -> Result<()> {
        for launch in &mut patchable.launches {
            let params = launch.params.relocated(relocate);
            // SAFETY: `exec` was instantiated from the graph the launch was
            // recorded into (kept alive by `patchable`), and the cache holds
            // the device's lock; the relocated pointers are the new call's
            // buffers at the offsets the old call's pointers had (the
            // caller's promise for the call's buffers).
            unsafe { launch.set_in(device, exec, params) }?;
        }
        Ok(())
    }
}
