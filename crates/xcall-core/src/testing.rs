//! Support for tests that need a GPU.
//!
//! GPU tests detect CUDA at run time. Without a usable GPU they print one
//! `SKIP` line and pass; with `XCALL_REQUIRE_CUDA=1` a missing GPU is a test
//! failure, so a GPU run cannot pass by skipping.

use crate::cuda;

/// Environment variable that turns "no GPU" from a skip into a failure.
pub const REQUIRE_ENV: &str = "XCALL_REQUIRE_CUDA";

/// Whether `XCALL_REQUIRE_CUDA=1` is set.
pub fn cuda_required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// The number of CUDA devices for GPU test `test`, or `None` after printing
/// a skip line when CUDA is unavailable.
///
/// # Panics
/// When CUDA is unavailable and `XCALL_REQUIRE_CUDA=1` is set: that is the
/// test failing.
pub fn cuda_devices_or_skip(test: &str) -> Option<usize> {
    match cuda::device_count() {
        Ok(n) => Some(n),
        Err(e) if cuda_required() => panic!("{test}: {REQUIRE_ENV}=1 but {e}"),
        Err(e) => {
            skip(test, &e.to_string());
            None
        }
    }
}

/// Prints `SKIP <test>: <reason>` on stderr. It writes to the stream
/// directly, so the line shows even when the test harness captures output.
pub fn skip(test: &str, reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIP {test}: {reason}");
}
