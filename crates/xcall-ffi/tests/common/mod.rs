//! What the test programs that build C against this crate share.

use std::path::{Path, PathBuf};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The library `file` (`libxcall.a`, `libxcall.so`) that cargo built for
/// this test run. Built as a test dependency, it lands in
/// `target/<profile>/deps/` next to the test binary and is not copied up to
/// `target/<profile>/` (where an older `cargo build` may have left a stale
/// one), so `deps/` comes first.
pub fn built_library(file: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let candidates = [deps.join(file), deps.parent().unwrap_or(deps).join(file)];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .unwrap_or_else(|| panic!("{file} not found in {candidates:?}: build xcall-ffi first"))
}

/// The C (or C++) compiler for the target these tests run on.
pub fn compiler(cpp: bool) -> cc::Tool {
    let target = env!("XCALL_BUILD_TARGET");
    cc::Build::new()
        .cpp(cpp)
        .target(target)
        .host(target)
        .opt_level(0)
        .cargo_metadata(false)
        .try_get_compiler()
        .expect("a C/C++ compiler (cc crate)")
}
