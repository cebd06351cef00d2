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

    // The put by message size: 4 KiB to the 8 MiB tensor in steps of 4x,
    // each next to a memcpy of the same bytes into PE 1's heap.
    let sizes = &j["shmem_sizes"];
    assert_eq!(sizes["put"], "put to PE 1's heap");
    assert_eq!(sizes["reference"], "memcpy into PE 1's heap");
    let points = sizes["points"].as_array().unwrap();
    let bytes: Vec<u64> = points
        .iter()
        .map(|p| p["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(
        bytes,
        [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    );
    for p in points {
        let f = |k: &str| p[k].as_f64().unwrap();
        let b = f("bytes");
        assert!(
            (f("put_gb_per_s") - b / f("put_us") / 1e3).abs() < 1e-9 * f("put_gb_per_s"),
            "{p}"
        );
        let rate = f("reference_gb_per_s");
        assert!(
            (rate - b / f("reference_us") / 1e3).abs() < 1e-9 * rate,
            "{p}"
        );
        assert!(
            (f("ratio") - f("put_gb_per_s") / rate).abs() < 1e-9 * f("ratio"),
            "{p}"
        );
    }
    assert!(
        stdout
            .contains("shmem by message size: put to PE 1's heap next to memcpy into PE 1's heap"),
        "{stdout}"
    );
    assert!(stdout.contains("\n     4 KiB "), "{stdout}");
}

#[test]
fn zero_rounds_are_refused() {
    let (out, _) = run(&["bench", "--rounds", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rounds must be at least 1"));
}
