//! The errors of expert-parallel calls.

use xcall_core::Status;
use xcall_shmem::ShmemError;

/// What went wrong; each maps to one stable [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EpError {
    /// An argument outside its documented domain (a shape, a buffer too
    /// small, a null address); nothing was written.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A call out of order (combine before any dispatch, a destroyed
    /// group); nothing was written.
    #[error("invalid state: {0}")]
    State(String),
    /// The symmetric heap cannot hold the group.
    #[error("out of symmetric memory: {0}")]
    OutOfMemory(String),
    /// A peer did not reach a phase within the world's timeout.
    #[error("timeout: {0}")]
    Timeout(String),
    /// Routing published by a PE held an expert id outside `-1..E` or the
    /// same expert twice for one token; those routes were not taken.
    #[error("bad routing: {0}")]
    BadRouting(String),
    /// The world or its transport refused.
    #[error(transparent)]
    Shmem(#[from] ShmemError),
    /// The platform (driver, NVRTC) failed.
    #[error(transparent)]
    Platform(#[from] xcall_core::Error),
}

impl EpError {
    /// The stable status code of this error.
    pub fn status(&self) -> Status {
        match self {
            EpError::InvalidArgument(_) | EpError::BadRouting(_) => Status::InvalidArgument,
            EpError::State(_) => Status::InvalidState,
            EpError::OutOfMemory(_) => Status::OutOfMemory,
            EpError::Timeout(_) => Status::Timeout,
            EpError::Shmem(e) => e.status(),
            EpError::Platform(e) => e.status(),
        }
    }
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, EpError>;
