//! What `init` needs, and the small enums of the API.

use std::path::PathBuf;
use std::time::Duration;

use xcall_core::env;
use xcall_core::{Device, Platform};

use super::layout::internal_bytes;
use crate::error::{Result, ShmemError};
use crate::heap::ALIGN;

/// Environment variable with the heap size (when the config gives none): a
/// size as `xcall_core::env` reads it, for example `512M`, `1GiB` or a byte
/// count.
pub const HEAP_ENV: &str = "XCALL_SHMEM_HEAP_BYTES";
/// Default Host heap: 64 MiB per PE.
pub const DEFAULT_HOST_HEAP: usize = 64 << 20;
/// Default CUDA heap: 1 GiB per PE (NVSHMEM's default too).
pub const DEFAULT_CUDA_HEAP: usize = 1 << 30;
/// Default timeout of every wait on other PEs.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How the PEs find each other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BootstrapKind {
    /// Threads of this process, meeting by group name (SPMT).
    InProcess {
        /// The group's name; unique per live world.
        group: String,
    },
    /// Processes of this host, meeting at a Unix domain socket (rank 0
    /// listens at `path`).
    UnixSocket {
        /// Socket path; rank 0 removes it once every PE connected.
        path: PathBuf,
    },
    /// Processes on any hosts, meeting at a TCP address (rank 0 listens
    /// at `address`, `host:port`; see [`crate::launch`] for the launchers'
    /// variables that give it). A CUDA world reaches PEs on other hosts
    /// through NCCL, a Host world through TCP connections.
    Tcp {
        /// `host:port` of rank 0.
        address: String,
    },
}

/// What `init` needs. The device is explicit: never inferred from the
/// calling thread.
#[derive(Clone, Debug)]
pub struct WorldConfig {
    /// This PE's rank in `[0, size)`.
    pub rank: usize,
    /// Number of PEs.
    pub size: usize,
    /// The PE's device: a CUDA device, or on Host any ordinal, which names
    /// the PE's slot in this process's registry (use the rank).
    pub device: Device,
    /// How the PEs meet.
    pub bootstrap: BootstrapKind,
    /// Heap bytes per PE; `None`: [`HEAP_ENV`], else the platform default.
    pub heap_bytes: Option<usize>,
    /// Timeout of every wait on other PEs.
    pub timeout: Duration,
    /// Which transports the pairs take; `None`: [`TRANSPORT_ENV`], else
    /// [`Pairs::Auto`].
    pub pairs: Option<Pairs>,
}

/// Environment variable with the transport policy when the config gives
/// none: `auto`, `nccl` (CUDA) or `tcp` (Host).
pub const TRANSPORT_ENV: &str = "XCALL_SHMEM_TRANSPORT";

/// Which transport each pair of PEs takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairs {
    /// The most direct one: a PE of this process by its address (CUDA:
    /// peer access), a PE of another process on this host by shared
    /// memory or a CUDA IPC handle, a PE on another host through NCCL
    /// (CUDA) or TCP connections (Host, [`crate::sockets`]).
    Auto,
    /// NCCL for every pair, a PE with itself included, so that one host
    /// (or one GPU) runs the path of peers on other hosts. CUDA only.
    Nccl,
    /// TCP connections for every pair but a PE with itself (a plain
    /// copy), so that one host runs the path of Host peers on other
    /// hosts. Host only.
    Tcp,
}

impl Pairs {
    /// `auto`, `nccl` or `tcp`.
    pub fn parse(s: &str) -> Option<Pairs> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Pairs::Auto),
            "nccl" => Some(Pairs::Nccl),
            "tcp" => Some(Pairs::Tcp),
            _ => None,
        }
    }
}

impl WorldConfig {
    /// An SPMT config: PEs are threads meeting in group `group`.
    pub fn in_process(group: &str, rank: usize, size: usize, device: Device) -> WorldConfig {
        WorldConfig {
            rank,
            size,
            device,
            bootstrap: BootstrapKind::InProcess {
                group: group.to_string(),
            },
            heap_bytes: None,
            timeout: DEFAULT_TIMEOUT,
            pairs: None,
        }
    }

    /// A multi-process config: PEs meet at the Unix socket `path`.
    pub fn unix_socket(
        path: impl Into<PathBuf>,
        rank: usize,
        size: usize,
        device: Device,
    ) -> WorldConfig {
        WorldConfig {
            bootstrap: BootstrapKind::UnixSocket { path: path.into() },
            ..WorldConfig::in_process("", rank, size, device)
        }
    }

    /// A multi-process config: PEs meet at TCP `address` (`host:port`),
    /// where rank 0 listens.
    pub fn tcp(address: &str, rank: usize, size: usize, device: Device) -> WorldConfig {
        WorldConfig {
            bootstrap: BootstrapKind::Tcp {
                address: address.to_string(),
            },
            ..WorldConfig::in_process("", rank, size, device)
        }
    }

    /// The transport policy: the config's, else [`TRANSPORT_ENV`]'s, else
    /// auto; NCCL is refused on Host, TCP on CUDA.
    pub(super) fn pairs(&self) -> Result<Pairs> {
        let pairs = match self.pairs {
            Some(p) => p,
            None => match env::text(TRANSPORT_ENV)
                .map_err(|e| ShmemError::InvalidArgument(e.to_string()))?
            {
                None => Pairs::Auto,
                Some(v) => Pairs::parse(&v).ok_or_else(|| {
                    ShmemError::InvalidArgument(format!(
                        "{TRANSPORT_ENV}={v:?} is not a transport policy: auto, nccl (CUDA) or tcp (Host)"
                    ))
                })?,
            },
        };
        if pairs == Pairs::Nccl && self.device.platform != Platform::Cuda {
            return Err(ShmemError::Unsupported(
                "the NCCL transport carries CUDA worlds only; a Host world takes auto or tcp"
                    .into(),
            ));
        }
        if pairs == Pairs::Tcp && self.device.platform != Platform::Host {
            return Err(ShmemError::Unsupported(
                "the TCP transport carries Host worlds only; a CUDA world takes auto or nccl"
                    .into(),
            ));
        }
        Ok(pairs)
    }

    pub(super) fn heap(&self) -> Result<usize> {
        let requested = match self.heap_bytes {
            Some(b) => b,
            None => match env::bytes(HEAP_ENV)
                .map_err(|e| ShmemError::InvalidArgument(e.to_string()))?
            {
                Some(b) => usize::try_from(b).map_err(|_| {
                    ShmemError::InvalidArgument(format!(
                        "{HEAP_ENV}: {b} bytes is larger than an address space"
                    ))
                })?,
                None if self.device.platform == Platform::Cuda => DEFAULT_CUDA_HEAP,
                None => DEFAULT_HOST_HEAP,
            },
        };
        let bytes = requested;
        let internal = internal_bytes(self.size);
        if bytes < internal + ALIGN {
            return Err(ShmemError::InvalidArgument(format!(
                "a heap of {bytes} bytes is too small for {} PEs (at least {} bytes)",
                self.size,
                internal + ALIGN
            )));
        }
        // The heap's end must stay an address: a size near 2^64 cannot be
        // mapped anywhere, and rounding it up must not wrap.
        bytes
            .checked_next_multiple_of(ALIGN)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                ShmemError::InvalidArgument(format!(
                    "a heap of {bytes} bytes is larger than an address space"
                ))
            })
    }
}

/// How `put_signal` updates a signal word.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOp {
    /// `*signal = value`.
    Set = 0,
    /// `*signal += value`.
    Add = 1,
}

xcall_core::c_enum!(SignalOp, "signal op", [Set, Add]);

/// The comparison `wait_until` waits for.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    /// `*signal == value`.
    Eq = 0,
    /// `*signal != value`.
    Ne = 1,
    /// `*signal >= value`.
    Ge = 2,
    /// `*signal > value`.
    Gt = 3,
    /// `*signal <= value`.
    Le = 4,
    /// `*signal < value`.
    Lt = 5,
}

xcall_core::c_enum!(Cmp, "comparison", [Eq, Ne, Ge, Gt, Le, Lt]);

impl Cmp {
    pub(super) fn holds(self, x: u64, v: u64) -> bool {
        match self {
            Cmp::Eq => x == v,
            Cmp::Ne => x != v,
            Cmp::Ge => x >= v,
            Cmp::Gt => x > v,
            Cmp::Le => x <= v,
            Cmp::Lt => x < v,
        }
    }
}

/// What finalize found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FinalizeReport {
    /// Allocations still live at finalize (offset in the heap, bytes),
    /// freed by it: leaks of the program.
    pub leaked: Vec<(usize, usize)>,
}
