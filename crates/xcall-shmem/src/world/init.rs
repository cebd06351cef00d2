//! Init, step by step (see the module docs of [`super`]): the checks and
//! the device binding (1), the bootstrap (2), then the steps of the
//! modules named in each, and the internal region (7).

use std::sync::Arc;
use std::time::Instant;

use xcall_core::Platform;

use super::agreement::{agree, fields};
use super::config::{BootstrapKind, Pairs, WorldConfig};
use super::connections::{all_say, connect_nccl, connect_tcp, one_sided_nccl};
use super::identities::exchange_identities;
use super::layout::internal_bytes;
use super::live::{Live, Memory};
use super::peers::map_peers;
use super::state::{state_page, unique, StatePage};
use crate::bootstrap::{Bootstrap, InProcess, Logged, Tcp, UnixSocket};
use crate::error::{Result, ShmemError};
use crate::heap::Allocator;
use crate::limits::MAX_PES;
use crate::registry;
use crate::transport::cuda_ipc::DeviceHeap;
use crate::transport::host_shared_memory::{host_identity, HostHeap};
use crate::transport::same_process as handoff;
use crate::transport::Transport;

/// The target of the init log lines: the module path they have always
/// had, so log filters keep selecting them.
const LOG_TARGET: &str = "xcall_shmem::world::live";

/// Step 4's heap (collective: agreed on): Host, one process: anonymous
/// memory; Host, a peer in another process (`ipc`): POSIX shared memory;
/// CUDA: the driver's memory (plus its IPC handle with `ipc`), or NCCL's
/// (`one_sided`). Returns the heap, its base and what peers of other
/// processes open it by (a shared-memory name, an IPC handle in hex).
fn allocate_heap(
    boot: &mut dyn Bootstrap,
    c: &WorldConfig,
    len: usize,
    ipc: bool,
    one_sided: bool,
) -> Result<(Arc<Memory>, u64, String)> {
    let shm_name = format!("/xcall-{}-{}-{}", std::process::id(), c.rank, unique());
    let memory = match c.device.platform {
        Platform::Host if ipc => HostHeap::shared(&shm_name, len).map(Memory::Host),
        Platform::Host => HostHeap::private(len).map(Memory::Host),
        Platform::Cuda if one_sided => DeviceHeap::through_nccl(c.device, len).map(Memory::Cuda),
        Platform::Cuda => DeviceHeap::new(c.device, len).map(Memory::Cuda),
    };
    let memory = Arc::new(agree(boot, memory)?);
    let (base, export) = match &*memory {
        Memory::Host(h) => (h.base, shm_name),
        Memory::Cuda(d) => {
            let handle = if ipc {
                agree(boot, d.ipc_handle())?
            } else {
                agree(boot, Ok(Vec::new()))?
            };
            (d.base, handle.iter().map(|b| format!("{b:02x}")).collect())
        }
    };
    Ok((memory, base, export))
}

impl Live {
    /// The checks and the device binding before a PE joins its bootstrap:
    /// (heap bytes, binding, the bootstrap's name).
    fn before_joining(c: &WorldConfig) -> Result<(usize, registry::Binding, String)> {
        if c.size == 0 || c.rank >= c.size {
            return Err(ShmemError::InvalidArgument(format!(
                "rank {} is not in a world of {} PE(s)",
                c.rank, c.size
            )));
        }
        if c.size > MAX_PES {
            return Err(ShmemError::InvalidArgument(format!(
                "a world of {} PEs is larger than the limit of {MAX_PES}",
                c.size
            )));
        }
        if c.timeout.is_zero() {
            return Err(ShmemError::InvalidArgument(
                "timeout must be above zero".into(),
            ));
        }
        let len = c.heap()?;
        c.pairs()?;
        host_identity()?;
        if c.device.platform == Platform::Cuda {
            c.device.validate()?;
        }
        let name = match &c.bootstrap {
            BootstrapKind::InProcess { group } => format!("group {group}"),
            BootstrapKind::UnixSocket { path } => format!("socket {}", path.display()),
            BootstrapKind::Tcp { address } => format!("tcp {address}"),
        };
        let binding = registry::bind(c.device, &name, c.rank)?;
        Ok((len, binding, name))
    }

    pub(super) fn init(c: &WorldConfig) -> Result<Live> {
        let (len, binding, name) = Self::before_joining(c).inspect_err(|e| {
            if let BootstrapKind::InProcess { group } = &c.bootstrap {
                // Its peers learn at once that this rank will never join
                // (every failure after the join reaches them collectively).
                crate::bootstrap::abandon(group, c.rank, c.size, c.timeout, &e.to_string());
            }
        })?;
        let started = Instant::now();
        let step = |what: &str| {
            tracing::debug!(
                target: LOG_TARGET,
                bootstrap = name.as_str(),
                rank = c.rank,
                size = c.size,
                ms = %format_args!("{:.3}", started.elapsed().as_secs_f64() * 1e3),
                "init: {what}"
            )
        };
        // A failure here is logged by World::init, like every init failure.
        let joined: Box<dyn Bootstrap> = match &c.bootstrap {
            BootstrapKind::InProcess { group } => {
                Box::new(InProcess::join(group, c.rank, c.size, c.timeout)?)
            }
            BootstrapKind::UnixSocket { path } => {
                Box::new(UnixSocket::connect(path, c.rank, c.size, c.timeout)?)
            }
            BootstrapKind::Tcp { address } => {
                Box::new(Tcp::connect(address, c.rank, c.size, c.timeout)?)
            }
        };
        let mut boot: Box<dyn Bootstrap> = Box::new(Logged::new(joined, name.clone()));
        step("bootstrap joined");

        // 3. identities.
        let pairs = c.pairs()?;
        let (ids, devices) = exchange_identities(boot.as_mut(), c, len, pairs)?;
        step("identities exchanged");
        let same_host = |r: usize| ids[r][0] == ids[c.rank][0];
        let same_process = |r: usize| same_host(r) && ids[r][1] == ids[c.rank][1];
        // Pairs across hosts take the platform's remote transport (CUDA:
        // NCCL, Host: TCP), and every pair when one is forced (NCCL a PE
        // with itself too).
        let remote = |r: usize| match pairs {
            Pairs::Auto => !same_host(r),
            Pairs::Nccl => true,
            Pairs::Tcp => r != c.rank,
        };
        let by_nccl = |r: usize| remote(r) && c.device.platform == Platform::Cuda;
        let by_tcp = |r: usize| remote(r) && c.device.platform == Platform::Host;
        let cross = (0..c.size).any(|r| same_host(r) && !same_process(r));
        // Some peer of another process maps this heap.
        let ipc = (0..c.size).any(|r| same_host(r) && !same_process(r) && !remote(r));

        // One-sided puts through NCCL are tried when some pair takes NCCL,
        // no pair maps the heap through IPC (NCCL's memory, which its
        // windows need, has no IPC handle) and every PE's NCCL has them.
        let nccl_pairs = (0..c.size).any(by_nccl);
        let try_one_sided = nccl_pairs && !ipc && one_sided_nccl();
        let try_one_sided = all_say(boot.as_mut(), try_one_sided)?;

        // 4. the state page of this host's PEs (its lowest rank makes it),
        // and the heap.
        let leader = (0..c.size).find(|&r| same_host(r)).unwrap_or(c.rank);
        let (state, _state_offer) = state_page(boot.as_mut(), c, leader, cross, &same_process)?;
        let (memory, base, export) = allocate_heap(boot.as_mut(), c, len, ipc, try_one_sided)?;
        let heap_offer = handoff::offer(memory.clone());

        // 5. peers.
        let descs: Vec<Vec<String>> = boot
            .allgather(format!("{base}\n{export}\n{}", heap_offer.token).as_bytes())?
            .iter()
            .map(|b| fields(b))
            .collect();
        let remote_transport = |r: usize| match c.device.platform {
            _ if !remote(r) => None,
            Platform::Cuda => Some(Transport::Nccl),
            Platform::Host => Some(Transport::Tcp),
        };
        let peers = map_peers(&descs, &devices, c, len, &same_process, &remote_transport);
        let mut peers = agree(boot.as_mut(), peers)?;
        // The unmapped pairs' connections: NCCL's communicator (CUDA) or
        // TCP connections (Host).
        let nccl = match nccl_pairs {
            true => {
                let healthy = || state.check();
                let heap = (base, len);
                Some(connect_nccl(
                    boot.as_mut(),
                    c,
                    heap,
                    try_one_sided,
                    &mut peers,
                    &healthy,
                    &step,
                )?)
            }
            false => None,
        };
        let tcp: Vec<bool> = (0..c.size).map(by_tcp).collect();
        let mesh = match tcp.iter().any(|&t| t) {
            true => Some(connect_tcp(boot.as_mut(), c, &tcp, &step)?),
            false => None,
        };
        for (pe, p) in peers.iter().enumerate() {
            tracing::debug!(
                target: LOG_TARGET,
                rank = c.rank,
                pe,
                device = %c.device,
                peer_device = %p.device,
                transport = p.transport.name(),
                "init: peer mapped"
            );
        }

        // 6. every peer mapped this heap: drop its name and the offers.
        boot.barrier()?;
        if let Memory::Host(h) = &*memory {
            h.unlink();
        }
        if let StatePage::SameProcess(h) = &state {
            h.unlink();
        }
        drop(heap_offer);
        drop(_state_offer);

        // 7. the internal region.
        let mut alloc = Allocator::new(len);
        let internal = alloc.alloc(internal_bytes(c.size))?;
        debug_assert_eq!(internal, 0);
        let stream = match c.device.platform {
            Platform::Cuda => Some(crate::cuda::OwnStream::new(c.device).map_err(ShmemError::from)),
            Platform::Host => None,
        }
        .transpose();
        let stream = agree(boot.as_mut(), stream)?;
        let mut live = Live {
            nccl,
            mesh,
            state,
            rank: c.rank,
            size: c.size,
            device: c.device,
            name,
            timeout: c.timeout,
            boot,
            base,
            len,
            alloc,
            internal: internal_bytes(c.size),
            seq: 0,
            staged: 0,
            peers,
            stream,
            memory,
            _binding: binding,
            // A Host PE is counted while it lives: the Host loops of this
            // process then know whether splitting over the pool pays.
            _host_pe: (c.device.platform == Platform::Host)
                .then(xcall_core::host_pool::HostPe::enter),
        };
        let zeroed = live.init_internal();
        agree(live.boot.as_mut(), zeroed)?;
        live.boot.barrier()?;
        tracing::info!(
            target: LOG_TARGET,
            bootstrap = live.name.as_str(),
            rank = c.rank,
            size = c.size,
            device = %c.device,
            heap_bytes = len,
            ms = %format_args!("{:.3}", started.elapsed().as_secs_f64() * 1e3),
            "shmem world up"
        );
        Ok(live)
    }

    /// Zeroes the internal region and writes the peer arrival-pointer
    /// table; loads the kernels on CUDA.
    pub(super) fn init_internal(&mut self) -> Result<()> {
        let n = self.size;
        let mut table = vec![0u8; self.internal];
        for (i, p) in self.peers.iter().enumerate() {
            // Peer i's arrival words, in this PE's address space.
            let at = 8 * n + 16 + 8 * i;
            table[at..at + 8].copy_from_slice(&p.base.to_le_bytes());
        }
        match &*self.memory {
            Memory::Host(_) => {
                // SAFETY: the first `internal` bytes of this PE's heap.
                unsafe {
                    std::ptr::copy_nonoverlapping(table.as_ptr(), self.base as *mut u8, table.len())
                };
                Ok(())
            }
            Memory::Cuda(_) => {
                crate::cuda::kernels(self.device)?;
                // SAFETY: the first `internal` bytes of this PE's heap.
                unsafe { crate::cuda::write_device(self.device, self.base, &table) }
            }
        }
    }
}
