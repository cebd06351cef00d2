//! The graph cache's log lines on the simulated backend. Its own test
//! binary: no other test reaches the cache's event sites while a capture
//! is set up (see `xcall_core::log::capture`).

#[path = "common/sim.rs"]
mod sim;

use sim::{add, cache, key, run, run_ops, stream};
use xcall_core::testing::{watchdog, within};
use xcall_graph::sim::SimOp;
use xcall_graph::{CacheConfig, Call, Device};

/// The tests of this file reach the same event sites: they run one at a
/// time, so no site is first reached while another test's capture is
/// being set up.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn each_call_logs_one_line_with_its_outcome_and_reason_replays_only_at_trace() {
    let _s = serial();
    use xcall_core::log::{capture, LogLevel};
    let c = cache(CacheConfig {
        retry_after: 1,
        max_nodes: Some(3),
        ..CacheConfig::default()
    });
    let (s, a, b) = (stream(0), key(0, 0x51, &[0x100]), key(0, 0x51, &[0x200]));
    let first = a.clone();
    // A record function below calls `invalidate_range`: a lock held across
    // it would deadlock, so the calls run under a watchdog.
    let calls = move || {
        let a = first;
        run(&c, &a, s, 1); // captured
        run(&c, &a, s, 1); // replayed
        run(&c, &b, s, 1); // updated
        run(&c, &key(0, 0x52, &[1, 2, 3, 4]), s, 1); // too many nodes to keep
        run_ops(&c, &key(0, 0x53, &[0x300]), s, &[SimOp::Uncapturable]);
        run_ops(&c, &key(0, 0x54, &[0x400]), s, &[SimOp::FailsInstantiate]);
        c.backend().begin_caller_capture(s);
        run(&c, &key(0, 0x55, &[0x500]), s, 1);
        c.backend().end_caller_capture(s);
        run(&c, &key(0, 0x56, &[0x600, 0x700, 0x800]), s, 1); // evicts b
        c.invalidate_range(Device::cuda(0), 0x200, 8).unwrap(); // nothing there: no line
                                                                // A range freed while its call is being captured.
        let k = key(0, 0x57, &[0x900]);
        c.execute(&Call::new(k, Some(s)), |stream| {
            c.invalidate_range(Device::cuda(0), 0x900, 8).unwrap();
            c.backend().enqueue(stream.unwrap(), add(0x900, 1));
            Ok::<(), std::io::Error>(())
        })
        .unwrap();
        c.invalidate_range(Device::cuda(0), 0x600, 8).unwrap();
    };
    let ((), lines) = within("calls that log", watchdog(), move || {
        capture("xcall_graph=trace", calls)
    });
    let got: Vec<(LogLevel, &str)> = lines.iter().map(|l| (l.level, l.text.as_str())).collect();
    let fields =
        |id: &str, n: usize| format!("device=cuda:0 target_id={id} attributes=0xa77 buffers={n}");
    let expected = [
        (LogLevel::Debug, format!("captured nodes=1 {}", fields("0x51", 1))),
        (LogLevel::Trace, format!("replayed {}", fields("0x51", 1))),
        (LogLevel::Debug, format!("updated nodes=1 {}", fields("0x51", 1))),
        (
            LogLevel::Debug,
            format!("captured nodes=4 not_cached=over_max_nodes {}", fields("0x52", 4)),
        ),
        (
            LogLevel::Debug,
            format!("eager_fallback why=capture_failed failed_at=end_capture {}", fields("0x53", 1)),
        ),
        (
            LogLevel::Debug,
            format!(
                "eager_fallback why=capture_failed failed_at=instantiate nodes=1 {}",
                fields("0x54", 1)
            ),
        ),
        (
            LogLevel::Debug,
            format!("eager_fallback why=caller_capturing {}", fields("0x55", 1)),
        ),
        (
            LogLevel::Debug,
            format!("captured nodes=3 evicted=1 {}", fields("0x56", 3)),
        ),
        (
            LogLevel::Debug,
            "range invalidated device=cuda:0 address=0x900 bytes=8 evicted=0 captures_invalidated=1"
                .to_string(),
        ),
        (
            LogLevel::Debug,
            format!(
                "captured nodes=1 not_cached=invalidated_during_capture {}",
                fields("0x57", 1)
            ),
        ),
        (
            LogLevel::Debug,
            "range invalidated device=cuda:0 address=0x600 bytes=8 evicted=1 captures_invalidated=0"
                .to_string(),
        ),
    ];
    let expected: Vec<(LogLevel, &str)> = expected.iter().map(|(l, t)| (*l, t.as_str())).collect();
    assert_eq!(got, expected);
    assert!(lines.iter().all(|l| l.target == "xcall_graph::cache"));

    // At debug the replay (a hot path) is not logged, the rest is.
    let c = cache(CacheConfig::default());
    let ((), lines) = capture("xcall_graph=debug", || {
        run(&c, &a, s, 1);
        run(&c, &a, s, 1);
    });
    let texts: Vec<&str> = lines.iter().map(|l| l.text.as_str()).collect();
    assert_eq!(texts, [format!("captured nodes=1 {}", fields("0x51", 1))]);
}

#[test]
fn lines_are_logged_after_the_device_lock_is_released() {
    // Each line, as it is logged, needs the same device's shard from
    // another thread: a line logged under the shard lock stalls it and
    // the watchdog fails the test.
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    use xcall_core::testing::{watchdog, within};
    let _s = serial();
    let c = Arc::new(cache(CacheConfig {
        retry_after: 1,
        max_nodes: Some(3),
        ..CacheConfig::default()
    }));
    let lines = Arc::new(AtomicUsize::new(0));
    let (on_line_cache, counted) = (c.clone(), lines.clone());
    let on_line = move |_line| {
        let other = on_line_cache.clone();
        within(
            "stats() of the same device while a line is logged",
            Duration::from_secs(10),
            move || other.stats(Device::cuda(0)),
        );
        counted.fetch_add(1, Ordering::SeqCst);
    };
    within("calls that log", watchdog(), move || {
        xcall_core::log::capture_with("xcall_graph=trace", on_line, || {
            let s = stream(0);
            let (a, b) = (key(0, 0x51, &[0x100]), key(0, 0x51, &[0x200]));
            run(&c, &a, s, 1); // captured
            run(&c, &a, s, 1); // replayed
            run(&c, &b, s, 1); // updated
            run(&c, &key(0, 0x52, &[1, 2, 3, 4]), s, 1); // not kept
            run_ops(&c, &key(0, 0x53, &[0x300]), s, &[SimOp::Uncapturable]);
            run_ops(&c, &key(0, 0x54, &[0x400]), s, &[SimOp::FailsInstantiate]);
            c.invalidate_range(Device::cuda(0), 0x200, 8).unwrap();
        })
    });
    assert_eq!(lines.load(Ordering::SeqCst), 7);
}
