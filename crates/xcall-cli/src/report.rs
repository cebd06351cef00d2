//! What every command shares: its exit status, the `--json` file (checked
//! before any work starts), and the fields every JSON report begins with.
//! The reports' schemas are in `docs/schema/`; `docs/JSON.md` describes
//! them.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::{json, Map, Value};
use xcall_core::{cuda, Device, Platform};

/// The version of every report's layout. It grows when a field is renamed,
/// removed or changes meaning; new fields do not change it.
pub const SCHEMA_VERSION: u64 = 1;

/// Why a command failed, and so its exit status.
#[derive(Debug)]
pub enum Failure {
    /// The command line cannot be run as given (exit 2).
    Usage(String),
    /// The run failed, or what it checked did not match (exit 1).
    Runtime(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::Runtime(message)
    }
}

impl Failure {
    /// The process exit status.
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Usage(_) => 2,
            Failure::Runtime(_) => 1,
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        match self {
            Failure::Usage(m) | Failure::Runtime(m) => m,
        }
    }
}

/// The `--json` file of a command: opened for writing before the work
/// starts (a path that cannot be written is a usage error then, not after
/// the run), written at the end. A file this created and never wrote is
/// removed again; an existing file keeps its content until the report
/// replaces it.
pub struct JsonOut {
    path: PathBuf,
    file: Option<File>,
    created: bool,
}

impl JsonOut {
    /// Opens `path` for the report.
    pub fn open(path: &Path) -> Result<JsonOut, Failure> {
        let usage = |e: std::io::Error| Failure::Usage(format!("--json {}: {e}", path.display()));
        let created = !path.exists();
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(usage)?;
        Ok(JsonOut {
            path: path.to_path_buf(),
            file: Some(file),
            created,
        })
    }

    /// Opens `path` when there is one.
    pub fn open_optional(path: Option<&PathBuf>) -> Result<Option<JsonOut>, Failure> {
        path.map(|p| JsonOut::open(p)).transpose()
    }

    /// Writes `body` (an object) after the common fields of a report of
    /// `command` about `devices`.
    pub fn write(mut self, command: &str, devices: &[Device], body: Value) -> Result<(), String> {
        let doc = envelope(command, devices, body);
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())? + "\n";
        let mut file = self.file.take().expect("written once");
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
            .and_then(|()| file.write_all(text.as_bytes()))
            .and_then(|()| file.sync_all())
            .map_err(|e| format!("--json {}: {e}", self.path.display()))
    }
}

impl Drop for JsonOut {
    fn drop(&mut self) {
        if self.file.take().is_some() && self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The fields every report begins with, then `body`'s.
pub fn envelope(command: &str, devices: &[Device], body: Value) -> Value {
    let mut doc = Map::new();
    doc.insert("schema_version".into(), json!(SCHEMA_VERSION));
    doc.insert("command".into(), json!(command));
    doc.insert("xcall_version".into(), json!(env!("CARGO_PKG_VERSION")));
    doc.insert(
        "command_line".into(),
        json!(std::env::args_os()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()),
    );
    doc.insert(
        "timestamp".into(),
        json!(humantime::format_rfc3339_seconds(SystemTime::now()).to_string()),
    );
    doc.insert(
        "devices".into(),
        json!(devices.iter().map(|d| device_json(*d)).collect::<Vec<_>>()),
    );
    if let Value::Object(fields) = body {
        doc.extend(fields);
    }
    Value::Object(doc)
}

/// One device as the reports describe it.
pub fn device_json(d: Device) -> Value {
    match d.platform {
        Platform::Host => json!({
            "platform": "host", "ordinal": d.ordinal,
            "name": format!(
                "Host ({} hardware thread(s))",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            ),
        }),
        Platform::Cuda => match cuda::device_info(d) {
            Ok(info) => json!({
                "platform": "cuda", "ordinal": d.ordinal, "name": info.name,
                "arch": info.arch(), "multiprocessors": info.multiprocessors,
                "memory_bytes": info.total_memory,
            }),
            Err(e) => json!({
                "platform": "cuda", "ordinal": d.ordinal, "error": e.to_string(),
            }),
        },
    }
}

/// A progress bar of `len` steps on stderr, hidden when stderr is not a
/// terminal (indicatif's rule) or when log lines go there (`XCALL_LOG`).
pub fn progress_bar(len: u64) -> indicatif::ProgressBar {
    if xcall_core::log::installed() {
        indicatif::ProgressBar::with_draw_target(Some(len), indicatif::ProgressDrawTarget::hidden())
    } else {
        indicatif::ProgressBar::new(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("xcall-report-{name}-{}", std::process::id()))
    }

    #[test]
    fn a_report_file_never_written_is_removed_when_this_created_it() {
        let path = temp("new");
        let out = JsonOut::open(&path).unwrap();
        assert!(path.exists(), "checked by creating it");
        drop(out);
        assert!(!path.exists());
    }

    #[test]
    fn an_existing_file_keeps_its_content_until_the_report_replaces_it() {
        let path = temp("old");
        std::fs::write(&path, "a much longer old report than the new one\n").unwrap();
        drop(JsonOut::open(&path).unwrap());
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "a much longer old report than the new one\n"
        );
        JsonOut::open(&path)
            .unwrap()
            .write("doctor", &[], json!({"x": 1}))
            .unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(doc["x"], 1);
        assert_eq!(doc["command"], "doctor");
        assert_eq!(doc["schema_version"], SCHEMA_VERSION);
        assert_eq!(doc["devices"], json!([]));
    }

    #[test]
    fn a_path_that_cannot_be_written_is_a_usage_error() {
        let path = temp("missing-dir").join("x.json");
        let e = JsonOut::open(&path).err().unwrap();
        assert_eq!(e.exit_code(), 2);
        assert!(e.message().starts_with("--json "), "{}", e.message());
        assert_eq!(Failure::from("x".to_string()).exit_code(), 1);
    }

    #[test]
    fn the_envelope_comes_before_the_body_and_names_the_run() {
        let doc = envelope("bench", &[Device::HOST], json!({"rows": []}));
        assert_eq!(doc["xcall_version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(doc["devices"][0]["platform"], "host");
        assert_eq!(doc["devices"][0]["ordinal"], 0);
        assert!(!doc["command_line"].as_array().unwrap().is_empty());
        // RFC 3339 in UTC to the second: 2026-11-23T14:30:00Z.
        let t = doc["timestamp"].as_str().unwrap();
        assert_eq!(t.len(), 20, "{t}");
        assert!(
            t.ends_with('Z') && &t[4..5] == "-" && &t[10..11] == "T",
            "{t}"
        );
        assert_eq!(doc["rows"], json!([]));
    }
}
