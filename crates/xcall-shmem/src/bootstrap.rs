// Over 600 lines: the two bootstraps behind one trait, with the framing and timeouts they share.
//! Rendezvous of processing elements: in-process groups and Unix-socket
//! bootstrap, with timeouts.
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

// --------------------------------------------------------- Unix socket

/// PEs that are processes of one host, meeting at a Unix domain socket:
/// rank 0 listens at the path (and removes it once every PE connected),
/// the others connect to it. Collectives go through rank 0.
pub struct UnixSocket {
    rank: usize,
    size: usize,
    /// Rank 0: the streams of ranks 1.. (index rank - 1). Others: rank 0's.
    streams: Vec<UnixStream>,
    timeout: Duration,
    failed: Option<String>,
}

const HELLO: u32 = 0x7863_616c; // "xcal"

fn write_frame(s: &mut UnixStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(&(data.len() as u64).to_le_bytes())?;
    s.write_all(data)
}

fn read_frame(s: &mut UnixStream, deadline: Instant) -> std::io::Result<Vec<u8>> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(remaining.max(Duration::from_millis(1))))?;
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len) as usize;
    if len > 1 << 30 {
        return Err(std::io::Error::other(format!("frame of {len} bytes")));
    }
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

impl UnixSocket {
    /// Connects rank `rank` of `size` through the socket at `path`.
    pub fn connect(path: &Path, rank: usize, size: usize, timeout: Duration) -> Result<UnixSocket> {
        check_rank(rank, size)?;
        let deadline = Instant::now() + timeout;
        let streams = if rank == 0 {
            Self::listen(path, size, deadline, timeout)?
        } else {
            vec![Self::dial(path, rank, size, deadline, timeout)?]
        };
        Ok(UnixSocket {
            rank,
            size,
            streams,
            timeout,
            failed: None,
        })
    }

    fn listen(
        path: &Path,
        size: usize,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<UnixStream>> {
        remove_stale_socket(path)?;
        let listener =
            UnixListener::bind(path).map_err(|e| ShmemError::os(format!("bind {path:?}"), e))?;
        let _unlink = Unlink(path.to_path_buf());
        // Owner only; a connection is admitted only from this user anyway
        // (checked per connection below), this closes the door earlier.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| ShmemError::os(format!("chmod 0600 {path:?}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| ShmemError::os("set_nonblocking", e))?;
        let mut by_rank: Vec<Option<UnixStream>> = (1..size).map(|_| None).collect();
        while by_rank.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    if same_user(&s).is_err() {
                        // Not admitted (a world must not take in strangers):
                        // the connection is closed; a rank that never gets
                        // in is named by the timeout.
                        continue;
                    }
                    s.set_nonblocking(false)
                        .map_err(|e| ShmemError::os("set_nonblocking", e))?;
                    let hello = read_frame(&mut s, deadline)
                        .map_err(|e| ShmemError::os("reading a PE's hello", e))?;
                    if hello.len() != 16
                        || u32::from_le_bytes(hello[0..4].try_into().unwrap()) != HELLO
                    {
                        continue; // not one of ours
                    }
                    let r = u32::from_le_bytes(hello[4..8].try_into().unwrap()) as usize;
                    let n = u64::from_le_bytes(hello[8..16].try_into().unwrap()) as usize;
                    if n != size {
                        return Err(ShmemError::Mismatch(format!(
                            "rank {r} connected to {path:?} for a world of {n} PEs, rank 0 has {size}"
                        )));
                    }
                    if r == 0 || r >= size || by_rank[r - 1].is_some() {
                        return Err(ShmemError::Mismatch(format!(
                            "a second PE connected to {path:?} as rank {r} (or rank out of range)"
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
                            "rank 0 waited {timeout:?} at {path:?} for rank(s) {:?}, which never connected",
                            missing(&arrived)
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(ShmemError::os(format!("accept on {path:?}"), e)),
            }
        }
        Ok(by_rank
            .into_iter()
            .map(|s| s.expect("every rank connected"))
            .collect())
    }

    fn dial(
        path: &Path,
        rank: usize,
        size: usize,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<UnixStream> {
        let mut s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e)
                    if Instant::now() < deadline
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    return Err(if Instant::now() >= deadline {
                        ShmemError::Timeout(format!(
                            "rank {rank} waited {timeout:?} for rank 0 to listen at {path:?} ({e})"
                        ))
                    } else {
                        ShmemError::os(format!("connect {path:?}"), e)
                    })
                }
            }
        };
        same_user(&s).map_err(|why| {
            ShmemError::System(format!(
                "the listener at {path:?} is not rank 0 of this user: {why}"
            ))
        })?;
        let mut hello = HELLO.to_le_bytes().to_vec();
        hello.extend((rank as u32).to_le_bytes());
        hello.extend((size as u64).to_le_bytes());
        write_frame(&mut s, &hello).map_err(|e| ShmemError::os("sending hello", e))?;
        Ok(s)
    }

    fn fail(&mut self, msg: String) -> ShmemError {
        self.failed = Some(msg.clone());
        // Closing tells every peer at once instead of after its own timeout.
        for s in &self.streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        ShmemError::Timeout(msg)
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

impl Bootstrap for UnixSocket {
    fn rank(&self) -> usize {
        self.rank
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
            for r in 1..self.size {
                match read_frame(&mut self.streams[r - 1], deadline) {
                    Ok(d) => all.push(d),
                    Err(e) => {
                        let why = if timed_out(&e) {
                            format!("never arrived within {:?}", self.timeout)
                        } else {
                            format!("left the world ({e})")
                        };
                        return Err(self.fail(format!(
                            "rank 0 waited in a collective for rank {r}, which {why}"
                        )));
                    }
                }
            }
            let mut packed = Vec::new();
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
                .and_then(|()| read_frame(&mut self.streams[0], deadline));
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
            let mut all = Vec::with_capacity(self.size);
            let mut at = 0;
            while at + 8 <= packed.len() {
                let len = u64::from_le_bytes(packed[at..at + 8].try_into().unwrap()) as usize;
                all.push(packed[at + 8..at + 8 + len].to_vec());
                at += 8 + len;
            }
            if all.len() != self.size {
                return Err(self.fail(format!("rank {rank}: malformed answer from rank 0")));
            }
            Ok(all)
        }
    }
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

    #[test]
    fn same_user_accepts_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(same_user(&a), Ok(()));
    }
}
