//! Logging. Every xcall crate emits its events through the `tracing`
//! facade; this module holds the one subscriber xcall installs itself, for
//! the C library and the `xcall` CLI:
//!
//! - **Off by default**, and then free: nothing is installed, and each
//!   event site costs a load and a compare.
//! - **`XCALL_LOG`** turns it on with an `EnvFilter` directive
//!   (`info`, `debug`, `trace`, `xcall_graph=debug,warn`, ...). It is read
//!   once, on the first call into the library ([`init_from_env`]).
//! - **Where lines go**: stderr, one line per event, or a callback the host
//!   application sets ([`configure`]; in C, `xcall_log_configure`).
//!
//! A Rust program that uses the crates directly installs its own
//! subscriber and receives xcall's events like any other; xcall installs
//! nothing unless [`init_from_env`] or [`configure`] is called.
//!
//! Targets are the crate and module (`xcall_graph::cache`,
//! `xcall_shmem::world::live`, `xcall_core::kernel_cache`, ...). What is
//! logged, by level: `info` for a world's start and end, `debug` for
//! graph-cache decisions other than a replay (capture, update, patch,
//! eager and why, eviction), the transport chosen per peer pair, bootstrap
//! steps and timeouts, autotune choices and kernel compile times, `trace`
//! for every replay.

use std::cell::Cell;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{reload, EnvFilter, Layer, Registry};

use crate::{Error, Result};

/// The environment variable read by [`init_from_env`].
pub const ENV: &str = "XCALL_LOG";

/// The level of a log line, as the C callback receives it.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    /// Something failed.
    Error = 1,
    /// Something is off but work goes on.
    Warn = 2,
    /// Lifecycle: a world starts or ends.
    Info = 3,
    /// Decisions: graph-cache outcomes, transports, bootstrap steps,
    /// autotune choices, compile times.
    Debug = 4,
    /// Every call on a hot path (graph replays).
    Trace = 5,
}

crate::c_enum!(LogLevel, "log level", [Error, Warn, Info, Debug, Trace]);

impl LogLevel {
    fn of(level: &tracing::Level) -> LogLevel {
        match *level {
            tracing::Level::ERROR => LogLevel::Error,
            tracing::Level::WARN => LogLevel::Warn,
            tracing::Level::INFO => LogLevel::Info,
            tracing::Level::DEBUG => LogLevel::Debug,
            _ => LogLevel::Trace,
        }
    }

    /// The level's name as lines on stderr show it (`DEBUG`).
    pub fn name(self) -> &'static str {
        match self {
            LogLevel::Error => "ERROR",
            LogLevel::Warn => "WARN",
            LogLevel::Info => "INFO",
            LogLevel::Debug => "DEBUG",
            LogLevel::Trace => "TRACE",
        }
    }
}

/// Receives each log line: its level, its target (`xcall_graph::cache`)
/// and its text (the message, then `field=value` pairs). Called on the
/// thread that logs, possibly from many threads at once.
pub type Callback = Arc<dyn Fn(LogLevel, &str, &str) + Send + Sync>;

/// Where log lines go.
#[derive(Clone)]
pub enum Sink {
    /// One line per event on stderr:
    /// `[xcall +1.234567s DEBUG xcall_graph::cache] captured device=cuda:0 ...`.
    Stderr,
    /// The host application's function.
    Callback(Callback),
}

struct Installed {
    filter: reload::Handle<EnvFilter, Registry>,
    sink: Mutex<Sink>,
    start: Instant,
}

/// The installed subscriber, or why none could be installed.
static INSTALLED: OnceLock<std::result::Result<Installed, String>> = OnceLock::new();
/// What reading `XCALL_LOG` found (read once).
static FROM_ENV: OnceLock<std::result::Result<(), String>> = OnceLock::new();
/// Serialises [`configure`] calls, so two callers cannot interleave a
/// filter from one with a sink from the other.
static CONFIGURE: Mutex<()> = Mutex::new(());

thread_local! {
    /// Set while this thread is inside a log callback: an event the
    /// callback causes (by calling into xcall) is dropped, not recursed on.
    static IN_SINK: Cell<bool> = const { Cell::new(false) };
}

/// The longest filter taken, in bytes: far more than any list of targets
/// needs, and short enough that parsing it stays quick (the parser's time
/// grows faster than the filter's length).
pub const MAX_FILTER_BYTES: usize = 64 << 10;

/// The longest piece of a refused filter an error message repeats.
const QUOTED_BYTES: usize = 200;

/// The filter, or why `directives` is not one (naming it; a filter over
/// [`MAX_FILTER_BYTES`] is refused before it is parsed).
fn parse(directives: &str) -> std::result::Result<EnvFilter, String> {
    if directives.len() > MAX_FILTER_BYTES {
        return Err(format!(
            "log filter of {} bytes (beginning {:?}): longer than the limit of {MAX_FILTER_BYTES} bytes",
            directives.len(),
            quoted(directives)
        ));
    }
    EnvFilter::builder()
        .parse(directives)
        .map_err(|e| format!("log filter {:?}: {e}", quoted(directives)))
}

/// `text`, cut after [`QUOTED_BYTES`] (at a character boundary) with
/// "..." to show the cut.
fn quoted(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= QUOTED_BYTES {
        return text.into();
    }
    let mut end = QUOTED_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end]).into()
}

/// The filter `XCALL_LOG` gives, or why its `value` is not one (naming
/// the variable).
fn parse_env(value: &str) -> std::result::Result<EnvFilter, String> {
    parse(value).map_err(|e| format!("{ENV}: {e}"))
}

/// The installed subscriber; the first call installs it with `filter`
/// (later calls leave the filter as it is: it changes through the reload
/// handle).
fn install(filter: EnvFilter) -> Result<&'static Installed> {
    let installed = INSTALLED.get_or_init(|| {
        let (layer, handle) = reload::Layer::new(filter);
        let subscriber = Registry::default().with(layer).with(SinkLayer);
        tracing::subscriber::set_global_default(subscriber)
            .map(|()| Installed {
                filter: handle,
                sink: Mutex::new(Sink::Stderr),
                start: Instant::now(),
            })
            .map_err(|_| {
                "another tracing subscriber is installed in this process: xcall's events go to it"
                    .to_string()
            })
    });
    installed
        .as_ref()
        .map_err(|e| Error::Unsupported(e.clone()))
}

fn set_filter(installed: &Installed, filter: EnvFilter) -> Result<()> {
    installed
        .filter
        .reload(filter)
        .map_err(|e| Error::Unsupported(format!("the log filter could not be replaced: {e}")))
}

/// Reads `XCALL_LOG` once: unset or empty leaves logging off (nothing is
/// installed); otherwise installs the subscriber with that filter and
/// stderr. Later calls return the first call's result. An invalid filter
/// is an `InvalidArgument` naming it, and logging stays off.
pub fn init_from_env() -> Result<()> {
    FROM_ENV
        .get_or_init(|| {
            let Some(value) = crate::env::text(ENV).map_err(|e| e.to_string())? else {
                return Ok(());
            };
            parse_env(&value)
                .and_then(|filter| install(filter).map(|_| ()).map_err(|e| e.to_string()))
        })
        .clone()
        .map_err(Error::InvalidArgument)
}

/// The text of an [`init_from_env`] error without the status prefix.
fn bare(e: &Error) -> String {
    match e {
        Error::InvalidArgument(m) => m.clone(),
        other => other.to_string(),
    }
}

/// Whether xcall's subscriber is installed (by `XCALL_LOG` or
/// [`configure`]): a program that draws on stderr (progress bars) then
/// leaves stderr to the log lines.
pub fn installed() -> bool {
    matches!(INSTALLED.get(), Some(Ok(_)))
}

/// [`init_from_env`] for a library's entry points: the first call reads
/// `XCALL_LOG`, and an invalid value is reported once on stderr (logging
/// then stays off); every later call is one atomic load.
pub fn init_from_env_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = init_from_env() {
            let _ = writeln!(std::io::stderr(), "xcall: {}; logging stays off", bare(&e));
        }
    });
}

/// Sets the filter (`EnvFilter` syntax; `""` or `"off"` turns logging off)
/// and the sink. `None` keeps the current one: the filter `XCALL_LOG`
/// gave, or off; stderr. An invalid filter is refused and nothing changes.
/// Fails with `Unsupported` when another subscriber is installed
/// globally already (xcall's events then go to that one).
pub fn configure(filter: Option<&str>, sink: Option<Sink>) -> Result<()> {
    // XCALL_LOG is read before the first change, so it cannot override a
    // filter the application set.
    let _ = init_from_env();
    let filter = match filter {
        Some(f) if f.trim().is_empty() => Some(EnvFilter::new("off")),
        Some(f) => Some(parse(f).map_err(Error::InvalidArgument)?),
        None => None,
    };
    let _serial = CONFIGURE.lock().unwrap_or_else(|p| p.into_inner());
    // Installed here (off until the filter below) when XCALL_LOG was not.
    let installed = install(EnvFilter::new("off"))?;
    if let Some(filter) = filter {
        set_filter(installed, filter)?;
    }
    if let Some(sink) = sink {
        *installed.sink.lock().unwrap_or_else(|p| p.into_inner()) = sink;
    }
    Ok(())
}

/// One log line, as [`capture`] collects it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    /// Its level.
    pub level: LogLevel,
    /// The module that logged it (`xcall_graph::cache`).
    pub target: String,
    /// The message, then `name=value` fields.
    pub text: String,
}

/// Runs `f` with a subscriber of this thread only, filtered by `filter`
/// (`EnvFilter` syntax), and returns `f`'s result with the lines it
/// logged on this thread. For tests: the global subscriber, if any, does
/// not see these events. Panics on a filter that does not parse.
///
/// Several threads may capture at once (each PE thread of a world, for
/// example). tracing caches, per event site, whether any subscriber
/// wants it; a site another thread reaches first while a capture's
/// subscriber is being set up can keep a stale "no". The cache is
/// rebuilt once the subscriber is in place, but a test that asserts on
/// lines should still run where no other thread reaches the same sites
/// meanwhile (its own test binary, or tests serialised by a lock).
pub fn capture<R>(filter: &str, f: impl FnOnce() -> R) -> (R, Vec<Line>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    let r = capture_with(
        filter,
        move |line| sink.lock().unwrap_or_else(|p| p.into_inner()).push(line),
        f,
    );
    let lines = std::mem::take(&mut *lines.lock().unwrap_or_else(|p| p.into_inner()));
    (r, lines)
}

/// [`capture`], handing each line to `on_line` as it is logged (on the
/// logging thread, at the event site) instead of collecting them.
pub fn capture_with<R>(
    filter: &str,
    on_line: impl Fn(Line) + Send + Sync + 'static,
    f: impl FnOnce() -> R,
) -> R {
    struct Hand(Box<dyn Fn(Line) + Send + Sync>);
    impl<S: Subscriber> Layer<S> for Hand {
        fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
            let mut text = Text(String::new());
            event.record(&mut text);
            let meta = event.metadata();
            (self.0)(Line {
                level: LogLevel::of(meta.level()),
                target: meta.target().to_string(),
                text: text.0,
            });
        }
    }
    let filter = parse(filter).unwrap_or_else(|e| panic!("{e}"));
    let subscriber = Registry::default()
        .with(filter)
        .with(Hand(Box::new(on_line)));
    tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    })
}

/// Formats an event's fields: the message first, then `name=value`.
struct Text(String);

impl Text {
    fn field(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let rest = std::mem::take(&mut self.0);
            let _ = write!(self.0, "{value:?}");
            self.0.push_str(&rest);
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        // Plain when it reads unambiguously, quoted otherwise.
        if !value.is_empty() && !value.contains(|c: char| c.is_whitespace() || c == '"') {
            self.field(field, &format_args!("{value}"));
        } else {
            self.field(field, &value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.field(field, value);
    }
}

/// Sends each event that passed the filter to the current sink.
struct SinkLayer;

impl<S: Subscriber> Layer<S> for SinkLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let Some(Ok(installed)) = INSTALLED.get() else {
            return;
        };
        if IN_SINK.with(Cell::get) {
            return;
        }
        let meta = event.metadata();
        let level = LogLevel::of(meta.level());
        let mut text = Text(String::new());
        event.record(&mut text);
        // The lock is held only to copy the sink out: the callback runs
        // without it, so it may take as long as it likes.
        let sink = installed
            .sink
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match sink {
            Sink::Stderr => {
                let line = format!(
                    "[xcall +{:.6}s {} {}] {}\n",
                    installed.start.elapsed().as_secs_f64(),
                    level.name(),
                    meta.target(),
                    text.0
                );
                // One write per line, so lines of threads do not interleave.
                let _ = std::io::stderr().lock().write_all(line.as_bytes());
            }
            Sink::Callback(f) => {
                IN_SINK.with(|s| s.set(true));
                struct Reset;
                impl Drop for Reset {
                    fn drop(&mut self) {
                        IN_SINK.with(|s| s.set(false));
                    }
                }
                let _reset = Reset;
                f(level, meta.target(), &text.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_of(f: impl FnOnce()) -> String {
        let ((), lines) = capture("trace", f);
        let texts: Vec<String> = lines.into_iter().map(|l| l.text).collect();
        texts.join("\n")
    }

    #[test]
    fn the_message_comes_first_then_fields_plain_or_quoted() {
        let text = text_of(|| {
            tracing::debug!(device = "cuda:1", why = "caller capturing", n = 3, "eager");
        });
        assert_eq!(text, r#"eager device=cuda:1 why="caller capturing" n=3"#);
        let text = text_of(|| tracing::info!(empty = "", "x"));
        assert_eq!(text, r#"x empty="""#);
    }

    #[test]
    fn capture_keeps_what_the_filter_passes_with_level_and_target() {
        let ((), lines) = capture("xcall_core=info", || {
            tracing::debug!("dropped");
            tracing::warn!("kept");
            tracing::error!(target: "elsewhere", "dropped too");
        });
        assert_eq!(
            lines,
            [Line {
                level: LogLevel::Warn,
                target: "xcall_core::log::tests".into(),
                text: "kept".into(),
            }]
        );
    }

    #[test]
    fn levels_map_to_their_c_codes_in_order() {
        use tracing::Level as L;
        let mapped: Vec<LogLevel> = [L::ERROR, L::WARN, L::INFO, L::DEBUG, L::TRACE]
            .iter()
            .map(LogLevel::of)
            .collect();
        assert_eq!(mapped, LogLevel::ALL);
        let codes: Vec<u32> = LogLevel::ALL.iter().map(|l| *l as u32).collect();
        assert_eq!(codes, [1, 2, 3, 4, 5]);
        let names: Vec<&str> = LogLevel::ALL.iter().map(|l| l.name()).collect();
        assert_eq!(names, ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"]);
    }

    #[test]
    fn the_library_reports_a_bad_xcall_log_without_the_status_prefix() {
        let e = Error::InvalidArgument("XCALL_LOG: log filter \"x=y\": bad".into());
        assert_eq!(bare(&e), "XCALL_LOG: log filter \"x=y\": bad");
        let other = Error::Unsupported("another subscriber".into());
        assert_eq!(bare(&other), "unsupported: another subscriber");
    }

    /// `n` bytes of valid directives, one target each.
    fn long_filter(n: usize) -> String {
        let mut f = String::new();
        let mut i = 0;
        while f.len() < n {
            f.push_str(&format!("xcall_t{i}=debug,"));
            i += 1;
        }
        f.truncate(n);
        // Whole directives only: cut back to the last separator.
        let end = f.rfind(',').unwrap_or(0);
        f.truncate(end);
        f
    }

    #[test]
    fn a_filter_over_the_limit_is_refused_by_its_variable_and_the_limit() {
        // 1.1 MB of valid directives: the parser took seconds on it.
        let filter = long_filter(1_100_000);
        let e = parse_env(&filter).expect_err("refused");
        assert!(
            e.starts_with(&format!(
                "XCALL_LOG: log filter of {} bytes (beginning \"xcall_t0=debug,",
                filter.len()
            )),
            "{e}"
        );
        assert!(
            e.ends_with("...\"): longer than the limit of 65536 bytes"),
            "{e}"
        );
        assert!(
            e.len() < 400,
            "the message repeats the filter: {} bytes",
            e.len()
        );
        assert!(parse(&filter).is_err(), "the C API's filter too");
        // Up to the limit a filter parses.
        let longest = long_filter(MAX_FILTER_BYTES);
        assert!(longest.len() > MAX_FILTER_BYTES - 32);
        assert!(parse_env(&longest).is_ok());
        // A bad filter's message repeats only its beginning.
        let bad = format!("{}x=loud", "é".repeat(150));
        let e = parse(&bad).unwrap_err();
        assert!(
            e.starts_with(&format!("log filter \"{}...\": ", "é".repeat(100))),
            "{e}"
        );
    }

    #[test]
    fn an_invalid_filter_is_refused_by_name() {
        let e = parse("xcall_graph=loud").unwrap_err();
        assert!(e.starts_with(r#"log filter "xcall_graph=loud": "#), "{e}");
        assert!(parse("xcall_graph=debug,warn").is_ok());
    }
}
