//! The permute grid's table and heat map in docs/ are what
//! `scripts/permute-grid.py` makes from the committed bench JSON (so they
//! are generated, not edited), and the script refuses input it cannot
//! read. Needs `python3` (CI installs it); without one the test says so on
//! stderr and fails only under `XCALL_REQUIRE_PYTHON=1`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The source tree: `XCALL_SOURCE_ROOT` where a test bundle carries a
/// copy, else the checkout this test was built in.
fn root() -> PathBuf {
    std::env::var_os("XCALL_SOURCE_ROOT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

fn python() -> Option<String> {
    let py = std::env::var("XCALL_PYTHON").unwrap_or("python3".into());
    match Command::new(&py).arg("--version").output() {
        Ok(o) if o.status.success() => Some(py),
        _ => {
            xcall_core::testing::skip("permute grid report", &format!("no {py}"));
            assert!(
                !xcall_core::testing::required("XCALL_REQUIRE_PYTHON"),
                "XCALL_REQUIRE_PYTHON=1 but {py} does not run"
            );
            None
        }
    }
}

#[test]
fn the_docs_are_the_scripts_output_of_the_committed_json() {
    let Some(py) = python() else { return };
    let dir = std::env::temp_dir().join(format!("xcall-grid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (table, svg) = (dir.join("table.md"), dir.join("grid.svg"));
    let r = root();
    let out = Command::new(&py)
        .arg(r.join("scripts/permute-grid.py"))
        .arg(r.join("docs/data/permute-grid-h200.json"))
        .arg("--table")
        .arg(&table)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = String::from_utf8(out.stdout).unwrap();
    let bench = std::fs::read_to_string(r.join("docs/BENCHMARKS.md")).unwrap();
    for line in summary.lines() {
        assert!(
            bench.contains(line),
            "docs/BENCHMARKS.md lacks the summary line {line:?}: regenerate it"
        );
    }
    for (made, committed) in [
        (&table, "docs/data/permute-grid.md"),
        (&svg, "docs/img/permute-grid.svg"),
    ] {
        let want = std::fs::read_to_string(r.join(committed)).unwrap();
        assert!(
            std::fs::read_to_string(made).unwrap() == want,
            "{committed} differs from the script's output: regenerate it"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_script_refuses_lines_that_are_not_json() {
    let Some(py) = python() else { return };
    let path = std::env::temp_dir().join(format!("xcall-grid-bad-{}.json", std::process::id()));
    std::fs::write(&path, "{\"op\": \"permute\"}\nnot json\n").unwrap();
    let out = Command::new(&py)
        .arg(root().join("scripts/permute-grid.py"))
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(":2: not JSON"), "{err}");
}
