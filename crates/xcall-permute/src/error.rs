//! Errors of the permutation ops.

use xcall_core::Status;

/// Why an op refused its arguments. Nothing is written when an op fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PermuteError {
    /// A shape, length or parameter that does not fit the op.
    #[error("{0}")]
    Shape(String),
    /// A dtype the op does not support in this direction.
    #[error("{0}")]
    Unsupported(String),
    /// A NULL address for a buffer that holds data.
    #[error("{0}")]
    Null(String),
    /// An error of the platform: CUDA driver, kernel compilation, device.
    #[error(transparent)]
    Platform(#[from] xcall_core::Error),
    /// Two buffers that must not share memory do.
    #[error("{output} overlaps {other}: the op reads row src and writes row dst != src, so it is not in-place safe")]
    Aliased {
        /// The output that overlaps.
        output: String,
        /// The input or other output it overlaps.
        other: String,
    },
}

impl PermuteError {
    /// The stable status code of this error.
    pub fn status(&self) -> Status {
        match self {
            PermuteError::Shape(_) => Status::InvalidArgument,
            PermuteError::Unsupported(_) => Status::Unsupported,
            PermuteError::Aliased { .. } => Status::Aliased,
            PermuteError::Null(_) => Status::NullArgument,
            PermuteError::Platform(e) => e.status(),
        }
    }
}

pub(crate) fn shape(message: impl Into<String>) -> PermuteError {
    PermuteError::Shape(message.into())
}
