//! Rendezvous of processing elements: in-process groups, and processes
//! meeting at a Unix socket or a TCP address, with timeouts.
//!
//! A [`Bootstrap`] moves small messages between the PEs of one world
//! (identities at init, sizes at `malloc`, nothing on the data path). Every
//! call has a deadline: a PE that never arrives becomes a
//! [`ShmemError::Timeout`] on every PE that waits for it, naming the
//! missing ranks, never a hang. After a timeout the bootstrap is failed:
//! every later call on any PE of the world fails at once with the same
//! message.
//!
//! No lock is held while waiting: the in-process group waits on a condition
//! variable (which releases its lock), the socket bootstrap blocks in
//! `read` with a timeout.

use std::time::Instant;

use crate::error::{Result, ShmemError};
use crate::limits::MAX_PES;

mod in_process;
mod star;
mod tcp;
#[cfg(test)]
mod tests;
mod unix_socket;

pub use crate::limits::MAX_FRAME;
pub use in_process::{abandon, group_alive, InProcess};
pub use star::{Conn, Star};
pub use tcp::Tcp;
pub use unix_socket::UnixSocket;

/// The collectives the PEs of one world use to agree.
pub trait Bootstrap: Send {
    /// This PE's rank.
    fn rank(&self) -> usize;
    /// The number of PEs.
    fn size(&self) -> usize;
    /// Every PE's `data`, indexed by rank. Blocks until all PEs contributed
    /// or the timeout passed.
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every PE called it.
    fn barrier(&mut self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }
    /// The address this PE reaches its peers from, where the bootstrap
    /// knows one (TCP: the local end of its connection to rank 0); `None`
    /// for a bootstrap of one host.
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        None
    }
    /// `data` of PE `root` on every PE.
    fn broadcast(&mut self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.size() {
            return Err(ShmemError::InvalidArgument(format!(
                "broadcast root {root} is not a rank of a world of {}",
                self.size()
            )));
        }
        let mine = if self.rank() == root { data } else { &[] };
        Ok(self.allgather(mine)?.swap_remove(root))
    }
}

/// A bootstrap whose exchanges are logged: each at `trace` with its
/// duration, a failure (a timeout names the ranks that never arrived) at
/// `warn`. No lock of the bootstrap is held while a line is logged.
pub(crate) struct Logged {
    inner: Box<dyn Bootstrap>,
    name: String,
    seq: u64,
}

impl Logged {
    /// `inner`, logged under `name` ("group G", "socket PATH").
    pub(crate) fn new(inner: Box<dyn Bootstrap>, name: String) -> Logged {
        Logged {
            inner,
            name,
            seq: 0,
        }
    }
}

impl Bootstrap for Logged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.inner.local_ip()
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (seq, started) = (self.seq, Instant::now());
        self.seq += 1;
        let (rank, size, bootstrap) = (self.inner.rank(), self.inner.size(), &self.name);
        match self.inner.allgather(data) {
            Ok(all) => {
                tracing::trace!(
                    bootstrap,
                    rank,
                    size,
                    seq,
                    bytes = data.len(),
                    ms = %format_args!("{:.3}", started.elapsed().as_secs_f64() * 1e3),
                    "bootstrap exchange done"
                );
                Ok(all)
            }
            Err(e) => {
                tracing::warn!(bootstrap, rank, size, seq, error = %e, "bootstrap exchange failed");
                Err(e)
            }
        }
    }
}

pub(crate) fn check_rank(rank: usize, size: usize) -> Result<()> {
    if size == 0 || rank >= size {
        return Err(ShmemError::InvalidArgument(format!(
            "rank {rank} is not in a world of {size} PE(s)"
        )));
    }
    if size > MAX_PES {
        return Err(ShmemError::InvalidArgument(format!(
            "a world of {size} PEs is larger than the limit of {MAX_PES}"
        )));
    }
    Ok(())
}

pub(crate) fn missing(arrived: &[bool]) -> Vec<usize> {
    (0..arrived.len()).filter(|&r| !arrived[r]).collect()
}
