//! Errors of the graph cache.

use xcall_core::Status;

/// An error of [`crate::GraphCache::execute`] and friends.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// Bad input or a driver failure.
    #[error(transparent)]
    Core(#[from] xcall_core::Error),
    /// The caller's record function failed (when it ran eagerly, or during
    /// capture and again eagerly).
    #[error("the record function failed: {0}")]
    Callback(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl GraphError {
    /// The stable status code of this error.
    pub fn status(&self) -> Status {
        match self {
            GraphError::Core(e) => e.status(),
            GraphError::Callback(_) => Status::CallbackFailed,
        }
    }
}

/// Result of the graph cache.
pub type GraphResult<T> = std::result::Result<T, GraphError>;
