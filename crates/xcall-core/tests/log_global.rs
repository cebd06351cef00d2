//! The subscriber xcall installs for the whole process: `XCALL_LOG`, then
//! `configure` with a callback, filters and bad input. One test in its own
//! binary, because the subscriber is process-wide and is installed once.

use std::sync::{Arc, Mutex};

use xcall_core::log::{configure, init_from_env, installed, Sink};
use xcall_core::LogLevel;

type Seen = Arc<Mutex<Vec<(LogLevel, String, String)>>>;

fn callback(seen: &Seen) -> Sink {
    let seen = seen.clone();
    Sink::Callback(Arc::new(move |level, target, text| {
        seen.lock()
            .unwrap()
            .push((level, target.to_string(), text.to_string()));
        // A line logged from inside the callback is dropped, not delivered
        // re-entrantly.
        tracing::error!("from inside the callback");
    }))
}

fn texts(seen: &Seen) -> Vec<String> {
    std::mem::take(&mut *seen.lock().unwrap())
        .into_iter()
        .map(|(_, _, t)| t)
        .collect()
}

#[test]
fn xcall_log_then_configure_route_and_filter_every_line() {
    // Read once, before anything else: turns logging on at warn.
    std::env::set_var("XCALL_LOG", "log_global=warn");
    assert!(!installed());
    init_from_env().unwrap();
    assert!(installed());
    std::env::set_var("XCALL_LOG", "not a filter=loud");
    init_from_env().expect("read once: a later value is not looked at");

    let seen: Seen = Arc::default();
    // The filter XCALL_LOG gave stays; the lines go to the callback.
    configure(None, Some(callback(&seen))).unwrap();
    tracing::info!("dropped at warn");
    tracing::warn!(n = 1, "kept");
    tracing::warn!(n = 2, "kept");
    let got = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(
        got,
        [
            (LogLevel::Warn, "log_global".into(), "kept n=1".into()),
            (LogLevel::Warn, "log_global".into(), "kept n=2".into()),
        ],
        "the second line shows the callback's own line was dropped and the guard reset"
    );

    // A new filter replaces it.
    configure(Some("log_global=info"), None).unwrap();
    tracing::info!("now kept");
    tracing::debug!("still dropped");
    assert_eq!(texts(&seen), ["now kept"]);

    // A filter that does not parse is refused and changes nothing.
    let e = configure(Some("log_global=loud"), Some(Sink::Stderr)).unwrap_err();
    assert_eq!(e.status(), xcall_core::Status::InvalidArgument);
    assert!(e.to_string().contains("log_global=loud"), "{e}");
    tracing::info!("callback and filter kept");
    assert_eq!(texts(&seen), ["callback and filter kept"]);

    // Blank turns logging off, as "off" does.
    for off in ["", "  ", "off"] {
        configure(Some(off), None).unwrap();
        tracing::error!("dropped when off");
        assert!(texts(&seen).is_empty(), "{off:?}");
        configure(Some("log_global=trace"), None).unwrap();
        tracing::trace!("on again");
        assert_eq!(texts(&seen), ["on again"]);
    }
}
