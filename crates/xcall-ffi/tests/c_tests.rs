//! Builds every `c_tests/test_*.c` as its own program against `libxcall.a`
//! (`-std=c11 -Wall -Wextra -Werror -pedantic`) and runs it; compiles the
//! header as C++17 with `-Wall -Wextra -Werror` and runs that too.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// System libraries a Rust static library needs on Linux
/// (`rustc --print native-static-libs`).
const NATIVE_LIBS: &[&str] = &["-lpthread", "-ldl", "-lm", "-lrt"];

/// Compiles `source` into `exe` with `flags`, then runs it; returns an error
/// text with the compiler's or the program's output on failure.
fn build_and_run(
    tool: &cc::Tool,
    flags: &[&str],
    source: &Path,
    exe: &Path,
) -> Result<String, String> {
    let include = common::repo().join("include");
    let harness = common::repo().join("c_tests");
    let out = Command::new(tool.path())
        .args(flags)
        .arg("-I")
        .arg(&include)
        .arg("-I")
        .arg(&harness)
        .arg(source)
        .arg(common::built_library("libxcall.a"))
        .args(NATIVE_LIBS)
        .arg("-o")
        .arg(exe)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", tool.path().display()))?;
    if !out.status.success() {
        return Err(format!(
            "compiling {} failed:\n{}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let run = Command::new(exe)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    if run.status.success() {
        Ok(text)
    } else {
        Err(format!(
            "{} exited with {}:\n{text}",
            exe.display(),
            run.status
        ))
    }
}

#[test]
fn c_programs_pass() {
    let tool = common::compiler(false);
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_tests");
    std::fs::create_dir_all(&out_dir).unwrap();
    let mut sources: Vec<PathBuf> = std::fs::read_dir(common::repo().join("c_tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "c")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("test_"))
        })
        .collect();
    sources.sort();
    assert!(
        sources.len() >= 3,
        "expected the C tests in c_tests/, found {sources:?}"
    );
    let flags = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"];
    let mut failures = Vec::new();
    for source in &sources {
        let exe = out_dir.join(source.file_stem().unwrap());
        match build_and_run(&tool, &flags, source, &exe) {
            Ok(text) => print!("{text}"),
            Err(e) => failures.push(e),
        }
    }
    assert!(
        failures.is_empty(),
        "{} C test(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn header_compiles_as_cpp17() {
    let tool = common::compiler(true);
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_tests");
    std::fs::create_dir_all(&out_dir).unwrap();
    let source = common::repo().join("c_tests/header_cpp.cpp");
    let flags = ["-std=c++17", "-Wall", "-Wextra", "-Werror"];
    let text = build_and_run(&tool, &flags, &source, &out_dir.join("header_cpp"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(text.contains("header_cpp: 1 passed, 0 failed"), "{text}");
}

/// The bad-input harness again, built with AddressSanitizer and
/// UndefinedBehaviorSanitizer (gcc and clang): no input it throws at the C
/// ABI may touch memory that is not its own. A compiler without the
/// sanitizer runtimes skips with a line on stderr, unless
/// `XCALL_REQUIRE_SANITIZERS=1` (CI) makes that a failure.
#[test]
fn bad_input_under_address_and_undefined_sanitizers() {
    let tool = common::compiler(false);
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_tests_asan");
    std::fs::create_dir_all(&out_dir).unwrap();
    let source = common::repo().join("c_tests/test_bad_input.c");
    let flags = [
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-pedantic",
        "-g",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-fno-omit-frame-pointer",
    ];
    let exe = out_dir.join("test_bad_input_asan");
    match build_and_run(&tool, &flags, &source, &exe) {
        Ok(text) => assert!(
            text.contains("test_bad_input: ") && text.contains(" 0 failed"),
            "{text}"
        ),
        Err(e)
            if e.starts_with("compiling")
                && !xcall_core::testing::required("XCALL_REQUIRE_SANITIZERS") =>
        {
            xcall_core::testing::skip(
                "bad_input_under_address_and_undefined_sanitizers",
                &format!("the C compiler cannot build with -fsanitize=address,undefined: {e}"),
            );
        }
        Err(e) => panic!("{e}"),
    }
}
