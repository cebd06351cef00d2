//! Init, step by step (see the module docs of [`super`]): the checks and
//! the device binding (1), the bootstrap (2), then the steps of the
//! modules named in each, and the internal region (7).

use std::sync::Arc;
use std::time::Instant;

use xcall_core::Platform;

use super::agreement::{agree, fields};
use super::config::{BootstrapKind, Config, Pairs};
use super::identities::check_identities;
use super::layout::internal_bytes;
use super::live::{Live, Memory};
use super::peers::map_peers;
use super::state::{state_page, unique, StatePage};
use crate::bootstrap::{Bootstrap, InProcess, Logged, Tcp, UnixSocket};
use crate::error::{Result, ShmemError};
use crate::heap::Allocator;
use crate::limits::MAX_PES;
use crate::registry;
use crate::transport::host_shared_memory::{host_identity, HostHeap};
use crate::transport::same_process as handoff;
use crate::transport::Transport;

/// Whether every PE says `yes` (each its own).
fn all_say(boot: &mut dyn Bootstrap, yes: bool) -> Result<bool> {
    let all = boot.allgather(&[yes as u8])?;
    Ok(all.iter().all(|a| a.as_slice() == [1]))
}

/// Whether this process's NCCL (when one loads) has one-sided operations.
fn one_sided_nccl() -> bool {
    crate::transport::nccl::library().is_ok_and(|l| l.one_sided())
}

/// A new NCCL communicator of the world's PEs (collective): rank 0's
/// unique id spread by the bootstrap, the init agreed on.
fn nccl_comm(
    boot: &mut dyn Bootstrap,
    c: &Config,
    healthy: &dyn Fn() -> Result<()>,
) -> Result<crate::transport::nccl::Comm> {
    let id = match c.rank {
        0 => crate::transport::nccl::unique_id(c.device),
        _ => Ok(Vec::new()),
    };
    let id = agree(boot, id)?;
    let id = boot.broadcast(0, &id)?;
    let comm =
        crate::transport::nccl::Comm::init(c.device, &id, c.rank, c.size, c.timeout, healthy);
    agree(boot, comm)
}

impl Live {
    /// The checks and the device binding before a PE joins its bootstrap:
    /// (heap bytes, binding, the bootstrap's name).
    fn before_joining(c: &Config) -> Result<(usize, registry::Binding, String)> {
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

    pub(super) fn init(c: &Config) -> Result<Live> {
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
        let me = format!(
            "{}\n{}\n{}\n{}\n{}\n{:?}",
            host_identity()?,
            std::process::id(),
            c.device.platform as u32,
            c.device.ordinal,
            len,
            pairs
        );
        let ids: Vec<Vec<String>> = boot
            .allgather(me.as_bytes())?
            .iter()
            .map(|b| fields(b))
            .collect();
        let devices = check_identities(&ids, c, len);
        let devices = agree(boot.as_mut(), devices)?;
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
        let shm_name = format!("/xcall-{}-{}-{}", std::process::id(), c.rank, unique());
        let memory = match c.device.platform {
            Platform::Host if ipc => HostHeap::shared(&shm_name, len).map(Memory::Host),
            Platform::Host => HostHeap::private(len).map(Memory::Host),
            Platform::Cuda if try_one_sided => {
                crate::transport::cuda_ipc::DeviceHeap::through_nccl(c.device, len)
                    .map(Memory::Cuda)
            }
            Platform::Cuda => {
                crate::transport::cuda_ipc::DeviceHeap::new(c.device, len).map(Memory::Cuda)
            }
        };
        let memory = Arc::new(agree(boot.as_mut(), memory)?);
        let heap_offer = handoff::offer(memory.clone());
        let (base, export) = match &*memory {
            Memory::Host(h) => (h.base, shm_name.clone()),
            Memory::Cuda(d) => {
                let handle = if ipc {
                    agree(boot.as_mut(), d.ipc_handle())?
                } else {
                    agree(boot.as_mut(), Ok(Vec::new()))?
                };
                (d.base, handle.iter().map(|b| format!("{b:02x}")).collect())
            }
        };

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
        // NCCL's communicator, when some pair takes it: rank 0's id
        // spread by the bootstrap.
        let nccl = if nccl_pairs {
            agree(boot.as_mut(), crate::transport::nccl::library().map(|_| ()))?;
            let healthy = || state.check();
            let mut comm = nccl_comm(boot.as_mut(), c, &healthy)?;
            step("NCCL communicator up");
            if try_one_sided {
                // NCCL refuses one-sided operations among ranks it cannot
                // reach that way (across hosts without its RMA support),
                // failing the communicator that asked: a communicator of
                // their own asks first. Then the heap becomes a window.
                let asked = nccl_comm(boot.as_mut(), c, &healthy)?;
                let works = agree(boot.as_mut(), asked.one_sided_works(c.timeout, &healthy))?;
                let works = all_say(boot.as_mut(), works)?;
                let windowed = match works {
                    true => comm.register_window(base, len, c.timeout, &healthy),
                    false => Ok(false),
                };
                let windowed = agree(boot.as_mut(), windowed)?;
                if all_say(boot.as_mut(), windowed)? {
                    for p in peers.iter_mut().filter(|p| p.transport == Transport::Nccl) {
                        p.transport = Transport::NcclOneSided;
                    }
                }
                step("NCCL one-sided operations asked for");
            }
            Some(comm)
        } else {
            None
        };
        // The TCP connections of the Host pairs that take them.
        let mesh = if (0..c.size).any(by_tcp) {
            let listener = crate::transport::tcp::listen(boot.local_ip());
            let listener = agree(boot.as_mut(), listener)?;
            let addresses: Vec<String> = boot
                .allgather(listener.address.as_bytes())?
                .iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let token = match c.rank {
                0 => crate::transport::tcp::token().to_le_bytes().to_vec(),
                _ => Vec::new(),
            };
            let token = boot.broadcast(0, &token)?;
            let token =
                u64::from_le_bytes(token.as_slice().try_into().map_err(|_| {
                    ShmemError::Mismatch("rank 0 sent a malformed TCP token".into())
                })?);
            let tcp: Vec<bool> = (0..c.size).map(by_tcp).collect();
            let mesh = listener.connect(c.rank, &tcp, &addresses, token, c.timeout);
            let mesh = agree(boot.as_mut(), mesh)?;
            step("TCP pairs connected");
            Some(mesh)
        } else {
            None
        };
        for (pe, p) in peers.iter().enumerate() {
            tracing::debug!(
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
        };
        let zeroed = live.init_internal();
        agree(live.boot.as_mut(), zeroed)?;
        live.boot.barrier()?;
        tracing::info!(
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::all_say;
    use crate::bootstrap::InProcess;

    /// `all_say` is yes on every PE exactly when every PE says yes.
    #[test]
    fn every_pe_hears_yes_only_when_all_say_it() {
        let cases = [
            [true, true, true],
            [true, false, true],
            [false, false, false],
        ];
        for (case, says) in cases.into_iter().enumerate() {
            let pes: Vec<_> = (0..3)
                .map(|r| {
                    std::thread::spawn(move || {
                        let group = format!("all-say-{case}");
                        let timeout = Duration::from_secs(20);
                        let mut boot = InProcess::join(&group, r, 3, timeout).unwrap();
                        all_say(&mut boot, says[r]).unwrap()
                    })
                })
                .collect();
            let want = says.iter().all(|&s| s);
            for pe in pes {
                assert_eq!(pe.join().unwrap(), want, "case {case}: {says:?}");
            }
        }
    }
}
