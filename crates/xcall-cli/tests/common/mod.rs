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

/// Reads and parses a JSON report, checks it against the published schema
/// (see [`check_report`]), then removes the file.
pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).expect("the JSON report exists");
    let _ = std::fs::remove_file(path);
    let doc = serde_json::from_str(&text).expect("valid JSON");
    check_report(&doc);
    doc
}

/// The published schema of every report, `docs/schema/report.schema.json`.
pub fn schema() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/schema/report.schema.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("the schema exists"))
        .expect("the schema is JSON")
}

/// The schema's complaints about `doc` (empty when it conforms).
pub fn schema_errors(doc: &serde_json::Value) -> Vec<String> {
    let validator = jsonschema::draft202012::new(&schema()).expect("a valid schema");
    validator
        .iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path))
        .collect()
}

/// Panics unless `doc` conforms to the schema and every field name is
/// snake_case (device names, the keys of `graph_cache`, excepted).
pub fn check_report(doc: &serde_json::Value) {
    let errors = schema_errors(doc);
    assert!(
        errors.is_empty(),
        "the report breaks its schema: {errors:#?}\n{doc:#}"
    );
    fn walk(v: &serde_json::Value, parent: &str) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, child) in m {
                    if parent != "graph_cache" {
                        let snake = k.starts_with(|c: char| c.is_ascii_lowercase())
                            && k.chars()
                                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
                        assert!(snake, "field {k:?} (under {parent:?}) is not snake_case");
                    }
                    walk(child, k);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|c| walk(c, parent)),
            _ => {}
        }
    }
    walk(doc, "");
}
