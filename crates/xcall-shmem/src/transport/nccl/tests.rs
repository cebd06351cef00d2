//! NCCL's unit tests: the search, the versions, the aborts.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::library::{search, usable_version, CommConfig, UniqueId, IN_PROGRESS, SUCCESS};
use super::{
    aborts_in_flight, candidates, find, settle_aborts, settled_count, Library, Version, ABORTS,
    LIB_ENV, MIN_VERSION,
};

#[test]
fn settling_waits_for_aborts_in_flight_within_its_timeout() {
    // No NCCL on this machine: the count is this test's alone.
    assert_eq!(aborts_in_flight(), 0);
    let started = std::time::Instant::now();
    assert_eq!(settle_aborts(Duration::from_secs(5)), 0);
    assert!(started.elapsed() < Duration::from_secs(1));
    // Two aborts finish on another thread within the timeout: 0.
    ABORTS.fetch_add(2, Ordering::AcqRel);
    let finisher = std::thread::spawn(|| {
        for _ in 0..2 {
            std::thread::sleep(Duration::from_millis(50));
            ABORTS.fetch_sub(1, Ordering::AcqRel);
        }
    });
    assert_eq!(settle_aborts(Duration::from_secs(5)), 0);
    finisher.join().unwrap();
    // One that does not: what remains, after the timeout.
    ABORTS.fetch_add(1, Ordering::AcqRel);
    assert_eq!(aborts_in_flight(), 1);
    let started = std::time::Instant::now();
    assert_eq!(settle_aborts(Duration::from_millis(100)), 1);
    assert!(started.elapsed() >= Duration::from_millis(100));
    ABORTS.fetch_sub(1, Ordering::AcqRel);
}

#[test]
fn a_graph_count_is_awaited_for_its_grace_and_no_longer() {
    let count = Arc::new(AtomicUsize::new(0));
    assert_eq!(settled_count(&count, Duration::from_secs(5)), 0);
    // Released on another thread within the grace: 0.
    count.store(2, Ordering::Release);
    let c = count.clone();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        c.fetch_sub(1, Ordering::AcqRel);
        std::thread::sleep(Duration::from_millis(50));
        c.fetch_sub(1, Ordering::AcqRel);
    });
    assert_eq!(settled_count(&count, Duration::from_secs(2)), 0);
    releaser.join().unwrap();
    // Held: the count after the grace, which is capped at 2 s.
    count.store(3, Ordering::Release);
    let started = std::time::Instant::now();
    assert_eq!(settled_count(&count, Duration::from_millis(100)), 3);
    assert!(started.elapsed() >= Duration::from_millis(100));
    let started = std::time::Instant::now();
    assert_eq!(settled_count(&count, Duration::from_secs(3600)), 3);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
}

#[test]
fn versions_decode_both_encodings() {
    let v = Version::from_code(22803);
    assert_eq!((v.major, v.minor, v.patch), (2, 28, 3));
    assert_eq!(v.to_string(), "2.28.3");
    assert_eq!(v.code(), 22803);
    // Before 2.9: major*1000 + minor*100 + patch.
    let old = Version::from_code(2804);
    assert_eq!((old.major, old.minor, old.patch), (2, 8, 4));
    assert!(old < MIN_VERSION);
    assert!(Version::from_code(21400) >= MIN_VERSION);
    assert!(Version::from_code(21399) < MIN_VERSION);
    assert_eq!(MIN_VERSION.code(), 21400);
}

#[test]
fn only_a_working_nccl_of_2_14_or_newer_is_used() {
    assert_eq!(usable_version(SUCCESS, 21400), Ok(MIN_VERSION));
    assert_eq!(
        usable_version(SUCCESS, 22803).unwrap().to_string(),
        "2.28.3"
    );
    let old = usable_version(SUCCESS, 21309).unwrap_err();
    assert!(
        old.contains("NCCL 2.13.9") && old.contains("2.14.0 or newer"),
        "{old}"
    );
    assert!(usable_version(SUCCESS, 2804)
        .unwrap_err()
        .contains("NCCL 2.8.4"));
    for (r, code) in [
        (3, 22803),
        (SUCCESS, 0),
        (SUCCESS, -1),
        (IN_PROGRESS, 22803),
    ] {
        let e = usable_version(r, code).unwrap_err();
        assert!(e.starts_with("ncclGetVersion failed"), "{r} {code}: {e}");
    }
}

#[test]
fn the_config_has_nccl_2_14s_layout() {
    // size_t, two u32, four ints, one pointer: 40 bytes on 64-bit.
    assert_eq!(std::mem::size_of::<CommConfig>(), 40);
    assert_eq!(std::mem::offset_of!(CommConfig, blocking), 16);
    assert_eq!(std::mem::offset_of!(CommConfig, net_name), 32);
    assert_eq!(std::mem::size_of::<UniqueId>(), 128);
}

#[test]
fn an_override_that_is_missing_is_named_and_nothing_else_is_tried() {
    let e = find(Some("/nonexistent/xcall-test/libnccl.so.2")).unwrap_err();
    assert!(e.starts_with(&format!("{LIB_ENV}=")), "{e}");
    assert!(e.contains("/nonexistent/xcall-test/libnccl.so.2"), "{e}");
    // A folder override looks for libnccl.so.2 in it.
    let dir = std::env::temp_dir();
    let e = find(Some(dir.to_str().unwrap())).unwrap_err();
    assert!(e.contains("libnccl.so.2"), "{e}");
}

#[test]
fn a_library_that_is_not_nccl_is_refused_by_name() {
    // libc is loaded in every process: loadable, but not NCCL.
    let e = Library::open(Path::new("libc.so.6")).unwrap_err();
    assert!(e.contains("ncclGetVersion"), "{e}");
}

#[test]
fn wheel_folders_are_found_in_order() {
    let root = std::env::temp_dir().join(format!("xcall-nccl-search-{}", std::process::id()));
    let wheel = |base: &Path| {
        let dir = base.join("nvidia/nccl/lib");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnccl.so.2"), b"not a library").unwrap();
        dir.join("libnccl.so.2")
    };
    let own_site = root.join("own/site-packages");
    let in_own = wheel(&own_site);
    let in_path = wheel(&root.join("pythonpath"));
    let in_venv = wheel(&root.join("venv/lib/python3.12/site-packages"));
    // A folder without the wheel adds nothing.
    std::fs::create_dir_all(root.join("venv/lib/python3.11/site-packages")).unwrap();
    let env = |name: &str| match name {
        "PYTHONPATH" => Some(root.join("pythonpath").into_os_string()),
        "VIRTUAL_ENV" => Some(root.join("venv").into_os_string()),
        _ => None,
    };
    let own = own_site.join("xcall/libxcall.so");
    let found = search(&env, Some(&own));
    let ours: Vec<&PathBuf> = found.iter().filter(|p| p.starts_with(&root)).collect();
    assert_eq!(ours, vec![&in_own, &in_path, &in_venv]);
    // Found but not loadable: the error names the file and why.
    let e = Library::open(&in_venv).unwrap_err();
    assert!(!e.is_empty());
    let e = find(Some(in_venv.parent().unwrap().to_str().unwrap())).unwrap_err();
    assert!(e.contains(&in_venv.display().to_string()), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn the_loader_names_come_first() {
    let c = candidates();
    assert_eq!(c[0], PathBuf::from("libnccl.so.2"));
    assert_eq!(c[1], PathBuf::from("libnccl.so"));
    for extra in &c[2..] {
        assert!(extra.ends_with("nvidia/nccl/lib/libnccl.so.2"), "{extra:?}");
        assert!(extra.is_file(), "{extra:?}");
    }
}
