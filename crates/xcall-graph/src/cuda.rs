//! The CUDA backend: stream capture, instantiation, exec-update and launch
//! through the driver API.

use xcall_core::cuda::{self, check, ContextGuard, RecordedLaunch};
use xcall_core::{Device, Error, Result};

use cudarc::driver::sys;

use crate::backend::{GraphBackend, StreamState};

/// A CUDA stream handle (`CUstream`) as the caller gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaStreamHandle(pub sys::CUstream);

// SAFETY: a CUstream is an opaque driver handle; the driver API accepts it
// from any thread.
unsafe impl Send for CudaStreamHandle {}
// SAFETY: as above; the handle is only passed to driver calls.
unsafe impl Sync for CudaStreamHandle {}

/// A captured graph; destroyed on drop.
#[derive(Debug)]
pub struct CudaGraph(sys::CUgraph);

// SAFETY: the cache uses a graph from one thread at a time.
unsafe impl Send for CudaGraph {}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuStreamEndCapture and is destroyed once.
        let _ = unsafe { sys::cuGraphDestroy(self.0) };
    }
}

/// An executable graph; destroyed on drop.
#[derive(Debug)]
pub struct CudaExec(sys::CUgraphExec);

// SAFETY: the cache serialises every use of an executable under its
// device's lock, as the driver requires for graph objects.
unsafe impl Send for CudaExec {}

impl Drop for CudaExec {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuGraphInstantiate and is destroyed once.
        let _ = unsafe { sys::cuGraphExecDestroy(self.0) };
    }
}

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
        let ordinal = cuda::check_device(device)?;
        if stream.0.is_null() {
            return Err(Error::InvalidArgument(
                "the legacy default stream (NULL) cannot be captured; pass a created stream".into(),
            ));
        }
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: writes one value; cuStreamIsCapturing is legal on a
        // stream under capture.
        check("cuStreamIsCapturing", device, unsafe {
            sys::cuStreamIsCapturing(stream.0, &mut status)
        })?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
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
        let mut dev: sys::CUdevice = 0;
        let mut expected: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: each call writes one value through a valid pointer; the
        // stream handle is the caller's and is only queried.
        unsafe {
            check(
                "cuStreamGetDevice",
                device,
                sys::cuStreamGetDevice(stream.0, &mut dev),
            )?;
            check(
                "cuDeviceGet",
                device,
                sys::cuDeviceGet(&mut expected, ordinal as i32),
            )?;
            check(
                "cuStreamGetCtx",
                device,
                sys::cuStreamGetCtx(stream.0, &mut ctx),
            )?;
        }
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
        let ctx = state.context as sys::CUcontext;
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
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: begins capture on a valid, non-capturing stream.
        check("cuStreamBeginCapture", device, unsafe {
            sys::cuStreamBeginCapture_v2(stream.0, mode)
        })
    }

    fn end_capture(&self, device: Device, stream: CudaStreamHandle) -> Result<CudaGraph> {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun by begin_capture; always leaves
        // capture mode, returning an error when the capture was invalidated.
        let r = unsafe { sys::cuStreamEndCapture(stream.0, &mut graph) };
        let owned = (!graph.is_null()).then_some(CudaGraph(graph));
        check("cuStreamEndCapture", device, r)?;
        owned.ok_or_else(|| Error::Unsupported("stream capture produced no graph".into()))
    }

    fn node_count(&self, device: Device, graph: &CudaGraph) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: with a NULL node array the call only writes the count.
        check("cuGraphGetNodes", device, unsafe {
            sys::cuGraphGetNodes(graph.0, std::ptr::null_mut(), &mut n)
        })?;
        Ok(n)
    }

    fn instantiate(&self, device: Device, graph: &CudaGraph) -> Result<CudaExec> {
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: instantiates a valid graph; writes one handle.
        check("cuGraphInstantiate", device, unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0)
        })?;
        Ok(CudaExec(exec))
    }

    fn update(&self, device: Device, exec: &mut CudaExec, graph: &CudaGraph) -> Result<bool> {
        // SAFETY: the result info is plain data the driver fills in.
        let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
        // SAFETY: both handles are valid; the executable is not in use by
        // another thread (the cache holds the device's lock).
        let r = unsafe { sys::cuGraphExecUpdate_v2(exec.0, graph.0, &mut info) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => Ok(false),
            other => check("cuGraphExecUpdate", device, other).map(|()| false),
        }
    }

    fn launch(&self, device: Device, exec: &CudaExec, stream: CudaStreamHandle) -> Result<()> {
        // SAFETY: the executable was instantiated in the stream's context
        // (the cache only replays within one context).
        check("cuGraphLaunch", device, unsafe {
            sys::cuGraphLaunch(exec.0, stream.0)
        })
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
        let mut n = self.node_count(device, &graph).ok()?;
        if n != launches.len() || n == 0 {
            return None;
        }
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: the array holds `n` nodes; the driver writes at most that
        // many and the count it wrote.
        let r = unsafe { sys::cuGraphGetNodes(graph.0, nodes.as_mut_ptr(), &mut n) };
        if r != sys::CUresult::CUDA_SUCCESS || n != launches.len() {
            return None;
        }
        // Every node is one recorded launch (distinct nodes, as many as
        // launches): nothing in the graph is foreign.
        nodes.sort();
        let mut recorded: Vec<sys::CUgraphNode> = launches.iter().map(|l| l.node()).collect();
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
            unsafe { launch.set_in_exec(device, exec.0, params) }?;
        }
        Ok(())
    }
}
