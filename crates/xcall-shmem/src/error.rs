//! The error type of xcall-shmem and its status codes.

use xcall_core::Status;

/// An xcall-shmem error. Every variant maps to one stable status code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShmemError {
    /// A bad argument (range outside the heap, bad size, bad PE).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The world is not in a state for this call (not initialised,
    /// initialised twice, finalized).
    #[error("invalid state: {0}")]
    State(String),
    /// A PE did not arrive in time; names who waited for whom.
    #[error("timeout: {0}")]
    Timeout(String),
    /// The PEs disagree in a collective call; reported on every PE.
    #[error("collective mismatch: {0}")]
    Mismatch(String),
    /// The symmetric heap has no free block large enough.
    #[error("out of symmetric memory: {0}")]
    OutOfMemory(String),
    /// A peer cannot be reached directly (names the pair).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An operating-system call failed.
    #[error("system error: {0}")]
    System(String),
    /// A PE of the world left without finalize or failed in finalize:
    /// nothing more crosses the world; only finalize remains.
    #[error("peer failed: {0}")]
    PeerFailed(String),
    /// A platform error (CUDA driver, NVRTC, device ordinal).
    #[error(transparent)]
    Platform(#[from] xcall_core::Error),
}

impl ShmemError {
    /// The stable status of this error.
    pub fn status(&self) -> Status {
        match self {
            ShmemError::InvalidArgument(_) => Status::InvalidArgument,
            ShmemError::State(_) => Status::InvalidState,
            ShmemError::Timeout(_) => Status::Timeout,
            ShmemError::Mismatch(_) => Status::CollectiveMismatch,
            ShmemError::OutOfMemory(_) => Status::OutOfMemory,
            ShmemError::Unsupported(_) => Status::Unsupported,
            ShmemError::System(_) => Status::System,
            ShmemError::PeerFailed(_) => Status::PeerFailed,
            ShmemError::Platform(e) => e.status(),
        }
    }

    /// An OS error with what was being done.
    pub(crate) fn os(what: impl std::fmt::Display, e: std::io::Error) -> ShmemError {
        ShmemError::System(format!("{what}: {e}"))
    }

    /// The same error with `context` in front of its message.
    pub(crate) fn context(self, context: impl std::fmt::Display) -> ShmemError {
        match self {
            ShmemError::InvalidArgument(m) => {
                ShmemError::InvalidArgument(format!("{context}: {m}"))
            }
            ShmemError::State(m) => ShmemError::State(format!("{context}: {m}")),
            ShmemError::Timeout(m) => ShmemError::Timeout(format!("{context}: {m}")),
            ShmemError::Mismatch(m) => ShmemError::Mismatch(format!("{context}: {m}")),
            ShmemError::OutOfMemory(m) => ShmemError::OutOfMemory(format!("{context}: {m}")),
            ShmemError::Unsupported(m) => ShmemError::Unsupported(format!("{context}: {m}")),
            ShmemError::System(m) => ShmemError::System(format!("{context}: {m}")),
            ShmemError::PeerFailed(m) => ShmemError::PeerFailed(format!("{context}: {m}")),
            ShmemError::Platform(e) => ShmemError::Platform(e),
        }
    }

    /// A one-byte tag and the message, to send this error to other PEs.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let tag = self.status().code() as u8;
        let mut v = vec![tag];
        v.extend_from_slice(self.to_string().as_bytes());
        v
    }

    /// The error another PE sent with [`ShmemError::encode`], prefixed
    /// with its rank.
    pub(crate) fn decode(rank: usize, bytes: &[u8]) -> ShmemError {
        let msg = format!(
            "rank {rank}: {}",
            String::from_utf8_lossy(bytes.get(1..).unwrap_or_default())
        );
        match Status::from_code(u32::from(bytes.first().copied().unwrap_or(0))) {
            Some(Status::Timeout) => ShmemError::Timeout(msg),
            Some(Status::CollectiveMismatch) => ShmemError::Mismatch(msg),
            Some(Status::OutOfMemory) => ShmemError::OutOfMemory(msg),
            Some(Status::Unsupported) => ShmemError::Unsupported(msg),
            Some(Status::System) => ShmemError::System(msg),
            Some(Status::InvalidState) => ShmemError::State(msg),
            Some(Status::PeerFailed) => ShmemError::PeerFailed(msg),
            _ => ShmemError::InvalidArgument(msg),
        }
    }
}

/// Result with [`ShmemError`].
pub type Result<T, E = ShmemError> = std::result::Result<T, E>;

/// Calls `ready` until it returns `Ok(true)` or an error (returned as
/// is); `Ok(false)` when `timeout` passed first. Spins 64 times, then
/// yields the thread between calls. Every wait of a PE on its peers (a
/// signal, an exchange, NCCL's work) polls through it.
pub(crate) fn poll(
    timeout: std::time::Duration,
    mut ready: impl FnMut() -> Result<bool>,
) -> Result<bool> {
    let deadline = std::time::Instant::now() + timeout;
    let mut spins = 0u32;
    loop {
        if ready()? {
            return Ok(true);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        spins += 1;
        if spins > 64 {
            std::thread::yield_now();
        }
    }
}
