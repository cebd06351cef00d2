//! Init step 5 for the pairs no heap mapping reaches: NCCL's
//! communicator of a CUDA world (and whether its one-sided operations
//! run there), and the TCP connections of a Host world.

use super::agreement::agree;
use super::config::WorldConfig;
use super::live::Peer;
use crate::bootstrap::Bootstrap;
use crate::error::{Result, ShmemError};
use crate::transport::nccl::{self, Comm};
use crate::transport::tcp::{self, Mesh};
use crate::transport::Transport;

/// Whether every PE says `yes` (each its own).
pub(super) fn all_say(boot: &mut dyn Bootstrap, yes: bool) -> Result<bool> {
    let all = boot.allgather(&[yes as u8])?;
    Ok(all.iter().all(|a| a.as_slice() == [1]))
}

/// Whether this process's NCCL (when one loads) has one-sided operations.
pub(super) fn one_sided_nccl() -> bool {
    nccl::library().is_ok_and(|l| l.one_sided())
}

/// A new NCCL communicator of the world's PEs (collective): rank 0's
/// unique id spread by the bootstrap, the init agreed on.
fn nccl_comm(
    boot: &mut dyn Bootstrap,
    c: &WorldConfig,
    healthy: &dyn Fn() -> Result<()>,
) -> Result<nccl::Comm> {
    let id = match c.rank {
        0 => nccl::unique_id(c.device),
        _ => Ok(Vec::new()),
    };
    let id = agree(boot, id)?;
    let id = boot.broadcast(0, &id)?;
    let comm = nccl::Comm::init(c.device, &id, c.rank, c.size, c.timeout, healthy);
    agree(boot, comm)
}

/// NCCL's communicator of the world (collective): rank 0's id spread by
/// the bootstrap. With `try_one_sided`, a communicator of their own asks
/// first whether NCCL runs one-sided operations among the world's PEs
/// (NCCL refuses them among ranks it cannot reach that way, across hosts
/// without its RMA support, failing the communicator that asked); where
/// every PE's does, the heap (`base`, `len`) becomes the communicator's
/// window and the NCCL pairs report [`Transport::NcclOneSided`].
pub(super) fn connect_nccl(
    boot: &mut dyn Bootstrap,
    c: &WorldConfig,
    (base, len): (u64, usize),
    try_one_sided: bool,
    peers: &mut [Peer],
    healthy: &dyn Fn() -> Result<()>,
    step: &dyn Fn(&str),
) -> Result<Comm> {
    agree(boot, nccl::library().map(|_| ()))?;
    let mut comm = nccl_comm(boot, c, healthy)?;
    step("NCCL communicator up");
    if try_one_sided {
        let asked = nccl_comm(boot, c, healthy)?;
        let works = agree(boot, asked.one_sided_works(c.timeout, healthy))?;
        let works = all_say(boot, works)?;
        let windowed = match works {
            true => comm.register_window(base, len, c.timeout, healthy),
            false => Ok(false),
        };
        let windowed = agree(boot, windowed)?;
        if all_say(boot, windowed)? {
            for p in peers.iter_mut().filter(|p| p.transport == Transport::Nccl) {
                p.transport = Transport::NcclOneSided;
            }
        }
        step("NCCL one-sided operations asked for");
    }
    Ok(comm)
}

/// The TCP connections of the Host pairs that take them (`tcp[r]`: this
/// PE's pair with rank `r`), collective: every PE listens, the addresses
/// and rank 0's token spread by the bootstrap.
pub(super) fn connect_tcp(
    boot: &mut dyn Bootstrap,
    c: &WorldConfig,
    tcp: &[bool],
    step: &dyn Fn(&str),
) -> Result<Mesh> {
    let listener = tcp::listen(boot.local_ip());
    let listener = agree(boot, listener)?;
    let addresses: Vec<String> = boot
        .allgather(listener.address.as_bytes())?
        .iter()
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let token = match c.rank {
        0 => tcp::token().to_le_bytes().to_vec(),
        _ => Vec::new(),
    };
    let token = boot.broadcast(0, &token)?;
    let token = u64::from_le_bytes(
        token
            .as_slice()
            .try_into()
            .map_err(|_| ShmemError::Mismatch("rank 0 sent a malformed TCP token".into()))?,
    );
    let mesh = listener.connect(c.rank, tcp, &addresses, token, c.timeout);
    let mesh = agree(boot, mesh)?;
    step("TCP pairs connected");
    Ok(mesh)
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
