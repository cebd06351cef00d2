// Over 600 lines: the bootstraps behind one trait, with the framing and timeouts they share.
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

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Result, ShmemError};

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

fn check_rank(rank: usize, size: usize) -> Result<()> {
    if size == 0 || rank >= size {
        return Err(ShmemError::InvalidArgument(format!(
            "rank {rank} is not in a world of {size} PE(s)"
        )));
    }
    if size > crate::world::MAX_PES {
        return Err(ShmemError::InvalidArgument(format!(
            "a world of {size} PEs is larger than the limit of {}",
            crate::world::MAX_PES
        )));
    }
    Ok(())
}

fn missing(arrived: &[bool]) -> Vec<usize> {
    (0..arrived.len()).filter(|&r| !arrived[r]).collect()
}

// ------------------------------------------------------------ in process

/// One round of an in-process collective.
struct Round {
    data: Vec<Option<Vec<u8>>>,
    arrived: usize,
    left: usize,
}

struct GroupState {
    joined: Vec<bool>,
    members: usize,
    rounds: HashMap<u64, Round>,
    /// The error every later collective of the group returns, and when it
    /// was recorded (a failed group nobody joined expires after
    /// `expires`, so its name can be used again).
    failed: Option<(ShmemError, Instant)>,
    expires: Duration,
    /// The rank whose failure before joining failed the group.
    abandoned_by: Option<usize>,
}

struct Group {
    name: String,
    size: usize,
    state: Mutex<GroupState>,
    changed: Condvar,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, GroupState> {
        // A panic on another PE's thread must not wedge this one: the state
        // is only counters and buffers, valid after any interrupted update.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn groups() -> &'static Mutex<HashMap<String, Arc<Group>>> {
    static GROUPS: OnceLock<Mutex<HashMap<String, Arc<Group>>>> = OnceLock::new();
    GROUPS.get_or_init(Default::default)
}

/// Whether in-process group `name` exists (some member is joined).
pub fn group_alive(name: &str) -> bool {
    groups()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(name)
}

/// PEs that are threads of this process, meeting by group name.
pub struct InProcess {
    group: Arc<Group>,
    rank: usize,
    seq: u64,
    timeout: Duration,
}

impl InProcess {
    /// Joins group `name` of `size` PEs as `rank`. The group exists while
    /// at least one member is joined; a name is reusable once every member
    /// left.
    pub fn join(name: &str, rank: usize, size: usize, timeout: Duration) -> Result<InProcess> {
        check_rank(rank, size)?;
        let mut all = groups().lock().unwrap_or_else(|p| p.into_inner());
        let group = group_entry(&mut all, name, size, timeout, Some(rank));
        if group.size != size {
            return Err(ShmemError::Mismatch(format!(
                "group {name:?} has {} PEs, rank {rank} asked for {size}",
                group.size
            )));
        }
        let mut st = group.lock();
        if let Some((e, _)) = &st.failed {
            return Err(e.clone());
        }
        if st.joined[rank] {
            return Err(ShmemError::State(format!(
                "rank {rank} of group {name:?} is already joined (two PEs with one rank, or init twice)"
            )));
        }
        st.joined[rank] = true;
        st.members += 1;
        drop(st);
        Ok(InProcess {
            group,
            rank,
            seq: 0,
            timeout,
        })
    }
}

/// Group `name` of `size` PEs: the live one, or a new one in its place
/// when there is none or the one there failed with nobody joined and its
/// failure has expired or is the failure of `joining`, the rank that
/// joins now (a PE retrying its init after its own failure).
fn group_entry(
    all: &mut HashMap<String, Arc<Group>>,
    name: &str,
    size: usize,
    timeout: Duration,
    joining: Option<usize>,
) -> Arc<Group> {
    let stale = all.get(name).is_some_and(|g| {
        let st = g.lock();
        let retry = joining.is_some() && st.abandoned_by == joining;
        st.members == 0
            && st
                .failed
                .as_ref()
                .is_some_and(|(_, at)| retry || at.elapsed() >= st.expires)
    });
    if stale {
        all.remove(name);
    }
    all.entry(name.to_string())
        .or_insert_with(|| {
            Arc::new(Group {
                name: name.to_string(),
                size,
                state: Mutex::new(GroupState {
                    joined: vec![false; size],
                    members: 0,
                    rounds: HashMap::new(),
                    failed: None,
                    expires: timeout,
                    abandoned_by: None,
                }),
                changed: Condvar::new(),
            })
        })
        .clone()
}

/// Rank `rank` of in-process group `name` failed before it could join:
/// the group fails at once (its members' waits and every later join and
/// collective return [`ShmemError::PeerFailed`] naming `reason`) instead
/// of waiting out their timeouts for a rank that will never arrive. A
/// failed group nobody joins is forgotten after `timeout`, or when `rank`
/// itself joins again. A group of another size is left alone (its own
/// join reports the mismatch).
pub fn abandon(name: &str, rank: usize, size: usize, timeout: Duration, reason: &str) {
    if check_rank(rank, size).is_err() {
        return; // no group can have this rank
    }
    let mut all = groups().lock().unwrap_or_else(|p| p.into_inner());
    let group = group_entry(&mut all, name, size, timeout, None);
    if group.size != size {
        return;
    }
    let mut st = group.lock();
    if st.failed.is_none() {
        st.failed = Some((
            ShmemError::PeerFailed(format!(
                "group {name:?}: rank {rank} failed before joining: {reason}"
            )),
            Instant::now(),
        ));
        // A zero timeout (itself refused) still keeps the failure a while.
        st.expires = timeout.max(Duration::from_secs(1));
        st.abandoned_by = Some(rank);
    }
    drop(st);
    group.changed.notify_all();
}

impl Bootstrap for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (g, n, seq) = (&self.group, self.group.size, self.seq);
        self.seq += 1;
        let deadline = Instant::now() + self.timeout;
        let mut st = g.lock();
        if let Some((e, _)) = &st.failed {
            return Err(e.clone());
        }
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            data: vec![None; n],
            arrived: 0,
            left: 0,
        });
        round.data[self.rank] = Some(data.to_vec());
        round.arrived += 1;
        g.changed.notify_all();
        loop {
            if st.rounds[&seq].arrived == n {
                break;
            }
            if let Some((e, _)) = &st.failed {
                return Err(e.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let arrived: Vec<bool> = st.rounds[&seq].data.iter().map(Option::is_some).collect();
                let msg = format!(
                    "group {:?}: rank {} waited {:?} in collective #{seq} for rank(s) {:?}, which never arrived",
                    g.name,
                    self.rank,
                    self.timeout,
                    missing(&arrived)
                );
                st.failed = Some((ShmemError::Timeout(msg.clone()), Instant::now()));
                g.changed.notify_all();
                return Err(ShmemError::Timeout(msg));
            }
            st = g
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let round = st
            .rounds
            .get_mut(&seq)
            .expect("round exists until all left");
        let out = round
            .data
            .iter()
            .map(|d| d.clone().unwrap_or_default())
            .collect();
        round.left += 1;
        if round.left == n {
            st.rounds.remove(&seq);
        }
        Ok(out)
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        let mut all = groups().lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.group.lock();
        st.joined[self.rank] = false;
        st.members -= 1;
        let last = st.members == 0;
        drop(st);
        if last
            && all
                .get(&self.group.name)
                .is_some_and(|g| Arc::ptr_eq(g, &self.group))
        {
            all.remove(&self.group.name);
        }
    }
}

// ------------------------------------------------- star over streams

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
/// and every collective goes through it. [`UnixSocket`] (processes of one
/// host) and [`Tcp`] (processes anywhere rank 0's address reaches).
pub struct Star<S: Conn> {
    rank: usize,
    size: usize,
    /// Rank 0: the streams of ranks 1.. (index rank - 1). Others: rank 0's.
    streams: Vec<S>,
    timeout: Duration,
    failed: Option<String>,
}

/// PEs that are processes of one host, meeting at a Unix domain socket:
/// rank 0 listens at the path (and removes it once every PE connected),
/// the others connect to it. Only processes of this user are admitted.
pub type UnixSocket = Star<UnixStream>;

/// PEs that are processes on any hosts rank 0's address reaches, meeting
/// at a TCP `host:port` (what launchers export as `MASTER_ADDR` and
/// `MASTER_PORT`): rank 0 listens there until every PE connected, the
/// others connect to it. A connection is admitted when its first frame is
/// xcall's hello for a world of the same size; the network is trusted, as
/// with the rendezvous stores of the launchers.
pub type Tcp = Star<TcpStream>;

const HELLO: u32 = 0x7863_616c; // "xcal"

/// How long rank 0 waits for a new connection's hello.
const HELLO_WAIT: Duration = Duration::from_secs(2);

fn write_frame(s: &mut impl Conn, data: &[u8]) -> std::io::Result<()> {
    s.write_all(&(data.len() as u64).to_le_bytes())?;
    s.write_all(data)
}

/// The largest frame a bootstrap sends: one collective's data of every PE
/// together, as rank 0 answers it.
pub const MAX_FRAME: usize = 1 << 30;

/// Reads one frame of at most `max` bytes (checked before anything is
/// allocated).
fn read_frame(s: &mut impl Conn, deadline: Instant, max: usize) -> std::io::Result<Vec<u8>> {
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

fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn hello(rank: usize, size: usize) -> Vec<u8> {
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
fn gather<S: Conn>(
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
fn dial<S: Conn>(
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
    fn new(rank: usize, size: usize, streams: Vec<S>, timeout: Duration) -> Star<S> {
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

impl UnixSocket {
    /// Connects rank `rank` of `size` through the socket at `path`.
    pub fn connect(path: &Path, rank: usize, size: usize, timeout: Duration) -> Result<UnixSocket> {
        check_rank(rank, size)?;
        let deadline = Instant::now() + timeout;
        let place = format!("{path:?}");
        let streams = if rank == 0 {
            remove_stale_socket(path)?;
            let listener = UnixListener::bind(path)
                .map_err(|e| ShmemError::os(format!("bind {path:?}"), e))?;
            let _unlink = Unlink(path.to_path_buf());
            // Owner only; a connection is admitted only from this user anyway
            // (checked per connection), this closes the door earlier.
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| ShmemError::os(format!("chmod 0600 {path:?}"), e))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| ShmemError::os("set_nonblocking", e))?;
            // A world must not take in strangers: another user's
            // connection is closed.
            let admit = |s: &UnixStream| same_user(s).is_ok();
            gather(
                || listener.accept().map(|(s, _)| s),
                admit,
                &place,
                size,
                deadline,
                timeout,
            )?
        } else {
            let connect = |_| UnixStream::connect(path);
            let s = dial(connect, &place, rank, size, deadline, timeout)?;
            same_user(&s).map_err(|why| {
                ShmemError::System(format!(
                    "the listener at {path:?} is not rank 0 of this user: {why}"
                ))
            })?;
            vec![s]
        };
        Ok(Star::new(rank, size, streams, timeout))
    }
}

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

/// Makes way for rank 0's socket at `path`: nothing there is fine; a socket
/// nobody listens on (left by a crashed run) is removed; a live socket, or
/// anything that is not a socket, is an error naming the path (a mistyped
/// path must never cost a file).
fn remove_stale_socket(path: &Path) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ShmemError::os(format!("inspecting {path:?}"), e)),
    };
    if !meta.file_type().is_socket() {
        return Err(ShmemError::InvalidArgument(format!(
            "{path:?} exists and is not a socket; the bootstrap address must be a free path (nothing was removed)"
        )));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(ShmemError::State(format!(
            "a process is listening at {path:?} already (another world's rank 0?); use another address"
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => std::fs::remove_file(path)
            .map_err(|e| ShmemError::os(format!("removing the stale socket {path:?}"), e)),
        Err(e) => Err(ShmemError::os(format!("probing the socket {path:?}"), e)),
    }
}

/// Whether the process at the other end of `s` runs as this user
/// (SO_PEERCRED).
fn same_user(s: &UnixStream) -> std::result::Result<(), String> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of a ucred; the fd is
    // an open Unix socket owned by `s`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(format!("SO_PEERCRED: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if cred.uid != me {
        return Err(format!(
            "pid {} runs as uid {}, this process as uid {me}",
            cred.pid, cred.uid
        ));
    }
    Ok(())
}

/// Removes the socket path when rank 0 has every PE connected (or failed).
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
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
fn unpack(packed: &[u8], size: usize) -> Option<Vec<Vec<u8>>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks outside the world and sizes past `MAX_PES` are refused
    /// before a group is made (nothing allocated for them); `MAX_PES`
    /// itself joins. `abandon` with such a rank makes no group.
    #[test]
    fn joins_check_rank_and_size_first() {
        let t = Duration::from_secs(5);
        let max = crate::world::MAX_PES;
        for (rank, size) in [(2, 2), (0, 0), (5, 3), (0, max + 1), (0, usize::MAX)] {
            let e = InProcess::join("check-rank", rank, size, t)
                .err()
                .unwrap_or_else(|| panic!("rank {rank} of {size} joined"));
            assert_eq!(e.status(), xcall_core::Status::InvalidArgument, "{e}");
            abandon("check-rank-abandon", rank, size, t, "bad");
            assert!(!group_alive("check-rank-abandon"), "rank {rank} of {size}");
        }
        assert!(!group_alive("check-rank"));
        let b = InProcess::join("check-rank-max", max - 1, max, t).unwrap();
        assert_eq!((b.rank(), b.size()), (max - 1, max));
        drop(b);
        assert!(!group_alive("check-rank-max"));
    }

    /// While rank 0 listens, its socket is owner-only; a same-user rank 1
    /// is admitted and the collective works.
    #[test]
    fn the_listening_socket_is_owner_only_and_admits_this_user() {
        let path = std::env::temp_dir().join(format!("xcall-perm-{}.sock", std::process::id()));
        let p0 = path.clone();
        let zero = std::thread::spawn(move || {
            let mut b = UnixSocket::connect(&p0, 0, 2, Duration::from_secs(20)).unwrap();
            b.allgather(b"zero").unwrap()
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let mode = loop {
            // The mode is set right after bind: wait until it shows.
            if let Ok(m) = std::fs::symlink_metadata(&path) {
                let mode = m.permissions().mode() & 0o777;
                if mode == 0o600 || Instant::now() >= deadline {
                    break mode;
                }
            }
            assert!(Instant::now() < deadline, "watchdog: rank 0 never listened");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(mode, 0o600, "socket mode {mode:o}");
        let mut one = UnixSocket::connect(&path, 1, 2, Duration::from_secs(20)).unwrap();
        let all = one.allgather(b"one").unwrap();
        assert_eq!(all, vec![b"zero".to_vec(), b"one".to_vec()]);
        assert_eq!(zero.join().unwrap(), all);
        assert!(!path.exists(), "removed once every PE connected");
    }

    fn free_port() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    /// Over TCP a connection that is not a rank (silent, or sending
    /// anything but the hello) is dropped and the world still forms; a
    /// rank of another size fails it by name; a missing rank is named by
    /// the timeout; an address that does not resolve is refused.
    #[test]
    fn tcp_ranks_meet_past_strangers() {
        let address = format!("127.0.0.1:{}", free_port());
        let t = Duration::from_secs(20);
        let ranks: Vec<_> = (0..3)
            .map(|r| {
                let a = address.clone();
                std::thread::spawn(move || {
                    if r > 0 {
                        // Rank 0 first, so the strangers below get in first.
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    let mut b = Tcp::connect(&a, r, 3, t)?;
                    b.allgather(format!("rank {r}").as_bytes())
                })
            })
            .collect();
        let deadline = Instant::now() + t;
        let mut strangers = Vec::new();
        while strangers.len() < 2 {
            assert!(Instant::now() < deadline, "watchdog: rank 0 never listened");
            match TcpStream::connect(&address) {
                Ok(mut s) => {
                    if strangers.is_empty() {
                        s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
                    }
                    strangers.push(s); // the second stays silent
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        let want: Vec<Vec<u8>> = (0..3).map(|r| format!("rank {r}").into_bytes()).collect();
        for (r, h) in ranks.into_iter().enumerate() {
            assert_eq!(h.join().unwrap().unwrap(), want, "rank {r}");
        }

        let address = format!("127.0.0.1:{}", free_port());
        let a = address.clone();
        let zero = std::thread::spawn(move || Tcp::connect(&a, 0, 2, t).err());
        let e = Tcp::connect(&address, 1, 3, t);
        let e0 = zero.join().unwrap().expect("rank 0 took a rank of 3 PEs");
        assert_eq!(e0.status(), xcall_core::Status::CollectiveMismatch, "{e0}");
        assert!(
            e0.to_string().contains("world of 3 PEs, rank 0 has 2"),
            "{e0}"
        );
        drop(e);

        let started = Instant::now();
        let address = format!("127.0.0.1:{}", free_port());
        let e = Tcp::connect(&address, 0, 2, Duration::from_millis(300))
            .err()
            .expect("a world with a missing rank formed");
        assert_eq!(e.status(), xcall_core::Status::Timeout, "{e}");
        assert!(e.to_string().contains("rank(s) [1]"), "{e}");
        let e = Tcp::connect(&address, 1, 2, Duration::from_millis(300))
            .err()
            .expect("rank 1 connected to nobody");
        assert_eq!(e.status(), xcall_core::Status::Timeout, "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));

        let e = Tcp::connect("no-such-host.invalid:1", 1, 2, t)
            .err()
            .unwrap();
        assert_eq!(e.status(), xcall_core::Status::InvalidArgument, "{e}");
        let e = Tcp::connect("127.0.0.1", 1, 2, t).err().unwrap();
        assert_eq!(e.status(), xcall_core::Status::InvalidArgument, "{e}");
    }

    #[test]
    fn same_user_accepts_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(same_user(&a), Ok(()));
    }

    /// Rank 0's answer is split into exactly `size` records; a length
    /// past the end, a short tail or a wrong count is malformed (never a
    /// panic), and empty records count.
    #[test]
    fn answers_unpack_exactly_or_not_at_all() {
        let pack = |records: &[&[u8]]| {
            let mut p = Vec::new();
            for r in records {
                p.extend((r.len() as u64).to_le_bytes());
                p.extend(*r);
            }
            p
        };
        let good = pack(&[b"ab", b"", b"xyz"]);
        assert_eq!(
            unpack(&good, 3),
            Some(vec![b"ab".to_vec(), vec![], b"xyz".to_vec()])
        );
        assert_eq!(unpack(&good, 2), None);
        assert_eq!(unpack(&good, 4), None);
        assert_eq!(unpack(&good[..good.len() - 1], 3), None);
        assert_eq!(unpack(&good[..5], 1), None);
        let mut huge = good.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(unpack(&huge, 3), None);
        assert_eq!(unpack(&[], 0), Some(vec![]));
    }

    /// A frame longer than the room left is refused from its length alone,
    /// before its bytes are read or allocated; one that fits is read.
    #[test]
    fn frames_past_their_room_are_refused_by_length() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let by = || Instant::now() + Duration::from_secs(5);
        write_frame(&mut a, b"0123456789").unwrap();
        assert_eq!(read_frame(&mut b, by(), 10).unwrap(), b"0123456789");
        write_frame(&mut a, b"0123456789").unwrap();
        let e = read_frame(&mut b, by(), 9).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("10 bytes"), "{e}");
        a.write_all(&u64::MAX.to_le_bytes()).unwrap();
        let e = read_frame(&mut b, by(), MAX_FRAME).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    }
}
