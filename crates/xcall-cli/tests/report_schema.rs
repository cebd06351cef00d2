//! The JSON reports against their published schema
//! (`docs/schema/report.schema.json`): `doctor --json` here; `moe` and
//! `bench` wherever a test reads their report (`common::read_json` checks
//! every one). The schema itself is checked to refuse what it must.

mod common;

use common::{check_report, run, schema_errors};
use serde_json::json;

fn doctor_report() -> serde_json::Value {
    let (out, stdout) = run(&["doctor", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).expect("doctor --json prints JSON only")
}

#[test]
fn doctor_json_conforms_and_says_what_the_text_says() {
    let doc = doctor_report();
    check_report(&doc);
    assert_eq!(doc["command"], "doctor");
    assert_eq!(doc["platforms"]["host"]["available"], true);
    let cuda = &doc["platforms"]["cuda"];
    match xcall_core::testing::cuda_devices_or_skip("doctor_json_lists_cuda_devices") {
        None => {
            assert_eq!(cuda["available"], false);
            assert!(cuda["error"]
                .as_str()
                .unwrap()
                .contains("CUDA is unavailable"));
            assert_eq!(doc["devices"].as_array().unwrap().len(), 1);
        }
        Some(n) => {
            assert_eq!(cuda["available"], true);
            assert_eq!(cuda["devices"], n);
            assert_eq!(doc["devices"].as_array().unwrap().len(), n + 1);
            assert_eq!(doc["peer_access"].as_array().unwrap().len(), n);
        }
    }
}

#[test]
fn doctor_json_to_a_file_is_the_same_report() {
    let path = common::json_path("doctor");
    let (out, stdout) = run(&["doctor", "--json", path.to_str().unwrap()]);
    assert!(out.status.success());
    assert!(stdout.is_empty(), "{stdout}");
    let doc = common::read_json(&path);
    assert_eq!(doc["platforms"], doctor_report()["platforms"]);
}

#[test]
fn the_schema_refuses_unknown_fields_wrong_types_and_old_names() {
    let good = doctor_report();
    assert!(schema_errors(&good).is_empty());
    let mut extra = good.clone();
    extra["surprise"] = json!(1);
    assert!(
        !schema_errors(&extra).is_empty(),
        "an undocumented field passed"
    );
    let mut typed = good.clone();
    typed["platforms"]["cuda"]["devices"] = json!("two");
    assert!(!schema_errors(&typed).is_empty(), "a string count passed");
    let mut version = good.clone();
    version["schema_version"] = json!(2);
    assert!(
        !schema_errors(&version).is_empty(),
        "another schema version passed"
    );
    let mut missing = good;
    missing.as_object_mut().unwrap().remove("timestamp");
    assert!(
        !schema_errors(&missing).is_empty(),
        "a report without a time passed"
    );
    // A moe report with the names of before: Rust Debug outcome names and
    // phase names with spaces.
    let moe = json!({
        "schema_version": 1, "command": "moe", "xcall_version": "0.1.0",
        "command_line": ["xcall"], "timestamp": "2026-11-23T10:00:00Z", "devices": [],
        "outcomes": {"EagerHost": 3},
    });
    let errors = schema_errors(&moe).join("\n");
    assert!(errors.contains("EagerHost"), "{errors}");
}
