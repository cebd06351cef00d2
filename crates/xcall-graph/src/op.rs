//! Running an op through the cache with the op's own error type kept whole:
//! what a runtime integration needs to report the op's status and message,
//! not "the record function failed". [`GraphCache::run_op`] composes the
//! whole call of one of xcall's ops (a runtime handler's): its key from the
//! op's id, its attributes and its buffers, relocatable.

use xcall_core::Device;

use crate::backend::GraphBackend;
use crate::cache::{Call, GraphCache, Outcome};
use crate::error::GraphError;
use crate::key::{Attributes, Buffer, CallKey};

/// A stable id of an op for graph-cache keys: FNV-1a of its name (the same
/// in every process).
pub fn op_id(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One call of one of xcall's ops, as a runtime integration makes it.
pub struct OpCall<S> {
    /// The device it runs on.
    pub device: Device,
    /// The op ([`op_id`] of its name).
    pub op: u64,
    /// Its attributes (for example [`Attributes::named_ints`]), compared in
    /// full.
    pub attributes: Attributes,
    /// Its buffers, in the op's order.
    pub buffers: Vec<Buffer>,
    /// The caller's stream (required for CUDA, ignored on Host).
    pub stream: Option<S>,
}

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

impl<B: GraphBackend> GraphCache<B> {
    /// Runs one of xcall's ops through the cache: the key is (device, op,
    /// attributes, buffers), compared in full, and the call is
    /// [relocatable](Call::relocatable) (xcall's ops depend on their
    /// buffers only through the addresses: kernel variants by alignment,
    /// refusals by overlap, both kept by a relocation). Otherwise as
    /// [`execute_op`](GraphCache::execute_op).
    pub fn run_op<E: std::fmt::Display>(
        &self,
        call: OpCall<B::Stream>,
        op: impl FnMut(Option<B::Stream>) -> Result<(), E>,
    ) -> Result<Outcome, OpFailure<E>> {
        let key = CallKey {
            device: call.device,
            target: call.op,
            attributes: call.attributes,
            buffers: call.buffers,
        };
        self.execute_op(&Call::new(key, call.stream).relocatable(), op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_ids_are_fnv1a_of_the_name() {
        // FNV-1a reference values.
        assert_eq!(op_id(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(op_id("a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(op_id("xcall_permute"), op_id("xcall_unpermute"));
    }
}
