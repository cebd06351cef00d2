//! Init step 3: every PE's identity (host, process, device, heap size,
//! transport policy), and what a world refuses among them.

use xcall_core::{Device, Platform};

use super::agreement::{agree, fields};
use super::config::{Pairs, WorldConfig, TRANSPORT_ENV};
use crate::bootstrap::Bootstrap;
use crate::error::{Result, ShmemError};
use crate::transport::host_shared_memory::host_identity;

/// Step 3 (collective): every PE's identity (host, process, platform,
/// ordinal, heap bytes, transport policy), as fields by rank, and every
/// PE's device, agreed on ([`check_identities`]).
pub(super) fn exchange_identities(
    boot: &mut dyn Bootstrap,
    c: &WorldConfig,
    len: usize,
    pairs: Pairs,
) -> Result<(Vec<Vec<String>>, Vec<Device>)> {
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
    let devices = agree(boot, devices)?;
    Ok((ids, devices))
}

/// Step 3: the devices of every rank, from their identities (`host`, `pid`,
/// platform, ordinal, heap bytes); refuses what a world cannot hold.
fn check_identities(ids: &[Vec<String>], c: &WorldConfig, len: usize) -> Result<Vec<Device>> {
    let mut devices = Vec::with_capacity(c.size);
    for (r, f) in ids.iter().enumerate() {
        if f.len() != 6 {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} sent a malformed identity"
            )));
        }
        let platform = f[2].parse().ok().and_then(Platform::from_code);
        let ordinal: Option<u32> = f[3].parse().ok();
        let (Some(platform), Some(ordinal)) = (platform, ordinal) else {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} sent a malformed device"
            )));
        };
        devices.push(Device::new(platform, ordinal));
        if platform != c.device.platform {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} is on {} and rank {} on {}: one platform per world",
                devices[r], c.rank, c.device
            )));
        }
        if f[4] != len.to_string() {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} has a heap of {} bytes, rank {} of {len}",
                f[4], c.rank
            )));
        }
        if f[5] != ids[c.rank][5] {
            return Err(ShmemError::Mismatch(format!(
                "rank {r} takes the transport policy {} and rank {} {} (set {TRANSPORT_ENV} alike on every PE)",
                f[5], c.rank, ids[c.rank][5]
            )));
        }
        for (q, g) in ids.iter().enumerate().take(r) {
            if g[0] == f[0] && g[1] == f[1] && g[2] == f[2] && g[3] == f[3] {
                return Err(ShmemError::Mismatch(format!(
                    "ranks {q} and {r} are one process on one device ({})",
                    devices[r]
                )));
            }
        }
    }
    Ok(devices)
}
