//! The Host side of a world: heaps in anonymous memory (one process) or
//! POSIX shared memory (`shm_open` + `mmap`, when a peer is another
//! process), and peers' heaps mapped from their names.

use std::ffi::CString;
use std::sync::Mutex;

use crate::error::{Result, ShmemError};

/// One PE's Host heap.
pub(crate) struct HostHeap {
    pub base: u64,
    pub len: usize,
    /// The shared-memory name while it is still linked.
    name: Mutex<Option<CString>>,
}

fn last_os_error(what: String) -> ShmemError {
    ShmemError::os(what, std::io::Error::last_os_error())
}

fn map(fd: i32, len: usize) -> Result<u64> {
    let flags = if fd < 0 {
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS
    } else {
        libc::MAP_SHARED
    };
    // SAFETY: a fresh mapping chosen by the kernel; `fd` is -1 or an open
    // shared-memory object of at least `len` bytes.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(last_os_error(format!("mmap of {len} bytes")));
    }
    if fd < 0 {
        // Transparent huge pages where the system offers them on request:
        // a step's rows are scattered over the heap, and with 4 KiB pages
        // most row accesses miss the TLB. Only advice: refused or
        // unsupported, the heap works as before.
        // SAFETY: the range is the mapping just made.
        unsafe { libc::madvise(addr, len, libc::MADV_HUGEPAGE) };
    }
    Ok(addr as u64)
}

impl HostHeap {
    /// A heap only this process maps.
    pub fn private(len: usize) -> Result<HostHeap> {
        Ok(HostHeap {
            base: map(-1, len)?,
            len,
            name: Mutex::new(None),
        })
    }

    /// A heap other processes can map by `name` (`/xcall-...`).
    pub fn shared(name: &str, len: usize) -> Result<HostHeap> {
        let c = CString::new(name).map_err(|_| ShmemError::InvalidArgument(format!("{name:?}")))?;
        // SAFETY: a NUL-terminated name; O_EXCL: never someone else's.
        let fd = unsafe {
            libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(last_os_error(format!("shm_open {name}")));
        }
        // From here on the name exists: the heap's Drop unlinks it.
        let mut heap = HostHeap {
            base: 0,
            len,
            name: Mutex::new(Some(c)),
        };
        // SAFETY: `fd` is the object just created.
        let sized = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        let mapped = if sized == 0 {
            map(fd, len)
        } else {
            Err(last_os_error(format!(
                "ftruncate {name} to {len} bytes (is /dev/shm large enough?)"
            )))
        };
        // SAFETY: closes the descriptor opened above; the mapping stays.
        unsafe { libc::close(fd) };
        heap.base = mapped?;
        Ok(heap)
    }

    /// Removes the name (every peer has mapped the heap by now); the
    /// memory lives on until the last mapping goes.
    pub fn unlink(&self) {
        let name = self.name.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(name) = name {
            // SAFETY: a NUL-terminated name this PE created.
            unsafe { libc::shm_unlink(name.as_ptr()) };
        }
    }
}

impl Drop for HostHeap {
    fn drop(&mut self) {
        if self.base != 0 {
            // SAFETY: unmaps the mapping made by this heap.
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
        }
        self.unlink();
    }
}

/// A peer's heap mapped into this process (unmapped on drop).
pub(crate) struct HostMapping {
    pub base: u64,
    len: usize,
}

impl HostMapping {
    pub fn open(name: &str, len: usize) -> Result<HostMapping> {
        let c = CString::new(name).map_err(|_| ShmemError::InvalidArgument(format!("{name:?}")))?;
        // SAFETY: a NUL-terminated name.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(last_os_error(format!("shm_open {name} (a peer's heap)")));
        }
        let mapped = map(fd, len);
        // SAFETY: closes the descriptor opened above.
        unsafe { libc::close(fd) };
        Ok(HostMapping { base: mapped?, len })
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `open`.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// "hostname/boot-id": equal for two processes of one running machine.
/// Environment variable that names this process's host in a world in
/// place of its hostname and boot id: processes of one machine given
/// different names form a world of several hosts (their pairs take the
/// transport across hosts, each "host" has its own state page), so one
/// machine runs that path.
pub const HOST_ENV: &str = "XCALL_SHMEM_HOST";

/// This process's host as the PEs of a world compare it: [`HOST_ENV`]
/// when set (one line of at most 255 bytes), else the hostname and the
/// kernel's boot id. A malformed [`HOST_ENV`] is an `InvalidArgument`
/// naming it: a program checks it with this before any world starts.
pub fn host_identity() -> crate::error::Result<String> {
    if let Some(name) = xcall_core::env::text(HOST_ENV)
        .map_err(|e| crate::error::ShmemError::InvalidArgument(e.to_string()))?
    {
        if name.is_empty() || name.len() > 255 || name.contains(['\n', '\r']) {
            return Err(crate::error::ShmemError::InvalidArgument(format!(
                "{HOST_ENV}={name:?}: a host's name is one line of 1 to 255 bytes"
            )));
        }
        return Ok(format!("named/{name}"));
    }
    let mut buf = [0u8; 256];
    // SAFETY: writes at most `buf.len()` bytes.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let name = if ok {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown-host".to_string()
    };
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    Ok(format!("{name}/{}", boot.trim()))
}
