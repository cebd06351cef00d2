//! A simulated multi-device backend for tests and benchmarks without a GPU.
//!
//! Each device has its own memory (cells keyed by address). A record
//! function enqueues [`SimOp`]s on a stream with [`SimBackend::enqueue`]:
//! run at once on a plain stream, recorded while the stream is captured.
//! Every launch checks that the executable belongs to the stream's device
//! and context and counts violations, so tests can prove that no graph ever
//! runs on another device.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use xcall_core::{Device, DeviceMap, Error, Result};

use crate::backend::{GraphBackend, StreamState};

/// A simulated stream: the device and context it belongs to, and an id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimStream {
    /// Owning device.
    pub device: Device,
    /// Owning context.
    pub context: u64,
    /// Stream id, unique per backend user.
    pub id: u64,
}

/// One unit of simulated GPU work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimOp {
    /// Adds `value` to the memory cell at `address` of the stream's device.
    Add {
        /// Cell address.
        address: u64,
        /// Amount added.
        value: i64,
    },
    /// An `Add` the backend cannot patch (like a kernel not launched
    /// through xcall's launcher, whose parameters are unknown).
    Foreign {
        /// Cell address.
        address: u64,
        /// Amount added.
        value: i64,
    },
    /// Work the driver refuses to capture (like a synchronous allocation):
    /// runs normally outside capture, invalidates a capture.
    Uncapturable,
    /// Captures fine, but a graph holding it cannot be instantiated (like
    /// a driver running out of resources); does nothing when run.
    FailsInstantiate,
}

/// A captured simulated graph.
#[derive(Debug)]
pub struct SimGraph {
    device: Device,
    context: u64,
    ops: Vec<SimOp>,
}

/// An executable simulated graph.
#[derive(Debug)]
pub struct SimExec {
    device: Device,
    context: u64,
    ops: Vec<SimOp>,
}

/// One simulated device: its memory and its launch counter.
#[derive(Default)]
struct SimDevice {
    memory: Mutex<HashMap<u64, i64>>,
    launches: AtomicU64,
}

#[derive(Default)]
struct Capture {
    ops: Vec<SimOp>,
    invalid: bool,
}

/// The simulated backend. Thread-safe; devices share no state, like real
/// GPUs (so per-device scaling can be measured on it).
#[derive(Default)]
pub struct SimBackend {
    devices: DeviceMap<SimDevice>,
    captures: Mutex<HashMap<SimStream, Capture>>,
    caller_captures: Mutex<HashSet<SimStream>>,
    /// Number of caller captures open: lets `stream_state` skip the lock
    /// (shared by all devices) when there are none.
    open_caller_captures: AtomicU64,
    violations: AtomicU64,
}

impl SimBackend {
    /// A backend with empty memory.
    pub fn new() -> Self {
        Self::default()
    }

    fn device(&self, device: Device) -> &SimDevice {
        self.devices.get_or_init(device, SimDevice::default)
    }

    fn run(&self, device: Device, ops: &[SimOp]) {
        if ops.is_empty() {
            return;
        }
        let mut memory = self
            .device(device)
            .memory
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for op in ops {
            if let SimOp::Add { address, value } | SimOp::Foreign { address, value } = *op {
                *memory.entry(address).or_insert(0) += value;
            }
        }
    }

    /// Enqueues `op` on `stream`: recorded if the stream is being captured,
    /// run at once otherwise.
    pub fn enqueue(&self, stream: SimStream, op: SimOp) {
        {
            let mut captures = self.captures.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(capture) = captures.get_mut(&stream) {
                if op == SimOp::Uncapturable {
                    capture.invalid = true;
                } else {
                    capture.ops.push(op);
                }
                return;
            }
        }
        self.run(stream.device, &[op]);
    }

    /// The value of a memory cell of `device` (0 when never written).
    pub fn read(&self, device: Device, address: u64) -> i64 {
        let memory = self
            .device(device)
            .memory
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        memory.get(&address).copied().unwrap_or(0)
    }

    /// Launches of an executable on a stream of another device or context.
    pub fn violations(&self) -> u64 {
        self.violations.load(Ordering::SeqCst)
    }

    /// Graph launches so far, over all devices.
    pub fn launches(&self) -> u64 {
        self.devices
            .iter()
            .map(|(_, d)| d.launches.load(Ordering::SeqCst))
            .sum()
    }

    /// Simulates the caller (a runtime) capturing `stream` itself: work
    /// enqueued meanwhile is recorded into the caller's capture.
    pub fn begin_caller_capture(&self, stream: SimStream) {
        if self
            .caller_captures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(stream)
        {
            self.open_caller_captures.fetch_add(1, Ordering::SeqCst);
        }
        self.captures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(stream, Capture::default());
    }

    /// Ends the caller's capture and returns the ops recorded into it.
    pub fn end_caller_capture(&self, stream: SimStream) -> Vec<SimOp> {
        if self
            .caller_captures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&stream)
        {
            self.open_caller_captures.fetch_sub(1, Ordering::SeqCst);
        }
        let mut captures = self.captures.lock().unwrap_or_else(|p| p.into_inner());
        captures.remove(&stream).map(|c| c.ops).unwrap_or_default()
    }
}

impl GraphBackend for SimBackend {
    type Stream = SimStream;
    type Graph = SimGraph;
    type Exec = SimExec;
    type Launches = ();
    /// An executable of `Add`s only: their addresses are its pointers.
    type Patchable = ();

    fn stream_state(&self, device: Device, stream: SimStream) -> Result<StreamState> {
        if stream.device != device {
            return Err(Error::InvalidArgument(format!(
                "the stream belongs to {}, the call names {device}",
                stream.device
            )));
        }
        let capturing = self.open_caller_captures.load(Ordering::SeqCst) > 0
            && self
                .caller_captures
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&stream);
        Ok(StreamState {
            context: stream.context,
            capturing,
        })
    }

    fn with_context<T>(
        &self,
        _device: Device,
        _state: &StreamState,
        f: impl FnOnce() -> T,
    ) -> Result<T> {
        Ok(f())
    }

    fn begin_capture(&self, _device: Device, stream: SimStream) -> Result<()> {
        let mut captures = self.captures.lock().unwrap_or_else(|p| p.into_inner());
        if captures.contains_key(&stream) {
            return Err(Error::InvalidArgument("stream is already capturing".into()));
        }
        captures.insert(stream, Capture::default());
        Ok(())
    }

    fn end_capture(&self, _device: Device, stream: SimStream) -> Result<SimGraph> {
        let capture = self
            .captures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&stream)
            .ok_or_else(|| Error::InvalidArgument("stream is not capturing".into()))?;
        if capture.invalid {
            return Err(Error::Unsupported(
                "capture invalidated by uncapturable work".into(),
            ));
        }
        Ok(SimGraph {
            device: stream.device,
            context: stream.context,
            ops: capture.ops,
        })
    }

    fn node_count(&self, _device: Device, graph: &SimGraph) -> Result<usize> {
        Ok(graph.ops.len())
    }

    fn instantiate(&self, _device: Device, graph: &SimGraph) -> Result<SimExec> {
        if graph.ops.contains(&SimOp::FailsInstantiate) {
            return Err(Error::Unsupported("simulated instantiation failure".into()));
        }
        Ok(SimExec {
            device: graph.device,
            context: graph.context,
            ops: graph.ops.clone(),
        })
    }

    fn update(&self, _device: Device, exec: &mut SimExec, graph: &SimGraph) -> Result<bool> {
        // Like cuGraphExecUpdate: same device and context, same node count.
        if exec.device != graph.device
            || exec.context != graph.context
            || exec.ops.len() != graph.ops.len()
        {
            return Ok(false);
        }
        exec.ops.clone_from(&graph.ops);
        Ok(true)
    }

    fn launch(&self, _device: Device, exec: &SimExec, stream: SimStream) -> Result<()> {
        if exec.device != stream.device || exec.context != stream.context {
            self.violations.fetch_add(1, Ordering::SeqCst);
            return Err(Error::InvalidArgument(format!(
                "graph of {} launched on a stream of {}",
                exec.device, stream.device
            )));
        }
        self.device(stream.device)
            .launches
            .fetch_add(1, Ordering::Relaxed);
        self.run(stream.device, &exec.ops);
        Ok(())
    }

    fn recording<T>(&self, f: impl FnOnce() -> T) -> (T, ()) {
        (f(), ())
    }

    fn patchable(&self, _device: Device, graph: SimGraph, _launches: ()) -> Option<()> {
        graph
            .ops
            .iter()
            .all(|op| matches!(op, SimOp::Add { .. }))
            .then_some(())
    }

    fn patch(
        &self,
        _device: Device,
        exec: &mut SimExec,
        _patchable: &mut (),
        relocate: &dyn Fn(u64) -> u64,
    ) -> Result<()> {
        for op in &mut exec.ops {
            if let SimOp::Add { address, .. } = op {
                *address = relocate(*address);
            }
        }
        Ok(())
    }
}
