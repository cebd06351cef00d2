//! The two helpers every step of init and every collective builds on: a
//! result agreed on by every PE, and the fields of a PE's record.

use crate::bootstrap::Bootstrap;
use crate::error::{Result, ShmemError};

/// Sends this PE's result to every PE; every PE returns the first failure
/// (its own first), so a step that fails anywhere fails everywhere.
pub(super) fn agree<T>(boot: &mut dyn Bootstrap, local: Result<T>) -> Result<T> {
    let msg = match &local {
        Ok(_) => Vec::new(),
        Err(e) => e.encode(),
    };
    let all = boot.allgather(&msg)?;
    let local = local?;
    match all.iter().position(|m| !m.is_empty()) {
        Some(r) => Err(ShmemError::decode(r, &all[r])),
        None => Ok(local),
    }
}

/// The lines of a PE's record (`what\nseq\narg`, an identity).
pub(super) fn fields(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .split('\n')
        .map(str::to_string)
        .collect()
}
