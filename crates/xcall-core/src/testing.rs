//! Support for tests: GPU detection, watchdogs, random data.
//!
//! GPU tests detect CUDA at run time. Without a usable GPU they print one
//! `SKIP` line and pass; with `XCALL_REQUIRE_CUDA=1` a missing GPU is a test
//! failure, so a GPU run cannot pass by skipping.
//!
//! A test that waits on another thread runs the threads under a watchdog
//! ([`run_threads`], [`within`]): a thread that never finishes fails the
//! test with a message naming it, instead of hanging the run.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cuda;

/// How long a test waits for threads before failing: 60 s, or
/// `XCALL_TEST_WATCHDOG_S` seconds.
pub fn watchdog() -> Duration {
    let secs = crate::env::seconds("XCALL_TEST_WATCHDOG_S")
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or(60);
    Duration::from_secs(secs)
}

/// Runs `f(i)` for `i` in `0..n`, each on its own thread, and returns the
/// results in order. A thread that panics fails the test with its index and
/// message; threads still running when `limit` has passed fail it with
/// "watchdog: `<what>`: thread(s) [..] did not finish" (they are left
/// behind: a stuck thread cannot be stopped, only reported).
pub fn run_threads<T: Send + 'static>(
    what: &str,
    n: usize,
    limit: Duration,
    f: impl Fn(usize) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for i in 0..n {
        let (f, tx) = (f.clone(), tx.clone());
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i)));
            let _ = tx.send((i, r.map_err(|p| crate::panic_message(&*p))));
        });
    }
    let deadline = Instant::now() + limit;
    let mut results: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, Ok(v))) => results[i] = Some(v),
            Ok((i, Err(msg))) => panic!("{what}: thread {i} failed: {msg}"),
            Err(_) => panic!(
                "watchdog: {what}: thread(s) {:?} did not finish within {limit:?}",
                (0..n).filter(|&i| results[i].is_none()).collect::<Vec<_>>()
            ),
        }
    }
    results.into_iter().flatten().collect()
}

/// Runs `f` on a thread of its own under the watchdog (see
/// [`run_threads`]).
pub fn within<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let f = std::sync::Mutex::new(Some(f));
    run_threads(what, 1, limit, move |_| {
        let f = f.lock().unwrap_or_else(|p| p.into_inner()).take();
        f.expect("run once")()
    })
    .pop()
    .expect("one result")
}

/// Waits for every child process (PEs a test started); kills the rest and
/// fails after `limit`, naming them. Returns whether each exited successfully.
pub fn wait_children(
    what: &str,
    mut children: Vec<std::process::Child>,
    limit: Duration,
) -> Vec<bool> {
    let deadline = Instant::now() + limit;
    let mut done = vec![None; children.len()];
    while done.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if done[r].is_none() {
                done[r] = c.try_wait().unwrap();
            }
        }
        if Instant::now() >= deadline {
            let stuck: Vec<usize> = (0..done.len()).filter(|&r| done[r].is_none()).collect();
            for &r in &stuck {
                let _ = children[r].kill();
                let _ = children[r].wait();
            }
            panic!("watchdog: {what}: rank(s) {stuck:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done.into_iter().map(|s| s.unwrap().success()).collect()
}

/// Environment variable that turns "no GPU" from a skip into a failure.
pub const REQUIRE_ENV: &str = "XCALL_REQUIRE_CUDA";

/// Whether `XCALL_REQUIRE_CUDA` is true.
///
/// # Panics
/// When it is not a boolean (see [`crate::env`]).
pub fn cuda_required() -> bool {
    required(REQUIRE_ENV)
}

/// Whether boolean variable `name` (an `XCALL_REQUIRE_*` switch of the
/// tests) is true.
///
/// # Panics
/// When it is not a boolean: the test fails naming it.
pub fn required(name: &str) -> bool {
    crate::env::flag(name)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or(false)
}

/// The number of CUDA devices for GPU test `test`, or `None` after printing
/// a skip line when CUDA is unavailable.
///
/// # Panics
/// When CUDA is unavailable and `XCALL_REQUIRE_CUDA=1` is set: that is the
/// test failing.
pub fn cuda_devices_or_skip(test: &str) -> Option<usize> {
    match cuda::device_count() {
        Ok(n) => Some(n),
        Err(e) if cuda_required() => panic!("{test}: {REQUIRE_ENV}=1 but {e}"),
        Err(e) => {
            skip(test, &e.to_string());
            None
        }
    }
}

/// The GPU of PE `rank` when the PEs are processes: GPU `rank` mod the
/// machine's GPUs, so that processes share GPUs where there are fewer.
pub fn process_gpu(rank: usize) -> crate::Device {
    let n = cuda::device_count().unwrap_or(1).max(1);
    crate::Device::cuda((rank % n) as u32)
}

/// The GPUs for test `test`, whose `pes` PEs are processes on
/// [`process_gpu`]: `None` after a skip line without CUDA (as
/// [`cuda_devices_or_skip`]), or where PEs would share a GPU whose compute
/// mode lets one process hold it at a time.
pub fn gpus_for_processes(test: &str, pes: usize) -> Option<usize> {
    let n = cuda_devices_or_skip(test)?;
    if pes <= n {
        return Some(n);
    }
    for device in (0..pes).map(process_gpu).take(n) {
        match cuda::device_info(device) {
            Ok(info) if !info.processes_may_share => {
                let why = format!(
                    "{pes} PE processes would share {device}, whose compute mode lets one process hold it at a time"
                );
                skip(test, &why);
                return None;
            }
            Ok(_) => {}
            Err(e) => panic!("{test}: {device}: {e}"),
        }
    }
    Some(n)
}

/// The environment variable that makes a missing NVRTC a failure of the
/// compile-only kernel tests (CI sets it: it installs NVRTC, not a GPU).
pub const REQUIRE_NVRTC_ENV: &str = "XCALL_REQUIRE_NVRTC";

/// NVRTC's version for compile-only test `test` (no GPU needed), or `None`
/// after printing a skip line when the NVRTC library cannot be opened.
///
/// # Panics
/// When NVRTC is missing and `XCALL_REQUIRE_NVRTC=1` is set.
pub fn nvrtc_or_skip(test: &str) -> Option<(i32, i32)> {
    match cuda::nvrtc_version() {
        Ok(v) => Some(v),
        Err(e) if required(REQUIRE_NVRTC_ENV) => panic!("{test}: {REQUIRE_NVRTC_ENV}=1 but {e}"),
        Err(e) => {
            skip(test, &e.to_string());
            None
        }
    }
}

/// Compiles `code` (program `name`) with NVRTC for `arch`, with no GPU:
/// `compute_XX` checks the C++ and makes PTX; `sm_XX` (or `sm_XXa`) also
/// assembles it, so the inline PTX is checked as the driver would.
///
/// # Panics
/// When NVRTC refuses the program: the message holds NVRTC's log.
pub fn nvrtc_compiles(name: &str, code: &str, arch: &str, options: &[&str]) {
    let mut all = vec![format!("--gpu-architecture={arch}")];
    all.extend(options.iter().map(|o| o.to_string()));
    let opts = cudarc::nvrtc::CompileOptions {
        options: all,
        name: Some(name.to_string()),
        ..Default::default()
    };
    if let Err(e) = cudarc::nvrtc::compile_ptx_with_opts(code, opts) {
        let log = crate::kernel_cache::compile_log(&e);
        panic!("{name} does not compile for {arch}:\n{log}");
    }
}

/// Prints `SKIP <test>: <reason>` on stderr. It writes to the stream
/// directly, so the line shows even when the test harness captures output,
/// and in one write: stderr is unbuffered, and a line written piece by
/// piece can be split by the harness's own lines from other threads (where
/// stdout and stderr go to one file, `run-all.sh` then cannot read it).
pub fn skip(test: &str, reason: &str) {
    let _ = write_skip(&mut std::io::stderr(), test, reason);
}

/// [`skip`]'s line into `w`, in one `write_all`.
fn write_skip(w: &mut dyn std::io::Write, test: &str, reason: &str) -> std::io::Result<()> {
    w.write_all(format!("SKIP {test}: {reason}\n").as_bytes())
}

/// Deterministic pseudo-random numbers for tests and benchmarks
/// (xorshift64): fresh data for every seed, never all zeros.
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator for `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value, uniform in [-1, 1) on a 2^-23 grid.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A `[tokens, experts]` 0/1 routing map (row-major bytes) in which
    /// every token picks `k` distinct experts (all of them when `k >=
    /// experts`), as a top-k router does.
    pub fn top_k_routing(&mut self, tokens: usize, experts: usize, k: usize) -> Vec<u8> {
        let mut routing = vec![0u8; tokens * experts];
        for row in routing.chunks_mut(experts.max(1)) {
            let mut picked = 0;
            while picked < k.min(experts) {
                let x = (self.next_u64() % experts as u64) as usize;
                if row[x] == 0 {
                    row[x] = 1;
                    picked += 1;
                }
            }
        }
        routing
    }
}

/// `n` values uniform in [-1, 1) from `seed`.
pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut g = XorShift::new(seed);
    (0..n).map(|_| g.next_f32()).collect()
}

/// Held by [`capture_graph`] while it captures and by [`new_stream`] while it
/// creates a stream: a test process's threads share the device's primary
/// context, and cudarc's first stream of a context handle synchronizes the
/// whole context, which fails while another thread captures and
/// invalidates that capture.
fn capture_guard() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new stream of `ctx`, never created while another thread of this
/// process captures through [`capture_graph`] (see [`capture_guard`]).
/// Panics on a driver error (a test helper).
pub fn new_stream(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> std::sync::Arc<cudarc::driver::CudaStream> {
    let _guard = capture_guard();
    ctx.new_stream().unwrap()
}

/// Captures one call of `f` on `stream` (thread-local capture mode) into an
/// owned executable of the core graph layer (destroyed on drop; launch it
/// with [`Stream::launch_graph`](crate::cuda::Stream::launch_graph)), for
/// tests and benches that replay graphs. No stream is created through
/// [`new_stream`] meanwhile. Panics on a driver error (a test helper).
pub fn capture_graph(
    device: crate::Device,
    stream: &cudarc::driver::CudaStream,
    f: &mut dyn FnMut(),
) -> crate::cuda::GraphExec {
    use crate::cuda::{CaptureMode, Stream};
    // SAFETY: a live stream of the caller, borrowed for this call.
    let s = unsafe { Stream::from_raw(device, stream.cu_stream()) };
    let _guard = capture_guard();
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    f();
    let graph = s.end_capture().unwrap();
    graph.instantiate(device).unwrap()
}

/// Times every variant once per round, round after round (so clock drift
/// affects all alike), after a warm-up of 30 rounds; returns each
/// variant's CUDA-event median in ms. The variants enqueue work on
/// `stream` (of `ctx`) and nothing else.
pub fn interleaved_medians(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    stream: &cudarc::driver::CudaStream,
    rounds: usize,
    variants: &mut [Box<dyn FnMut() + '_>],
) -> Vec<f64> {
    for _ in 0..30 {
        for v in variants.iter_mut() {
            v();
        }
    }
    stream.synchronize().unwrap();
    let timed = crate::cuda::TIMED_EVENT;
    let mut samples = vec![Vec::with_capacity(rounds); variants.len()];
    for _ in 0..rounds {
        for (v, out) in variants.iter_mut().zip(samples.iter_mut()) {
            let (a, b) = (ctx.new_event(timed).unwrap(), ctx.new_event(timed).unwrap());
            a.record(stream).unwrap();
            v();
            b.record(stream).unwrap();
            b.synchronize().unwrap();
            out.push(a.elapsed_ms(&b).unwrap() as f64);
        }
    }
    samples
        .into_iter()
        .map(|mut t| {
            t.sort_by(|x, y| x.total_cmp(y));
            t[t.len() / 2]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    /// A writer that keeps each write apart.
    struct Writes(Vec<Vec<u8>>);

    impl std::io::Write for Writes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The skip line goes out in one write: stderr is unbuffered, and
    /// piece by piece the harness's lines from other threads split it
    /// (seen in a device bundle log, where run-all.sh then misread it).
    #[test]
    fn a_skip_line_is_one_write() {
        let mut w = Writes(Vec::new());
        super::write_skip(
            &mut w,
            "cuda ep timeout",
            "needs 2 GPU(s), this machine has 1",
        )
        .unwrap();
        assert_eq!(
            w.0,
            [b"SKIP cuda ep timeout: needs 2 GPU(s), this machine has 1\n".to_vec()]
        );
    }

    /// `nvrtc_or_skip` answers NVRTC's version where it opens and `None`
    /// where it does not (this test runs only where that is allowed).
    #[test]
    fn nvrtc_or_skip_answers_the_version_or_none() {
        match crate::cuda::nvrtc_version() {
            Ok(v) => assert_eq!(super::nvrtc_or_skip("nvrtc_or_skip"), Some(v)),
            Err(_) if super::required(super::REQUIRE_NVRTC_ENV) => {
                panic!("{}=1 but NVRTC cannot be opened", super::REQUIRE_NVRTC_ENV)
            }
            Err(_) => assert_eq!(super::nvrtc_or_skip("nvrtc_or_skip"), None),
        }
    }

    /// `nvrtc_compiles` passes a good program and fails a C++ error for
    /// any target, and an inline-PTX error only where it assembles
    /// (`sm_XX`), with NVRTC's log in the message.
    #[test]
    fn nvrtc_compiles_fails_bad_programs_with_the_log() {
        if super::nvrtc_or_skip("nvrtc_compiles").is_none() {
            return;
        }
        let good = r#"extern "C" __global__ void k(int* p) { *p = 1; }"#;
        let bad_cpp = r#"extern "C" __global__ void k(int* p) { *p = no_such_name; }"#;
        let bad_ptx =
            r#"extern "C" __global__ void k(int* p) { asm volatile("no.such.instruction;"); }"#;
        let fails = |code: &'static str, arch: &'static str| -> Option<String> {
            std::panic::catch_unwind(|| super::nvrtc_compiles("t.cu", code, arch, &[]))
                .err()
                .map(|e| e.downcast_ref::<String>().cloned().unwrap_or_default())
        };
        for arch in ["sm_90", "compute_90"] {
            assert_eq!(fails(good, arch), None, "{arch}");
            let msg = fails(bad_cpp, arch).expect("a C++ error fails");
            // NVRTC's own lines name the program and the line.
            assert!(
                msg.contains("t.cu does not compile for")
                    && msg.contains("t.cu(1)")
                    && msg.contains("no_such_name"),
                "{msg}"
            );
        }
        assert_eq!(fails(bad_ptx, "compute_90"), None, "PTX is not assembled");
        let msg = fails(bad_ptx, "sm_90").expect("ptxas refuses it");
        assert!(
            msg.contains("t.cu does not compile for sm_90") && msg.contains("ptxas"),
            "{msg}"
        );
    }

    use super::*;

    #[test]
    fn top_k_routing_picks_k_distinct_experts_per_token() {
        let mut g = XorShift::new(3);
        for (t, e, k) in [(50, 8, 2), (20, 4, 4), (10, 3, 5), (7, 256, 8)] {
            let r = g.top_k_routing(t, e, k);
            assert_eq!(r.len(), t * e);
            assert!(r.iter().all(|&b| b <= 1));
            for row in r.chunks(e) {
                assert_eq!(row.iter().filter(|&&b| b == 1).count(), k.min(e));
            }
        }
        // Not the same map every time.
        assert_ne!(g.top_k_routing(50, 8, 2), g.top_k_routing(50, 8, 2));
    }

    #[test]
    fn watchdogs_return_results_in_order_and_name_stuck_and_failed_threads() {
        let r = run_threads("squares", 4, Duration::from_secs(10), |i| i * i);
        assert_eq!(r, vec![0, 1, 4, 9]);
        assert_eq!(within("one", Duration::from_secs(10), || 7), 7);
        let stuck = std::panic::catch_unwind(|| {
            run_threads("stuck", 3, Duration::from_millis(200), |i| {
                if i == 1 {
                    std::thread::sleep(Duration::from_secs(5));
                }
            })
        })
        .unwrap_err();
        assert_eq!(
            crate::panic_message(&*stuck),
            "watchdog: stuck: thread(s) [1] did not finish within 200ms"
        );
        let failed = std::panic::catch_unwind(|| {
            within("boom", Duration::from_secs(10), || panic!("inner"))
        })
        .unwrap_err();
        assert_eq!(
            crate::panic_message(&*failed),
            "boom: thread 0 failed: inner"
        );
    }

    #[test]
    fn random_values_are_reproducible_in_range_and_not_constant() {
        let a = random_f32(10_000, 3);
        assert_eq!(a, random_f32(10_000, 3));
        assert_ne!(a, random_f32(10_000, 4));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().map(|&v| v as f64).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!(random_f32(100, 0).iter().any(|&v| v != 0.0));
    }
}
