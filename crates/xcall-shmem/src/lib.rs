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
//! Transports (per pair, [`World::transport`]): Host, same process:
//! plain memory. Host, other process: POSIX shared memory. CUDA, same
//! process: direct device pointers after enabling peer access (never IPC
//! handles inside one process: they fail there). CUDA, other process: CUDA
//! IPC handles. CUDA, another host (or every pair with [`Pairs::Nccl`]):
//! NCCL ([`nccl`], opened at run time), through [`World::exchange`]. Host,
//! another host (or every other pair with [`Pairs::Tcp`]): TCP connections
//! ([`sockets`]), through [`World::exchange`]. Copies on CUDA use the copy
//! engine (`cuMemcpyAsync` on mapped pointers). Each transport is a module
//! of [`transport`]; the bounds a world holds to are in [`limits`].
//!
//! # Multi-node
//! A world spanning hosts keeps the same API: the TCP bootstrap
//! ([`bootstrap::Tcp`]) with ranks from torchrun, `mpirun` or `srun`
//! ([`launch`]), and for the pairs on other hosts NCCL (CUDA) or TCP
//! connections (Host). Those peers are not addressable: [`World::ptr`]
//! returns `None` for them and data moves with [`World::exchange`], a
//! collective whose NCCL part is one send/receive group. [`HOST_ENV`]
//! names a process's host, so one machine runs the path across hosts.
//! Where every PE's NCCL runs one-sided operations among the world's PEs
//! (NCCL 2.29 and newer), the pairs report [`Transport::NcclOneSided`]:
//! the heap is an NCCL window, and [`World::put`] and
//! [`World::put_signal`] (with [`SignalOp::Set`]) reach those PEs with no
//! call on their side. Still planned: `barrier_on_stream` in a world with
//! NCCL pairs.

#![deny(missing_docs)]

pub mod bootstrap;
mod cuda;
mod error;
pub mod heap;
pub mod launch;
pub mod limits;
pub mod registry;
pub mod transport;
pub mod world;

pub use transport::nccl;
/// The TCP connections of Host pairs ([`transport::tcp`]), by their
/// earlier name.
pub use transport::tcp as sockets;

pub use error::{Result, ShmemError};
pub use transport::host_shared_memory::{host_identity, HOST_ENV};
pub use world::{
    BootstrapKind, Cmp, FinalizeReport, Incoming, Outgoing, Pairs, Phase, SignalOp, Transport,
    World, WorldConfig, MAX_GATHER_BYTES, MAX_PES, TRANSPORT_ENV,
};
pub use xcall_core::{Device, Platform};
