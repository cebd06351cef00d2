//! `xcall doctor` runs on every machine and says what it found.

mod common;

use common::xcall;

#[test]
fn doctor_reports_platforms_and_exits_zero() {
    let out = xcall().arg("doctor").output().expect("run xcall doctor");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "doctor failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("host  available, 1 device"), "{stdout}");
    // NCCL is reported either way: its version and file, or why not.
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("nccl ") && l.contains(" at "))
            || (stdout.contains("nccl unavailable: ") && stdout.contains("NCCL was not found")),
        "{stdout}"
    );
    let count = xcall_core::testing::cuda_devices_or_skip("doctor_lists_cuda_devices");
    match count {
        None => assert!(stdout.contains("cuda  unavailable: "), "{stdout}"),
        Some(n) => {
            assert!(
                stdout.contains(&format!("cuda  available, {n} device(s)")),
                "{stdout}"
            );
            for ordinal in 0..n {
                assert!(stdout.contains(&format!("  cuda:{ordinal}  ")), "{stdout}");
            }
            assert!(stdout.contains("nvrtc "), "{stdout}");
            assert!(stdout.contains("peer access"), "{stdout}");
        }
    }
}

#[test]
fn doctor_without_cuda_says_why_and_exits_zero() {
    let out = xcall()
        .arg("doctor")
        .env(xcall_core::cuda::DISABLE_ENV, "1")
        .output()
        .expect("run xcall doctor");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("cuda  unavailable: CUDA is unavailable: disabled by XCALL_DISABLE_CUDA"),
        "{stdout}"
    );
}

#[test]
fn a_switch_that_is_not_a_boolean_is_named_not_guessed() {
    for (value, want) in [
        ("maybe", "XCALL_DISABLE_CUDA=\"maybe\" is not a boolean"),
        ("ON", "disabled by XCALL_DISABLE_CUDA"),
    ] {
        let out = xcall()
            .arg("doctor")
            .env(xcall_core::cuda::DISABLE_ENV, value)
            .output()
            .expect("run xcall doctor");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{value}: {stdout}");
        assert!(
            stdout.contains(&format!("cuda  unavailable: CUDA is unavailable: {want}")),
            "{value}: {stdout}"
        );
    }
}

#[test]
fn unknown_command_is_one_clear_error() {
    let out = xcall().arg("frobnicate").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unrecognized subcommand 'frobnicate'"));
}

/// A filter past the length limit is a usage error naming the variable
/// and the limit, refused before it is parsed (the parser took seconds on
/// a megabyte). 100 KiB: past the limit, within what one variable of a
/// process's environment may hold.
#[test]
fn an_overlong_log_filter_is_a_usage_error_naming_the_limit() {
    let filter = "xcall_graph=debug,".repeat(100 << 10 >> 4);
    let filter = filter.trim_end_matches(',');
    let out = xcall()
        .arg("doctor")
        .env("XCALL_LOG", filter)
        .output()
        .expect("run xcall doctor");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty(), "the command ran");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "xcall: XCALL_LOG: log filter of {} bytes (beginning \"xcall_graph=debug,",
            filter.len()
        )),
        "{stderr}"
    );
    assert!(
        stderr.ends_with("...\"): longer than the limit of 65536 bytes\n"),
        "{stderr}"
    );
}
