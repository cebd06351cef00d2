//! How a PE reaches its peers, one module per transport: the pairs of
//! one process ([`same_process`]), Host heaps of other processes
//! ([`host_shared_memory`]), CUDA heaps of other processes
//! ([`cuda_ipc`]), TCP connections between Host PEs ([`tcp`]), and NCCL
//! between CUDA PEs ([`nccl`]).

pub(crate) mod cuda_ipc;
pub(crate) mod host_shared_memory;
pub mod nccl;
pub(crate) mod same_process;
pub mod tcp;

/// How this PE reaches a peer's heap (a read-only fact for tests and
/// diagnostics: [`World::transport`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// This PE itself, or a PE of this process: the peer's address as is
    /// (on CUDA with peer access enabled), never IPC.
    SameProcess,
    /// Host heap of another process, mapped from POSIX shared memory.
    HostSharedMemory,
    /// CUDA heap of another process, opened from its IPC handle.
    CudaIpc,
    /// A PE on another host, or any PE when NCCL is forced
    /// ([`crate::Pairs::Nccl`]): not mapped; data moves with [`crate::World::exchange`]
    /// (NCCL send/receive groups).
    Nccl,
    /// As [`Transport::Nccl`], and the loaded NCCL runs one-sided puts on
    /// the world's communicator (NCCL 2.29 and newer, the heap registered
    /// as its window): [`crate::World::put`] and [`crate::World::put_signal`] (with
    /// [`crate::SignalOp::Set`]) reach the PE with no call on its side. Gets and
    /// signal adds still need [`crate::World::exchange`].
    NcclOneSided,
    /// Host: a PE on another host, or any other PE when TCP is forced
    /// ([`crate::Pairs::Tcp`]): not mapped; data moves with [`crate::World::exchange`]
    /// over a TCP connection of the pair ([`tcp`]).
    Tcp,
}

impl Transport {
    /// Whether NCCL carries the pair ([`Transport::Nccl`] or
    /// [`Transport::NcclOneSided`]).
    pub fn is_nccl(self) -> bool {
        matches!(self, Transport::Nccl | Transport::NcclOneSided)
    }

    /// The transport's name in log lines (`cuda_ipc`).
    pub const fn name(self) -> &'static str {
        match self {
            Transport::SameProcess => "same_process",
            Transport::HostSharedMemory => "host_shared_memory",
            Transport::CudaIpc => "cuda_ipc",
            Transport::Nccl => "nccl",
            Transport::NcclOneSided => "nccl_one_sided",
            Transport::Tcp => "tcp",
        }
    }
}
