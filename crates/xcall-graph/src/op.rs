//! Running an op through the cache with the op's own error type kept whole:
//! what a runtime integration needs to report the op's status and message,
//! not "the record function failed".

use crate::backend::GraphBackend;
use crate::cache::{Call, GraphCache, Outcome};
use crate::error::GraphError;

/// Why [`GraphCache::execute_op`] failed.
#[derive(Debug)]
pub enum OpFailure<E> {
    /// The cache refused the call or the driver failed.
    Cache(GraphError),
    /// The op failed (when it ran eagerly, or during capture and then again
    /// eagerly): its last error, as it returned it.
    Op(E),
}

impl<B: GraphBackend> GraphCache<B> {
    /// [`execute`](GraphCache::execute) for a record function with its own
    /// error type: the op's error comes back as it was, not boxed. When the
    /// op fails under capture and then succeeds eagerly, the call succeeds.
    pub fn execute_op<E: std::fmt::Display>(
        &self,
        call: &Call<B::Stream>,
        mut op: impl FnMut(Option<B::Stream>) -> Result<(), E>,
    ) -> Result<Outcome, OpFailure<E>> {
        let mut failure: Option<E> = None;
        let outcome = self.execute(call, |stream| {
            op(stream).map_err(|e| {
                let message = e.to_string();
                failure = Some(e);
                message
            })
        });
        match (outcome, failure) {
            (Ok(outcome), _) => Ok(outcome),
            (Err(GraphError::Callback(_)), Some(e)) => Err(OpFailure::Op(e)),
            (Err(e), _) => Err(OpFailure::Cache(e)),
        }
    }
}
