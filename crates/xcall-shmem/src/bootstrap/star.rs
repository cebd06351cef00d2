//! PEs meeting through rank 0 over streams (Unix sockets or TCP
//! connections): the frames, the hello, and the collectives.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::{missing, Bootstrap};
use crate::error::{Result, ShmemError};
use crate::limits::MAX_FRAME;

/// A stream the star bootstrap talks over: a Unix socket or a TCP
/// connection.
pub trait Conn: Read + Write + Send + Sized {
    /// How long a read may block (`None`: forever).
    fn read_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
    /// Blocking or not.
    fn nonblocking(&self, on: bool) -> std::io::Result<()>;
    /// Closes both directions (a peer blocked in `read` sees it at once).
    fn close(&self);
    /// The local end's IP address (TCP only).
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        None
    }
}

/// Both std streams have the same three methods under these names; TCP
/// also says its local address.
macro_rules! conn {
    ($stream:ty $(, $ip:expr)?) => {
        impl Conn for $stream {
            fn read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
                self.set_read_timeout(t)
            }
            fn nonblocking(&self, on: bool) -> std::io::Result<()> {
                self.set_nonblocking(on)
            }
            fn close(&self) {
                let _ = self.shutdown(std::net::Shutdown::Both);
            }
            $(
            fn local_ip(&self) -> Option<std::net::IpAddr> {
                ($ip)(self)
            }
            )?
        }
    };
}

conn!(UnixStream);
conn!(TcpStream, |s: &TcpStream| s
    .local_addr()
    .ok()
    .map(|a| a.ip()));

/// PEs meeting through rank 0: rank 0 accepts one stream per other rank,
/// and every collective goes through it. [`super::UnixSocket`] (processes of one
/// host) and [`super::Tcp`] (processes anywhere rank 0's address reaches).
pub struct Star<S: Conn> {
    rank: usize,
    size: usize,
    /// Rank 0: the streams of ranks 1.. (index rank - 1). Others: rank 0's.
    streams: Vec<S>,
    timeout: Duration,
    failed: Option<String>,
}

pub(crate) const HELLO: u32 = 0x7863_616c; // "xcal"

/// How long rank 0 waits for a new connection's hello.
pub(crate) const HELLO_WAIT: Duration = Duration::from_secs(2);

pub(crate) fn write_frame(s: &mut impl Conn, data: &[u8]) -> std::io::Result<()> {
    s.write_all(&(data.len() as u64).to_le_bytes())?;
    s.write_all(data)
}

/// Reads one frame of at most `max` bytes (checked before anything is
/// allocated).
pub(crate) fn read_frame(
    s: &mut impl Conn,
    deadline: Instant,
    max: usize,
) -> std::io::Result<Vec<u8>> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    s.read_timeout(Some(remaining.max(Duration::from_millis(1))))?;
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    let len = match usize::try_from(len) {
        Ok(l) if l <= max => l,
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a frame of {len} bytes, past the {max} bytes left for it"),
            ))
        }
    };
    let mut data = vec![0u8; len];
    s.read_exact(&mut data)?;
    Ok(data)
}

pub(crate) fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

pub(crate) fn hello(rank: usize, size: usize) -> Vec<u8> {
    let mut hello = HELLO.to_le_bytes().to_vec();
    hello.extend((rank as u32).to_le_bytes());
    hello.extend((size as u64).to_le_bytes());
    hello
}

/// Rank 0's side of the rendezvous at `place`: accepts until every rank
/// of `size` sent its hello, or the deadline. `accept` gives the next
/// pending connection (`WouldBlock` when none); `admit` may refuse one
/// (closed; a rank that never gets in is named by the timeout), and so is
/// a connection whose first frame is not xcall's hello.
pub(crate) fn gather<S: Conn>(
    mut accept: impl FnMut() -> std::io::Result<S>,
    admit: impl Fn(&S) -> bool,
    place: &str,
    size: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<S>> {
    let mut by_rank: Vec<Option<S>> = (1..size).map(|_| None).collect();
    while by_rank.iter().any(Option::is_none) {
        match accept() {
            Ok(mut s) => {
                if !admit(&s) {
                    continue;
                }
                s.nonblocking(false)
                    .map_err(|e| ShmemError::os("set_nonblocking", e))?;
                // A connection that sends nothing must not hold the others
                // up for long, nor a stranger's bytes fail the world:
                // either is dropped (a rank sends its hello as it connects).
                let hello_by = deadline.min(Instant::now() + HELLO_WAIT);
                let Ok(hello) = read_frame(&mut s, hello_by, 64) else {
                    continue;
                };
                if hello.len() != 16 || u32::from_le_bytes(hello[0..4].try_into().unwrap()) != HELLO
                {
                    continue; // not one of ours
                }
                let r = u32::from_le_bytes(hello[4..8].try_into().unwrap()) as usize;
                let n = u64::from_le_bytes(hello[8..16].try_into().unwrap()) as usize;
                if n != size {
                    return Err(ShmemError::Mismatch(format!(
                        "rank {r} connected to {place} for a world of {n} PEs, rank 0 has {size}"
                    )));
                }
                if r == 0 || r >= size || by_rank[r - 1].is_some() {
                    return Err(ShmemError::Mismatch(format!(
                        "a second PE connected to {place} as rank {r} (or rank out of range)"
                    )));
                }
                by_rank[r - 1] = Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let arrived: Vec<bool> = std::iter::once(true)
                        .chain(by_rank.iter().map(Option::is_some))
                        .collect();
                    return Err(ShmemError::Timeout(format!(
                        "rank 0 waited {timeout:?} at {place} for rank(s) {:?}, which never connected",
                        missing(&arrived)
                    )));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(ShmemError::os(format!("accept on {place}"), e)),
        }
    }
    Ok(by_rank
        .into_iter()
        .map(|s| s.expect("every rank connected"))
        .collect())
}

/// A rank's side: connects (retrying while rank 0 is not listening yet)
/// and sends its hello.
pub(crate) fn dial<S: Conn>(
    mut connect: impl FnMut(Duration) -> std::io::Result<S>,
    place: &str,
    rank: usize,
    size: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<S> {
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match connect(left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(e)
                if Instant::now() < deadline
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound
                            | std::io::ErrorKind::ConnectionRefused
                            | std::io::ErrorKind::TimedOut
                    ) =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                return Err(if Instant::now() >= deadline {
                    ShmemError::Timeout(format!(
                        "rank {rank} waited {timeout:?} for rank 0 to listen at {place} ({e})"
                    ))
                } else {
                    ShmemError::os(format!("connect {place}"), e)
                })
            }
        }
    };
    write_frame(&mut s, &hello(rank, size)).map_err(|e| ShmemError::os("sending hello", e))?;
    Ok(s)
}

impl<S: Conn> Star<S> {
    pub(crate) fn new(rank: usize, size: usize, streams: Vec<S>, timeout: Duration) -> Star<S> {
        Star {
            rank,
            size,
            streams,
            timeout,
            failed: None,
        }
    }

    fn fail(&mut self, msg: String) -> ShmemError {
        self.failed = Some(msg.clone());
        // Closing tells every peer at once instead of after its own timeout.
        for s in &self.streams {
            s.close();
        }
        ShmemError::Timeout(msg)
    }
}

impl<S: Conn> Bootstrap for Star<S> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.streams.first().and_then(Conn::local_ip)
    }

    fn size(&self) -> usize {
        self.size
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if let Some(f) = &self.failed {
            return Err(ShmemError::Timeout(f.clone()));
        }
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            let mut all = vec![data.to_vec()];
            // What rank 0 answers holds every PE's data with its length.
            let mut left = MAX_FRAME.checked_sub(8 + data.len());
            for r in 1..self.size {
                let Some(room) = left.and_then(|l| l.checked_sub(8)) else {
                    return Err(self.fail(format!(
                        "rank 0 stopped a collective at rank {r}: its PEs' data together pass the bootstrap's frame limit of {MAX_FRAME} bytes"
                    )));
                };
                match read_frame(&mut self.streams[r - 1], deadline, room) {
                    Ok(d) => {
                        left = room.checked_sub(d.len());
                        all.push(d);
                    }
                    Err(e) => {
                        let why = if timed_out(&e) {
                            format!("never arrived within {:?}", self.timeout)
                        } else if e.kind() == std::io::ErrorKind::InvalidData {
                            format!("sent more than the collective's data may hold together ({MAX_FRAME} bytes): {e}")
                        } else {
                            format!("left the world ({e})")
                        };
                        return Err(self.fail(format!(
                            "rank 0 waited in a collective for rank {r}, which {why}"
                        )));
                    }
                }
            }
            let mut packed = Vec::with_capacity(all.iter().map(|d| 8 + d.len()).sum());
            for d in &all {
                packed.extend((d.len() as u64).to_le_bytes());
                packed.extend(d);
            }
            for r in 1..self.size {
                if let Err(e) = write_frame(&mut self.streams[r - 1], &packed) {
                    return Err(self.fail(format!("rank 0 could not answer rank {r} ({e})")));
                }
            }
            Ok(all)
        } else {
            let rank = self.rank;
            let packed = write_frame(&mut self.streams[0], data)
                .and_then(|()| read_frame(&mut self.streams[0], deadline, MAX_FRAME));
            let packed = match packed {
                Ok(p) => p,
                Err(e) => {
                    let why = if timed_out(&e) {
                        format!("no answer within {:?}: a PE never arrived", self.timeout)
                    } else {
                        format!("rank 0 closed the bootstrap, a PE failed or never arrived ({e})")
                    };
                    return Err(self.fail(format!("rank {rank} in a collective: {why}")));
                }
            };
            match unpack(&packed, self.size) {
                Some(all) => Ok(all),
                None => Err(self.fail(format!("rank {rank}: malformed answer from rank 0"))),
            }
        }
    }
}

/// The `size` records of rank 0's answer (each a little-endian u64 length
/// and its bytes), or `None` when it is not exactly that.
pub(crate) fn unpack(packed: &[u8], size: usize) -> Option<Vec<Vec<u8>>> {
    let mut all = Vec::with_capacity(size.min(packed.len() / 8));
    let mut rest = packed;
    while !rest.is_empty() {
        let (len, tail) = rest.split_first_chunk::<8>()?;
        let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
        if len > tail.len() {
            return None;
        }
        let (record, tail) = tail.split_at(len);
        all.push(record.to_vec());
        rest = tail;
    }
    (all.len() == size).then_some(all)
}
