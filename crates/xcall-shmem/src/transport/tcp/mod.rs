//! The Host platform's transport for PEs it cannot map: TCP connections
//! between the pairs that take it, carrying [`crate::World::exchange`].
//!
//! Why TCP of xcall's own: a Host world that spans hosts needs only what
//! NCCL gives a CUDA world — a connection per pair and ordered,
//! length-checked byte streams for the exchange's segments — and the PEs
//! already meet through a TCP (or in-process, or Unix socket) bootstrap
//! with deadlines. An MPI library would add a build-time dependency and
//! its own launcher to every consumer for that. The protocol is small:
//!
//! - init: every PE that has a TCP pair listens on an ephemeral port of
//!   the address its bootstrap reaches rank 0 from (127.0.0.1 for a
//!   bootstrap of one host), the addresses and a token from rank 0 go
//!   round through the bootstrap, each PE dials its lower-ranked TCP
//!   peers and accepts its higher-ranked ones. A connection is admitted
//!   when its first 16 bytes are the world's token and an expected rank;
//!   anything else is dropped.
//! - exchange: per segment, a little-endian u64 length and the bytes,
//!   in the order the PE lists them; the receiver checks each length
//!   against its own list. The calling thread moves every pair's segments
//!   both ways over non-blocking sockets under poll(2), so no pattern of
//!   segments can deadlock on full socket buffers.
//! - failure: an exchange in which nothing moves for the world's timeout
//!   fails. Any error
//!   closes every connection of the PE (its peers see it at once, not at
//!   their timeout) and leaves the mesh failed: later exchanges return the
//!   first error.

use std::ffi::c_int;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::{Result, ShmemError};

/// The target of the TCP transport log lines: the module path they have
/// always had, so log filters keep selecting them.
const LOG_TARGET: &str = "xcall_shmem::sockets";

/// How long an accepted connection may take to send its hello.
const HELLO_WAIT: Duration = Duration::from_secs(2);

/// The connections of one PE to its TCP peers.
pub struct Mesh {
    rank: usize,
    /// By rank; `None` for a PE reached otherwise (and this PE).
    streams: Vec<Option<TcpStream>>,
    timeout: Duration,
    failed: Option<ShmemError>,
}

/// A listening socket, before the mesh is connected.
pub struct Listener {
    listener: TcpListener,
    /// `ip:port` peers dial.
    pub address: String,
}

/// Listens on an ephemeral port of `ip` (`None`: 127.0.0.1).
pub fn listen(ip: Option<IpAddr>) -> Result<Listener> {
    let ip = ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let listener = TcpListener::bind(SocketAddr::new(ip, 0))
        .map_err(|e| ShmemError::os(format!("listening on {ip} for the TCP pairs"), e))?;
    let address = listener
        .local_addr()
        .map_err(|e| ShmemError::os("the TCP pairs' listening address", e))?
        .to_string();
    listener
        .set_nonblocking(true)
        .map_err(|e| ShmemError::os("set_nonblocking", e))?;
    Ok(Listener { listener, address })
}

/// A world's token, hard to guess (rank 0 draws it; the others learn it
/// through the bootstrap).
pub fn token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

pub(super) fn hello(token: u64, rank: usize) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&token.to_le_bytes());
    h[8..].copy_from_slice(&(rank as u64).to_le_bytes());
    h
}

impl Listener {
    /// Connects PE `rank` to every PE `q` with `tcp[q]`: dials the lower
    /// ranks at `addresses[q]`, accepts the higher ones, each connection
    /// proven by `token`. Gives up after `timeout`, naming the missing
    /// ranks.
    pub fn connect(
        self,
        rank: usize,
        tcp: &[bool],
        addresses: &[String],
        token: u64,
        timeout: Duration,
    ) -> Result<Mesh> {
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = tcp.iter().map(|_| None).collect();
        // The lower ranks listen already (every PE bound before the
        // addresses went round), so a dial waits at most for a backlog.
        for q in (0..rank).filter(|&q| tcp[q]) {
            let addr: SocketAddr = addresses[q].parse().map_err(|_| {
                ShmemError::Mismatch(format!(
                    "rank {q} sent {:?} as its TCP address",
                    addresses[q]
                ))
            })?;
            let mut s = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match TcpStream::connect_timeout(
                    &addr,
                    left.clamp(Duration::from_millis(1), Duration::from_secs(1)),
                ) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => {
                        return Err(ShmemError::Timeout(format!(
                        "rank {rank} could not reach rank {q} at {addr} within {timeout:?} ({e})"
                    )))
                    }
                }
            };
            s.write_all(&hello(token, rank))
                .map_err(|e| ShmemError::os(format!("rank {rank} greeting rank {q}"), e))?;
            streams[q] = Some(s);
        }
        let mut waiting: Vec<usize> = (rank + 1..tcp.len()).filter(|&q| tcp[q]).collect();
        while !waiting.is_empty() {
            match self.listener.accept() {
                Ok((mut s, _)) => {
                    let greeted = s
                        .set_nonblocking(false)
                        .and_then(|()| s.set_read_timeout(Some(HELLO_WAIT)))
                        .and_then(|()| {
                            let mut h = [0u8; 16];
                            s.read_exact(&mut h).map(|()| h)
                        });
                    let Ok(h) = greeted else { continue };
                    let from = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
                    let Some(at) = waiting.iter().position(|&q| q as u64 == from) else {
                        continue; // a stranger, or a rank already here
                    };
                    if h[..8] != token.to_le_bytes() {
                        continue;
                    }
                    streams[waiting.swap_remove(at)] = Some(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        waiting.sort_unstable();
                        return Err(ShmemError::Timeout(format!(
                            "rank {rank} waited {timeout:?} for the TCP connections of rank(s) {waiting:?}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => {
                    return Err(ShmemError::os(
                        format!("rank {rank} accepting its TCP peers"),
                        e,
                    ))
                }
            }
        }
        // Non-blocking: an exchange polls every pair's socket at once.
        for s in streams.iter().flatten() {
            s.set_nodelay(true)
                .and_then(|()| s.set_nonblocking(true))
                .map_err(|e| ShmemError::os("configuring a TCP pair", e))?;
        }
        Ok(Mesh {
            rank,
            streams,
            timeout,
            failed: None,
        })
    }
}

/// One segment of an exchange through the mesh: a peer, and where its
/// bytes come from (a send) or go to (a receive) in this process.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    /// The peer's rank.
    pub peer: usize,
    /// Host address of the bytes.
    pub address: u64,
    /// Bytes.
    pub bytes: usize,
}

impl Mesh {
    /// Whether PE `q` is reached through the mesh.
    pub fn reaches(&self, q: usize) -> bool {
        self.streams.get(q).is_some_and(Option::is_some)
    }

    /// The first failure, if the mesh failed.
    pub fn failed(&self) -> Option<&ShmemError> {
        self.failed.as_ref()
    }

    /// Closes every connection: the peers see it at once.
    fn close(&self) {
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Sends every segment of `sends` and receives every segment of
    /// `recvs`, each peer's in list order, until all are done or one
    /// fails. On a failure every connection is closed and the mesh stays
    /// failed.
    ///
    /// # Safety
    /// Every send's `address` readable and every receive's writable for
    /// its bytes until this returns; no receive overlaps another or a
    /// send.
    pub unsafe fn exchange(&mut self, sends: &[Segment], recvs: &[Segment]) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        // A bad list is refused before anything moves; the mesh stays up.
        if let Some(s) = sends.iter().chain(recvs).find(|s| !self.reaches(s.peer)) {
            return Err(ShmemError::InvalidArgument(format!(
                "rank {}: PE {} is not a TCP pair of this PE",
                self.rank, s.peer
            )));
        }
        let result = self.run(sends, recvs);
        if let Err(e) = &result {
            tracing::warn!(
                target: LOG_TARGET,
                rank = self.rank,
                error = %e,
                "TCP exchange failed; closing every TCP pair"
            );
            self.close();
            self.failed = Some(e.clone());
        }
        result
    }

    /// Moves every segment on this thread: the sockets are non-blocking
    /// and poll(2) says which can move, so sends and receives with every
    /// peer interleave (no pattern can deadlock on full socket buffers)
    /// and no thread is started per call.
    fn run(&self, sends: &[Segment], recvs: &[Segment]) -> Result<()> {
        let me = self.rank;
        let mut flows: Vec<Flow> = Vec::new();
        for (list, send) in [(sends, true), (recvs, false)] {
            for (i, seg) in list.iter().enumerate() {
                let f = match flows.iter().position(|f| f.peer == seg.peer) {
                    Some(f) => f,
                    None => {
                        let stream = self.streams[seg.peer]
                            .as_ref()
                            .expect("checked by exchange");
                        flows.push(Flow::new(seg.peer, stream));
                        flows.len() - 1
                    }
                };
                let queue = if send {
                    &mut flows[f].sends
                } else {
                    &mut flows[f].recvs
                };
                queue.items.push(i);
            }
        }
        let wait_ms = c_int::try_from(self.timeout.as_millis()).unwrap_or(c_int::MAX);
        loop {
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(flows.len());
            let mut polled: Vec<usize> = Vec::with_capacity(flows.len());
            for (f, flow) in flows.iter().enumerate() {
                let mut events = 0;
                if !flow.sends.done() {
                    events |= libc::POLLOUT;
                }
                if !flow.recvs.done() {
                    events |= libc::POLLIN;
                }
                if events != 0 {
                    fds.push(libc::pollfd {
                        fd: flow.stream.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                    polled.push(f);
                }
            }
            if fds.is_empty() {
                return Ok(());
            }
            // SAFETY: `fds` is a live array of `fds.len()` pollfd.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
            if ready < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(ShmemError::os(
                    format!("rank {me}: poll on the TCP pairs"),
                    e,
                ));
            }
            if ready == 0 {
                // Named by the first pair still waiting, receives first.
                let f = &flows[polled[0]];
                let what = match f.recvs.done() {
                    false => "receiving from",
                    true => "sending to",
                };
                let e = std::io::Error::from(std::io::ErrorKind::TimedOut);
                return Err(io_error(me, f.peer, what, e, self.timeout));
            }
            // Every pair still moving tries both ways: a socket that
            // cannot move returns WouldBlock at once, and one that failed
            // (POLLERR, POLLHUP) returns its error.
            for &f in &polled {
                let flow = &mut flows[f];
                let q = flow.peer;
                flow.send(sends)
                    .map_err(|e| io_error(me, q, "sending to", e, self.timeout))?;
                flow.receive(me, recvs, self.timeout)?;
            }
        }
    }
}

/// One peer's segments of an exchange, both ways, and how far each got.
pub(super) struct Flow<'a> {
    peer: usize,
    stream: &'a TcpStream,
    sends: Queue,
    recvs: Queue,
}

/// Segments (indices into the call's list) in order; the current one's
/// 8-byte length header and then its bytes, `at` of them moved.
#[derive(Default)]
struct Queue {
    items: Vec<usize>,
    next: usize,
    header: [u8; 8],
    at: usize,
}

impl Queue {
    fn done(&self) -> bool {
        self.next == self.items.len()
    }

    /// The current segment's unmoved bytes after moving `moved` more:
    /// the header first, then the segment; steps to the next segment at
    /// its end.
    fn advance(&mut self, moved: usize, bytes: usize) {
        self.at += moved;
        if self.at == 8 + bytes {
            self.next += 1;
            self.at = 0;
        }
    }
}

impl<'a> Flow<'a> {
    fn new(peer: usize, stream: &'a TcpStream) -> Flow<'a> {
        Flow {
            peer,
            stream,
            sends: Queue::default(),
            recvs: Queue::default(),
        }
    }

    /// Writes what the socket takes now.
    fn send(&mut self, list: &[Segment]) -> std::io::Result<()> {
        while !self.sends.done() {
            let seg = &list[self.sends.items[self.sends.next]];
            let q = &mut self.sends;
            if q.at == 0 {
                q.header = (seg.bytes as u64).to_le_bytes();
            }
            let wrote = if q.at < 8 {
                self.stream.write(&q.header[q.at..])
            } else {
                // SAFETY: the caller's contract: readable for its bytes
                // while the exchange runs.
                let data =
                    unsafe { std::slice::from_raw_parts(seg.address as *const u8, seg.bytes) };
                self.stream.write(&data[q.at - 8..])
            };
            match wrote {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => q.advance(n, seg.bytes),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads what the socket holds now; checks each header against the
    /// segment listed.
    fn receive(&mut self, me: usize, list: &[Segment], timeout: Duration) -> Result<()> {
        let q = self.peer;
        let failed = |e| io_error(me, q, "receiving from", e, timeout);
        while !self.recvs.done() {
            let seg = &list[self.recvs.items[self.recvs.next]];
            let r = &mut self.recvs;
            let read = if r.at < 8 {
                let at = r.at;
                (&mut &*self.stream).read(&mut r.header[at..])
            } else {
                // SAFETY: the caller's contract: writable for its bytes,
                // overlapping nothing else in use.
                let dest =
                    unsafe { std::slice::from_raw_parts_mut(seg.address as *mut u8, seg.bytes) };
                (&mut &*self.stream).read(&mut dest[r.at - 8..])
            };
            match read {
                Ok(0) => return Err(failed(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => {
                    let header_done = r.at < 8 && r.at + n == 8;
                    r.advance(n, seg.bytes);
                    if header_done {
                        let len = u64::from_le_bytes(r.header);
                        if len != seg.bytes as u64 {
                            return Err(ShmemError::Mismatch(format!(
                                "rank {me} expected a segment of {} bytes from PE {q}, which sent {len}: the two PEs' exchange lists disagree",
                                seg.bytes
                            )));
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(failed(e)),
            }
        }
        Ok(())
    }
}

fn io_error(me: usize, q: usize, what: &str, e: std::io::Error, timeout: Duration) -> ShmemError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ShmemError::Timeout(
            format!("rank {me} {what} PE {q}: nothing moved for {timeout:?}"),
        ),
        _ => ShmemError::PeerFailed(format!(
            "rank {me} {what} PE {q}: its connection closed ({e}); it failed or left"
        )),
    }
}

#[cfg(test)]
mod tests;
