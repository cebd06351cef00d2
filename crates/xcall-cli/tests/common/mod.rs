//! Running the xcall binary from tests.
#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

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

/// The source tree the tests read docs from: `XCALL_SOURCE_ROOT` where a
/// test bundle carries a copy, else the checkout these tests were built in.
pub fn repo() -> std::path::PathBuf {
    std::env::var_os("XCALL_SOURCE_ROOT")
        .filter(|v| !v.is_empty())
        .map(Into::into)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// The published schema of every report, `docs/schema/report.schema.json`.
pub fn schema() -> serde_json::Value {
    let path = repo().join("docs/schema/report.schema.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the schema {} exists: {e}", path.display()));
    serde_json::from_str(&text).expect("the schema is JSON")
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

/// Every launcher's variables, removed from what a child inherits.
pub const LAUNCH_VARS: [&str; 13] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "MASTER_ADDR",
    "MASTER_PORT",
];

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// `xcall args...` as process `r` of `n` under `launcher` (all on this
/// host), meeting at `port`, with `envs` added.
pub fn spawn(
    launcher: &str,
    r: usize,
    n: usize,
    port: u16,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Child {
    let names: &[&str] = match launcher {
        "torchrun" => &LAUNCH_VARS[..4],
        "mpirun" => &LAUNCH_VARS[4..8],
        _ => &LAUNCH_VARS[8..11],
    };
    let mut cmd = xcall();
    for v in LAUNCH_VARS {
        cmd.env_remove(v);
    }
    for (name, value) in names.iter().zip([r, n, r, n]) {
        cmd.env(name, value.to_string());
    }
    cmd.envs(envs.iter().copied())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn xcall")
}

/// Waits for every child; one still running after `limit` is killed, and
/// the test fails naming the ones that were.
pub fn wait_all(what: &str, mut children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if children
            .iter_mut()
            .all(|c| matches!(c.try_wait(), Ok(Some(_))))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut hung = Vec::new();
    for (r, c) in children.iter_mut().enumerate() {
        if !matches!(c.try_wait(), Ok(Some(_))) {
            let _ = c.kill();
            hung.push(r);
        }
    }
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("a child's output"))
        .collect();
    assert!(
        hung.is_empty(),
        "{what}: process(es) {hung:?} still ran after {limit:?} and were killed; stderr: {:?}",
        outputs
            .iter()
            .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            .collect::<Vec<_>>()
    );
    outputs
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `n` processes of `xcall args...` under `launcher` with `envs`
/// added; returns each one's output.
pub fn launch(launcher: &str, n: usize, args: &[&str], envs: &[(&str, &str)]) -> Vec<Output> {
    let port = free_port();
    let children = (0..n)
        .map(|r| spawn(launcher, r, n, port, args, envs))
        .collect();
    wait_all(
        &format!("{n} processes under {launcher}"),
        children,
        Duration::from_secs(120),
    )
}
