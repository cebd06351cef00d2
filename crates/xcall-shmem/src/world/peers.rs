//! Init step 5: every peer's heap mapped by its transport.

use xcall_core::{Device, Platform};

use super::config::WorldConfig;
use super::live::{Memory, Peer, PeerMap};
use crate::error::{Result, ShmemError};
use crate::transport::host_shared_memory::HostMapping;
use crate::transport::same_process as handoff;
use crate::transport::Transport;

/// Step 5: maps every peer's heap from its descriptor (`base`, export,
/// offer token): same process by the offer (CUDA: after enabling peer
/// access), another process by name (Host) or IPC handle (CUDA).
pub(super) fn map_peers(
    descs: &[Vec<String>],
    devices: &[Device],
    c: &WorldConfig,
    len: usize,
    same_process: &dyn Fn(usize) -> bool,
    remote: &dyn Fn(usize) -> Option<Transport>,
) -> Result<Vec<Peer>> {
    let mut peers = Vec::with_capacity(c.size);
    for (r, d) in descs.iter().enumerate() {
        let their_base: u64 = d.first().and_then(|b| b.parse().ok()).ok_or_else(|| {
            ShmemError::Mismatch(format!("rank {r} sent a malformed heap descriptor"))
        })?;
        let export = d.get(1).cloned().unwrap_or_default();
        let device = devices[r];
        match remote(r) {
            Some(transport) if r != c.rank => {
                peers.push(Peer {
                    device,
                    base: 0,
                    map: PeerMap::Unmapped,
                    transport,
                });
                continue;
            }
            _ => {}
        }
        let held = || -> Result<PeerMap> {
            let token = d.get(2).and_then(|t| t.parse().ok()).unwrap_or(0);
            handoff::take::<Memory>(token)
                .map(PeerMap::SameProcess)
                .ok_or_else(|| {
                    ShmemError::Mismatch(format!("rank {r}'s heap is not on offer in this process"))
                })
        };
        let (base, map) = match c.device.platform {
            Platform::Host if same_process(r) => (their_base, held()?),
            Platform::Host => {
                let m = HostMapping::open(&export, len)?;
                (m.base, PeerMap::Host(m))
            }
            Platform::Cuda if same_process(r) => {
                crate::transport::cuda_ipc::enable_peer_access(c.device, device, (c.rank, r))?;
                (their_base, held()?)
            }
            Platform::Cuda => {
                let bytes: Vec<u8> = (0..export.len() / 2)
                    .filter_map(|i| u8::from_str_radix(&export[2 * i..2 * i + 2], 16).ok())
                    .collect();
                let m = crate::transport::cuda_ipc::IpcMapping::open(c.device, &bytes)?;
                (m.base, PeerMap::Cuda(m))
            }
        };
        let transport = remote(r).unwrap_or_else(|| map.transport());
        peers.push(Peer {
            device,
            base,
            map,
            transport,
        });
    }
    Ok(peers)
}

impl PeerMap {
    fn transport(&self) -> Transport {
        match self {
            PeerMap::SameProcess(_) | PeerMap::Released => Transport::SameProcess,
            PeerMap::Host(_) => Transport::HostSharedMemory,
            PeerMap::Cuda(_) => Transport::CudaIpc,
            // A pair whose transport maps nothing says which it is.
            PeerMap::Unmapped => Transport::Nccl,
        }
    }
}
