//! PEs that are processes on any hosts, meeting at rank 0's TCP address.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::check_rank;
use super::star::{dial, gather, Star};
use crate::error::{Result, ShmemError};

/// PEs that are processes on any hosts rank 0's address reaches, meeting
/// at a TCP `host:port` (what launchers export as `MASTER_ADDR` and
/// `MASTER_PORT`): rank 0 listens there until every PE connected, the
/// others connect to it. A connection is admitted when its first frame is
/// xcall's hello for a world of the same size; the network is trusted, as
/// with the rendezvous stores of the launchers.
pub type Tcp = Star<TcpStream>;

impl Tcp {
    /// Connects rank `rank` of `size` through `address` (`host:port`):
    /// rank 0 listens there (its host must be the one `host` names),
    /// the others connect.
    pub fn connect(address: &str, rank: usize, size: usize, timeout: Duration) -> Result<Tcp> {
        check_rank(rank, size)?;
        let deadline = Instant::now() + timeout;
        let addrs: Vec<SocketAddr> = address
            .to_socket_addrs()
            .map_err(|e| {
                ShmemError::InvalidArgument(format!(
                    "the bootstrap address {address:?} is not a reachable host:port ({e})"
                ))
            })?
            .collect();
        if addrs.is_empty() {
            return Err(ShmemError::InvalidArgument(format!(
                "the bootstrap address {address:?} names no address"
            )));
        }
        let place = format!("tcp {address}");
        let streams = if rank == 0 {
            let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
                let why = if e.kind() == std::io::ErrorKind::AddrInUse {
                    "the port is in use (another world's rank 0?)"
                } else {
                    "rank 0 must run on the host the address names"
                };
                ShmemError::System(format!("rank 0 cannot listen at {address:?}: {e}; {why}"))
            })?;
            listener
                .set_nonblocking(true)
                .map_err(|e| ShmemError::os("set_nonblocking", e))?;
            gather(
                || listener.accept().map(|(s, _)| s),
                |_| true,
                &place,
                size,
                deadline,
                timeout,
            )?
        } else {
            let mut next = 0;
            let connect = |left: Duration| {
                // Every address the name resolves to, in turn.
                let a = addrs[next % addrs.len()];
                next += 1;
                TcpStream::connect_timeout(&a, left.min(Duration::from_secs(1)))
            };
            vec![dial(connect, &place, rank, size, deadline, timeout)?]
        };
        for s in &streams {
            // Collectives are small frames, each answered: no batching.
            s.set_nodelay(true)
                .map_err(|e| ShmemError::os("TCP_NODELAY", e))?;
        }
        Ok(Star::new(rank, size, streams, timeout))
    }
}
