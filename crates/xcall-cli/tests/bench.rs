//! `xcall bench` on Host: every crate's figures next to the copy measured
//! in the same run, as a table and as JSON.

mod common;

use common::{json_path, read_json, run};

#[test]
fn host_set_reports_every_crate_against_the_copy() {
    let path = json_path("bench-host");
    let (out, stdout) = run(&["bench", "--rounds", "2", "--json", path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = read_json(&path);
    let rows = j["rows"].as_array().unwrap();
    let crates: Vec<&str> = rows.iter().map(|r| r["crate"].as_str().unwrap()).collect();
    for want in ["reference", "permute", "warpspec", "shmem"] {
        assert!(crates.contains(&want), "{crates:?}");
    }
    for r in rows {
        assert!(r["us"].as_f64().unwrap() > 0.0, "{r}");
        if r["crate"] != "reference" {
            let ratio = r["ratio"].as_f64().unwrap();
            assert!(ratio.is_finite() && ratio > 0.0, "{r}");
            let gbs = r["gb_per_s"].as_f64().unwrap();
            let copy = rows[0]["gb_per_s"].as_f64().unwrap();
            assert!((ratio - gbs / copy).abs() < 1e-9 * ratio.max(1.0), "{r}");
        }
    }
    assert!(stdout.contains("put to PE 1's heap"), "{stdout}");
}

#[test]
fn zero_rounds_are_refused() {
    let (out, _) = run(&["bench", "--rounds", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rounds must be at least 1"));
}
