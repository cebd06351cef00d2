//! Symmetric memory for one process driving many GPUs (one thread per GPU)
//! and for many processes, on Host and CUDA.
//!
//! A world of `n` PEs (processing elements); each PE has a rank and one
//! device given explicitly at init (never the calling thread's current
//! device). PEs meet through a [`bootstrap::Bootstrap`]: threads of one
//! process by group name (SPMT, the JAX/XLA model), processes of one host
//! at a Unix socket, or processes at a TCP address (rank 0's `host:port`,
//! from the launcher's variables: [`launch`]). Each PE owns a symmetric heap; collective
//! [`World::malloc`] gives every PE an object at the same offset, and
//! [`World::ptr`] turns a local address into a peer's. See [`world`] for
//! init and finalize step by step, [`registry`] for per-device state.
//!
//! Transports: Host, same process: plain memory. Host, other process: POSIX
//! shared memory. CUDA, same process: direct device pointers after enabling
//! peer access (never IPC handles inside one process: they fail there).
//! CUDA, other process: CUDA IPC handles. Copies on CUDA use the copy
//! engine (`cuMemcpyAsync` on mapped pointers).
//!
//! # Multi-node (the bootstrap built, the transport planned)
//! A world spanning hosts keeps the same API. Its bootstrap is built: the
//! TCP bootstrap ([`bootstrap::Tcp`], the same star collectives as the
//! Unix socket) with ranks from torchrun, `mpirun` or `srun`
//! ([`launch`]). What is missing is
//! - a transport for peers on other hosts: they are not directly
//!   addressable, so [`World::ptr`] returns `None` for them and put/get go
//!   through a proxy: an NCCL communicator (ncclSend/ncclRecv, or NCCL's
//!   symmetric windows registered at the same heap offset on every rank)
//!   or InfiniBand verbs with the heap registered as one memory region.
//!   Signals become RDMA atomics. Peers on the same host keep the direct
//!   transports; init exchanges (host, pid, device) already and would pick
//!   the transport per pair.
//!
//! Today a peer on another host is refused at init with a clear error.

#![deny(missing_docs)]

pub mod bootstrap;
mod cuda;
mod error;
mod handoff;
pub mod heap;
mod host;
pub mod launch;
pub mod nccl;
pub mod registry;
pub mod world;

pub use error::{Result, ShmemError};
pub use world::{
    BootstrapKind, Cmp, Config, FinalizeReport, Incoming, Outgoing, Pairs, Phase, SignalOp,
    Transport, World, MAX_PES, TRANSPORT_ENV,
};
pub use xcall_core::{Device, Platform};
