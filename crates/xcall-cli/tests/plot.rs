//! `xcall plot`: the charts drawn from Host reports hold every row of the
//! report, the figures of docs/BENCHMARKS.md are what `xcall plot` draws
//! from the reports kept in docs/data, and bad reports are refused.

mod common;

use std::path::{Path, PathBuf};

use common::{json_path, read_json, repo, run, xcall};

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xcall-plot-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs `xcall` and returns (exit code, stdout, stderr).
fn xcall_out(args: &[&str]) -> (Option<i32>, String, String) {
    let (out, stdout) = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stdout, stderr)
}

/// Runs `args` with `--json PATH` and returns the report's path (kept).
fn report(name: &str, args: &[&str]) -> PathBuf {
    let path = json_path(name);
    let mut all = args.to_vec();
    all.extend(["--json", path.to_str().unwrap()]);
    let (code, stdout, stderr) = xcall_out(&all);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    path
}

/// Whether the SVG draws `text` as one text element's content.
fn has_text(svg: &str, text: &str) -> bool {
    svg.lines().any(|l| l.trim() == text)
}

/// How many bars of `colour` the SVG holds.
fn bars(svg: &str, colour: &str) -> usize {
    svg.lines()
        .filter(|l| l.starts_with("<rect") && l.contains(&format!("fill=\"{colour}\"")))
        .count()
}

#[test]
fn host_reports_become_charts_with_every_row() {
    let bench = report("plot-bench", &["bench", "--rounds", "2"]);
    let small = report(
        "plot-moe-small",
        &[
            "moe",
            "--tokens",
            "100",
            "--hidden",
            "32",
            "--steps",
            "2",
            "--exchange",
            "fused",
        ],
    );
    let large = report(
        "plot-moe-large",
        &[
            "moe",
            "--tokens",
            "200",
            "--hidden",
            "32",
            "--steps",
            "2",
            "--dropless",
            "--exchange",
            "copy",
        ],
    );
    let dir = out_dir("host");
    let (code, stdout, stderr) = xcall_out(&[
        "plot",
        bench.to_str().unwrap(),
        small.to_str().unwrap(),
        large.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let stem = |p: &Path| p.file_stem().unwrap().to_string_lossy().into_owned();
    let names = [
        format!("{}-ratios.svg", stem(&bench)),
        format!("{}-shmem-sizes.svg", stem(&bench)),
        format!("{}-phases.svg", stem(&small)),
        format!("{}-phases.svg", stem(&large)),
        "moe-steps.svg".to_string(),
    ];
    let printed: Vec<String> = names
        .iter()
        .map(|n| dir.join(n).display().to_string())
        .collect();
    assert_eq!(stdout.lines().collect::<Vec<_>>(), printed);
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    // The report, checked against its schema (and removed).
    let doc = read_json(&bench);
    for name in &names {
        let svg = read(name);
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{name}"
        );
    }

    // One bar per row with a reference, each labelled.
    let ratios = read(&names[0]);
    let compared: Vec<&serde_json::Value> = doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| !r["reference"].is_null())
        .collect();
    assert_eq!(bars(&ratios, "#3465A4"), compared.len());
    for r in &compared {
        let label = format!(
            "{}: {}",
            r["crate"].as_str().unwrap(),
            r["item"].as_str().unwrap()
        );
        let label = label.replace('\'', "&apos;");
        assert!(has_text(&ratios, &label), "{label}");
        let value = format!("{:.3}", r["ratio"].as_f64().unwrap());
        assert!(has_text(&ratios, &value), "{r}");
    }

    // Both series by message size, every size on the axis.
    let sizes = read(&names[1]);
    assert!(has_text(&sizes, "put to PE 1&apos;s heap"));
    assert!(has_text(&sizes, "memcpy into PE 1&apos;s heap"));
    for size in ["4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB"] {
        assert!(has_text(&sizes, size), "{size}");
    }

    // The step and every phase, one bar each.
    let phases = read(&names[2]);
    assert_eq!(bars(&phases, "#E68028"), 1, "the step");
    assert_eq!(bars(&phases, "#3465A4"), 8, "the phases");
    for phase in [
        "map",
        "permute",
        "dispatch_wait",
        "experts",
        "combine_wait",
        "unpermute",
    ] {
        assert!(has_text(&phases, phase), "{phase}");
    }
    let steps = read("moe-steps.svg");
    assert_eq!(bars(&steps, "#3465A4"), 2);
    // Labelled with the layout and the exchange.
    assert!(has_text(
        &steps,
        "T=100 H=32 E=8 top-2, capacity 1.25, fused, 4 PE(s) host"
    ));
    assert!(has_text(
        &steps,
        "T=200 H=32 E=8 top-2, dropless, copy, 4 PE(s) host"
    ));
    for p in [small, large] {
        std::fs::remove_file(p).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_benchmark_figures_are_drawn_from_the_kept_reports() {
    let data = repo().join("docs/data");
    let mut reports: Vec<PathBuf> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            (name.starts_with("bench-") || name.starts_with("moe-")) && name.ends_with(".json")
        })
        .collect();
    reports.sort();
    assert!(
        !reports.is_empty(),
        "no bench-*.json or moe-*.json in docs/data"
    );
    for r in &reports {
        let doc = serde_json::from_str(&std::fs::read_to_string(r).unwrap()).unwrap();
        common::check_report(&doc);
    }
    let dir = out_dir("docs");
    let mut cmd = xcall();
    cmd.arg("plot").args(&reports).arg("--out").arg(&dir);
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bless = xcall_core::testing::required("XCALL_BLESS_HEADER");
    for made in String::from_utf8(out.stdout).unwrap().lines() {
        let made = Path::new(made);
        let committed = repo().join("docs/img").join(made.file_name().unwrap());
        let svg = std::fs::read_to_string(made).unwrap();
        if bless {
            std::fs::write(&committed, &svg).unwrap();
            continue;
        }
        assert!(
            std::fs::read_to_string(&committed).ok().as_deref() == Some(svg.as_str()),
            "{} differs from `xcall plot docs/data/...`; rerun with XCALL_BLESS_HEADER=1",
            committed.display()
        );
        let name = committed
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let doc = std::fs::read_to_string(repo().join("docs/BENCHMARKS.md")).unwrap();
        assert!(
            doc.contains(&format!("(img/{name})")),
            "docs/BENCHMARKS.md does not show {name}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reports_it_cannot_draw_are_refused_by_name_and_nothing_is_written() {
    let dir = out_dir("refused");
    let tmp = |name: &str, text: &str| {
        let p = std::env::temp_dir().join(format!("xcall-plot-{name}-{}.json", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    };
    let doctor = tmp("doctor", "");
    let (code, _, stderr) = xcall_out(&["doctor", "--json", doctor.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{stderr}");
    let not_json = tmp("not-json", "{ nope");
    let future = tmp("future", r#"{"schema_version": 2, "command": "bench"}"#);
    let no_rows = tmp("no-rows", r#"{"schema_version": 1, "command": "bench"}"#);
    let row = r#"{"crate": "permute", "item": "p", "ratio": 1.0, "reference": "copy"}"#;
    let rows = vec![row; 401].join(",");
    let too_many = tmp(
        "too-many",
        &format!(r#"{{"schema_version": 1, "command": "bench", "rows": [{rows}]}}"#),
    );
    let missing = std::env::temp_dir().join("xcall-plot-no-such-report.json");
    for (path, want) in [
        (
            &doctor,
            "a report of `xcall doctor`; plot draws bench and moe reports".to_string(),
        ),
        (&not_json, "not a JSON report".to_string()),
        (&future, "schema_version 2 (this xcall reads 1)".to_string()),
        (
            &no_rows,
            "field \"rows\" is missing or not an array".to_string(),
        ),
        (
            &too_many,
            "401 bars are more than one chart shows (400)".to_string(),
        ),
        (&missing, "No such file".to_string()),
    ] {
        let (code, _, stderr) = xcall_out(&[
            "plot",
            path.to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
        ]);
        assert_eq!(code, Some(2), "{}: {stderr}", path.display());
        assert!(
            stderr.starts_with(&format!("xcall: {}", path.display())),
            "{stderr}"
        );
        assert!(stderr.contains(&want), "{want}: {stderr}");
        assert!(!dir.exists(), "nothing is written for a refused report");
    }
    let (code, _, stderr) = xcall_out(&["plot", "--out", dir.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{stderr}");
    for p in [doctor, not_json, future, no_rows, too_many] {
        std::fs::remove_file(p).unwrap();
    }
}
