//! Running the xcall binary from tests.

use std::process::{Command, Output};

/// The xcall binary: `XCALL_BIN` where a test bundle moved it, else cargo's.
pub fn xcall() -> Command {
    Command::new(
        std::env::var_os("XCALL_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_xcall").into()),
    )
}

/// Runs `xcall args...`; returns the output and its stdout as text.
pub fn run(args: &[&str]) -> (Output, String) {
    let out = xcall().args(args).output().expect("run xcall");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (out, stdout)
}

/// A JSON file path unique to this test process.
pub fn json_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("xcall-{name}-{}.json", std::process::id()))
}

/// Reads and parses a JSON report, then removes the file.
pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).expect("the JSON report exists");
    let _ = std::fs::remove_file(path);
    serde_json::from_str(&text).expect("valid JSON")
}
