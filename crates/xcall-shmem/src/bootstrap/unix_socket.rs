//! PEs that are processes of one host, meeting at a Unix domain socket.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::check_rank;
use super::star::{dial, gather, Star};
use crate::error::{Result, ShmemError};

/// PEs that are processes of one host, meeting at a Unix domain socket:
/// rank 0 listens at the path (and removes it once every PE connected),
/// the others connect to it. Only processes of this user are admitted.
pub type UnixSocket = Star<UnixStream>;

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
pub(crate) fn same_user(s: &UnixStream) -> std::result::Result<(), String> {
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
