//! `docs/ENVIRONMENT.md` is the table `xcall_core::env` generates, and every
//! `XCALL_*` variable the sources, tests and scripts read is in that
//! table.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use xcall_core::env::{markdown_table, variable};

/// The source tree: `XCALL_SOURCE_ROOT` where a test bundle carries a
/// copy, else the checkout this test was built in.
fn root() -> PathBuf {
    std::env::var_os("XCALL_SOURCE_ROOT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

#[test]
fn the_environment_doc_is_the_generated_table() {
    let path = root().join("docs/ENVIRONMENT.md");
    let want = markdown_table();
    if xcall_core::testing::required("XCALL_BLESS_HEADER") {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "docs/ENVIRONMENT.md differs from xcall_core::env::markdown_table(); \
         rerun with XCALL_BLESS_HEADER=1 to rewrite it"
    );
}

/// The `XCALL_*` names in `text` that `pick` finds after each occurrence of
/// `XCALL_` (the name's characters: capitals, digits, `_`).
fn names(text: &str, pick: impl Fn(&str, usize) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("XCALL_") {
        let len = text[i..]
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(text.len() - i);
        if pick(text, i) && len > "XCALL_".len() {
            out.push(text[i..i + len].to_string());
        }
    }
    out
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if !["target", ".git", "node_modules", "__pycache__"].contains(&name.as_str()) {
                walk(&p, files);
            }
        } else {
            files.push(p);
        }
    }
}

#[test]
fn every_variable_read_anywhere_is_listed() {
    let root = root();
    // Names of the C ABI (constants and enum values), not variables.
    let header = std::fs::read_to_string(root.join("include/xcall.h")).unwrap();
    let c_names: BTreeSet<String> = names(&header, |_, _| true).into_iter().collect();
    // Set by build scripts for the compiler (`env!`), not read at run time.
    let build_time = ["XCALL_BUILD_TARGET"];
    let mut files = Vec::new();
    for dir in ["crates", "python", "scripts", "c_tests", "examples", ".ci"] {
        walk(&root.join(dir), &mut files);
    }
    let mut read = BTreeSet::new();
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let ext = f.extension().map(|e| e.to_string_lossy().into_owned());
        let found = match ext.as_deref() {
            // String literals: what env::var, os.environ and getenv name.
            Some("rs" | "py" | "c" | "h" | "cpp") => {
                names(&text, |t, i| i > 0 && t.as_bytes()[i - 1] == b'"')
            }
            // Shell: $XCALL_X and ${XCALL_X}.
            Some("sh") | None => names(&text, |t, i| {
                t[..i].ends_with('$') || t[..i].ends_with("${")
            }),
            _ => Vec::new(),
        };
        for n in found {
            if !c_names.contains(&n) && !build_time.contains(&n.as_str()) {
                read.insert((n, f.clone()));
            }
        }
    }
    let missing: Vec<String> = read
        .iter()
        .filter(|(n, f)| variable(n).is_none() && !f.ends_with("src/env.rs"))
        .map(|(n, f)| format!("{n} (read in {})", f.display()))
        .collect();
    assert!(
        missing.is_empty(),
        "not in xcall_core::env::VARIABLES: {missing:?}"
    );
    // The scan finds what it should: a library variable and a script's.
    let seen: BTreeSet<&str> = read.iter().map(|(n, _)| n.as_str()).collect();
    for n in ["XCALL_DISABLE_CUDA", "XCALL_SANITIZERS", "XCALL_LIB"] {
        assert!(seen.contains(n), "{n} not found by the scan");
    }
}
