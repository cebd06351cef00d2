//! A thin layer over the driver's graphs: a captured [`Graph`] and its
//! executable [`GraphExec`], destroyed on drop, with the calls xcall's graph
//! cache drives (count and list nodes, instantiate, update in place, set a
//! kernel node's parameters). Capture and launch are on
//! [`Stream`](super::Stream).
//!
//! Like [`Stream`](super::Stream)'s, these calls switch no context: the
//! caller has the graph's context current where the driver needs it.

use cudarc::driver::sys;

use super::{available, check};
use crate::{Device, Result};

/// A graph node handle (`CUgraphNode`), as a captured launch records it.
pub type RawGraphNode = sys::CUgraphNode;

/// A graph, destroyed on drop.
#[derive(Debug)]
pub struct Graph(sys::CUgraph);

// SAFETY: a graph is used from one thread at a time by whoever owns it; the
// handle itself is valid from any thread.
unsafe impl Send for Graph {}

impl Graph {
    /// Takes ownership of `raw`.
    ///
    /// # Safety
    /// `raw` is a live graph that nothing else destroys.
    pub(crate) unsafe fn from_raw(raw: sys::CUgraph) -> Graph {
        Graph(raw)
    }

    /// How many nodes the graph has (`cuGraphGetNodes` with no array).
    pub fn node_count(&self, device: Device) -> Result<usize> {
        available()?;
        let mut n = 0usize;
        // SAFETY: with a NULL node array the call only writes the count.
        check("cuGraphGetNodes", device, unsafe {
            sys::cuGraphGetNodes(self.0, std::ptr::null_mut(), &mut n)
        })?;
        Ok(n)
    }

    /// At most `capacity` of the graph's nodes (`cuGraphGetNodes`), as many
    /// as the driver wrote.
    pub fn nodes(&self, device: Device, capacity: usize) -> Result<Vec<RawGraphNode>> {
        available()?;
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); capacity];
        let mut n = capacity;
        // SAFETY: the array holds `capacity` nodes; the driver writes at
        // most that many and the count of the graph's nodes.
        check("cuGraphGetNodes", device, unsafe {
            sys::cuGraphGetNodes(self.0, nodes.as_mut_ptr(), &mut n)
        })?;
        nodes.truncate(n.min(capacity));
        Ok(nodes)
    }

    /// An executable of the graph (`cuGraphInstantiateWithFlags`, no
    /// flags).
    pub fn instantiate(&self, device: Device) -> Result<GraphExec> {
        self.instantiate_with(device, InstantiateFlags::default())
    }

    /// An executable of the graph with `flags`.
    pub fn instantiate_with(&self, device: Device, flags: InstantiateFlags) -> Result<GraphExec> {
        available()?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: instantiates a live graph; writes one handle.
        check("cuGraphInstantiate", device, unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, self.0, flags.bits())
        })?;
        Ok(GraphExec(exec))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: the handle is owned and destroyed once.
        let _ = unsafe { sys::cuGraphDestroy(self.0) };
    }
}

/// The launch shape a kernel node of a graph holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelNodeShape {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block in bytes.
    pub shared_bytes: u32,
}

/// The launch shape of the kernel node `node` (`cuGraphKernelNodeGetParams`):
/// what a captured launch recorded (see
/// [`RecordedLaunch::node`](super::RecordedLaunch::node)). A node that is not
/// a kernel node is the driver's error.
///
/// # Safety
/// `node` is a node of a live graph.
pub unsafe fn kernel_node_shape(device: Device, node: RawGraphNode) -> Result<KernelNodeShape> {
    available()?;
    // SAFETY: plain data the driver fills in.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's contract on `node`; writes the parameters.
    check("cuGraphKernelNodeGetParams", device, unsafe {
        sys::cuGraphKernelNodeGetParams_v2(node, &mut p)
    })?;
    Ok(KernelNodeShape {
        grid: (p.gridDimX, p.gridDimY, p.gridDimZ),
        block: (p.blockDimX, p.blockDimY, p.blockDimZ),
        shared_bytes: p.sharedMemBytes,
    })
}

/// Flags of [`Graph::instantiate_with`] (`CUgraphInstantiate_flags`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InstantiateFlags {
    /// Free the graph's stream-ordered allocations that are still live
    /// when it is launched again (`AUTO_FREE_ON_LAUNCH`).
    pub auto_free_on_launch: bool,
    /// Launch each kernel node at the priority it was captured with (its
    /// stream's) instead of the priority of the stream the graph is
    /// launched on (`USE_NODE_PRIORITY`).
    pub use_node_priority: bool,
}

impl InstantiateFlags {
    /// The driver's value, for APIs that take it (cudarc's
    /// `CudaStream::end_capture`).
    pub fn driver(self) -> sys::CUgraphInstantiate_flags {
        sys::CUgraphInstantiate_flags(self.bits() as _)
    }

    fn bits(self) -> u64 {
        let mut bits = 0u64;
        if self.auto_free_on_launch {
            bits |= u64::from(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0,
            );
        }
        if self.use_node_priority {
            bits |= u64::from(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0,
            );
        }
        bits
    }
}

/// An executable graph, destroyed on drop.
#[derive(Debug)]
pub struct GraphExec(sys::CUgraphExec);

// SAFETY: the owner serialises every use of an executable, as the driver
// requires for graph objects; the handle is valid from any thread.
unsafe impl Send for GraphExec {}

impl GraphExec {
    /// The raw handle, for [`RecordedLaunch::set_in_exec`](super::RecordedLaunch::set_in_exec).
    pub fn raw(&self) -> sys::CUgraphExec {
        self.0
    }

    /// Updates the executable in place to `graph`'s topology and
    /// parameters (`cuGraphExecUpdate`): `Ok(true)` when updated,
    /// `Ok(false)` when the driver refuses the update
    /// (`CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE`; instantiate anew), an error
    /// for any other failure.
    pub fn update(&mut self, device: Device, graph: &Graph) -> Result<bool> {
        available()?;
        // SAFETY: the result info is plain data the driver fills in.
        let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
        // SAFETY: both handles are live; `&mut self` keeps other users out.
        let r = unsafe { sys::cuGraphExecUpdate_v2(self.0, graph.0, &mut info) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => Ok(false),
            other => check("cuGraphExecUpdate", device, other).map(|()| false),
        }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: the handle is owned and destroyed once.
        let _ = unsafe { sys::cuGraphExecDestroy(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instantiate_flags_are_the_driver_bits() {
        assert_eq!(InstantiateFlags::default().bits(), 0);
        let auto = InstantiateFlags {
            auto_free_on_launch: true,
            ..InstantiateFlags::default()
        };
        // The driver's values (cuda.h): 1 and 8.
        assert_eq!(auto.bits(), 1);
        let priority = InstantiateFlags {
            use_node_priority: true,
            ..InstantiateFlags::default()
        };
        assert_eq!(priority.bits(), 8);
        let both = InstantiateFlags {
            auto_free_on_launch: true,
            use_node_priority: true,
        };
        assert_eq!(both.bits(), 9);
    }
}
