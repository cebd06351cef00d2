//! Autotuning: the key a tuned config is cached under, the trials that
//! time a tunable kernel's candidates (see `config`) on scratch outputs,
//! and the per-device cache of the fastest (see the `cuda` module docs).

use std::collections::HashMap;
use std::sync::Mutex;

use xcall_core::cuda::{Event, StreamAlloc};
use xcall_core::{DType, Device};

use super::catalogue::MOVE_WIDTHS;
use super::config::LaunchConfig;
use super::module::{capturing, scratch, stream};
use super::{state, Result};
use crate::args::Target;
use crate::check::Dims;
use crate::error::PermuteError;

/// What a tuned config is cached under: the launches that share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct TuneKey {
    /// The tunable kernel (`"permute"`, `"unpermute"`, ...).
    pub kernel: &'static str,
    /// The element type (`DType as u32`; 0 where the kernel moves bytes).
    pub dtype: u32,
    /// The vector width in bytes.
    pub width: usize,
    /// [`row_class`] of the row's bytes.
    pub row: u32,
    /// [`routes_class`] (0 for the chunk sort).
    pub routes: u32,
    /// [`tokens_class`] of the rows or tokens.
    pub tokens: u32,
    /// [`experts_class`] (0 for the chunk sort).
    pub experts: u32,
}

impl TuneKey {
    /// The key of `kernel` over a routed shape `d` (tokens, their routed
    /// rows and experts) with rows of `row_bytes`, moved `width` bytes at a
    /// time.
    pub(super) fn routed(
        kernel: &'static str,
        dtype: u32,
        width: usize,
        row_bytes: u64,
        d: &Dims,
    ) -> TuneKey {
        TuneKey {
            kernel,
            dtype,
            width,
            row: row_class(row_bytes),
            routes: routes_class(d.tokens, d.out_rows),
            tokens: tokens_class(d.tokens),
            experts: experts_class(d.experts),
        }
    }
}

/// The widest vector (bytes) that divides the row and every address.
pub(super) fn width(row_bytes: u64, addresses: &[u64]) -> usize {
    MOVE_WIDTHS
        .into_iter()
        .find(|&v| row_bytes % v as u64 == 0 && addresses.iter().all(|a| a % v as u64 == 0))
        .unwrap_or(1)
}

pub(super) fn arith_width(dtype: DType, row_bytes: u64, addresses: &[u64]) -> usize {
    if width(row_bytes, addresses) == 16 {
        16
    } else {
        dtype.size_bytes()
    }
}

/// The class of a row's bytes, by half octaves: [2^k, 1.5 x 2^k) and
/// [1.5 x 2^k, 2^(k+1)) differ, so that rows of 4096 and 7168 bf16 values
/// (8 KiB, 14 KiB), whose best configs differ, tune apart.
pub(super) fn row_class(row_bytes: u64) -> u32 {
    let r = row_bytes.max(1);
    let octave = 63 - r.leading_zeros();
    let upper = octave > 0 && (r >> (octave - 1)) & 1 == 1;
    2 * octave + upper as u32
}

/// The class of `out_rows / tokens` (routes per token: 1, 2, 3-4, 5-8,
/// ...): top-1 and top-8 favour different configs.
pub(super) fn routes_class(tokens: usize, out_rows: usize) -> u32 {
    let per = (out_rows as u64).div_ceil(tokens.max(1) as u64).max(1);
    64 - (per - 1).leading_zeros()
}

/// The class of the token count, by octaves (4096 and 16384 tokens tune
/// apart): how many rows each block of a config's grid takes, and so which
/// config is fastest, depends on it.
pub(super) fn tokens_class(tokens: usize) -> u32 {
    64 - (tokens.max(1) as u64 - 1).leading_zeros()
}

/// The class of the expert count, by octaves. A token's routes land in
/// its experts' regions of the permuted tensor: with few experts the
/// tokens that follow one another read and write rows that follow one
/// another too, with many the rows are spread over the whole tensor, and
/// the fastest config differs (H200, fp8 unpermute at (16384, E, 7168, 2):
/// the config tuned at E = 4 ran at 0.77 of a copy at E = 64..256, where
/// another reached 0.93).
pub(super) fn experts_class(experts: usize) -> u32 {
    tokens_class(experts)
}

type Forced = Vec<(&'static str, LaunchConfig)>;

thread_local! {
    static FORCED: std::cell::RefCell<Forced> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Test hook: runs `f` with each named tunable kernel (`"permute"`,
/// `"unpermute"`, `"unpermute_backward"`, `"sort_chunks"`) launched on this
/// thread under the given config (one of that kernel's candidates),
/// bypassing the cache and the trials, so tests can check every variant
/// against the Host.
#[doc(hidden)]
pub fn with_configs<R>(configs: &[(&'static str, LaunchConfig)], f: impl FnOnce() -> R) -> R {
    struct Reset(Forced);
    impl Drop for Reset {
        fn drop(&mut self) {
            FORCED.with(|c| *c.borrow_mut() = std::mem::take(&mut self.0));
        }
    }
    let _reset = Reset(FORCED.with(|c| c.replace(configs.to_vec())));
    f()
}

/// See [`set_after_tuning_hook`].
pub type TuningHook = Box<dyn Fn(&str)>;

thread_local! {
    static AFTER_TUNING: std::cell::RefCell<Option<TuningHook>> =
        const { std::cell::RefCell::new(None) };
}

/// Test hook: `hook(kernel)` runs on this thread after a kernel's tuning
/// trials and before its real launch (`None` removes it). Tests use it to
/// check that the trials wrote nothing the caller can see.
#[doc(hidden)]
pub fn set_after_tuning_hook(hook: Option<TuningHook>) {
    AFTER_TUNING.with(|h| *h.borrow_mut() = hook);
}

/// Times `run` for every candidate on scratch outputs of `out_bytes`; see
/// the module docs.
pub(super) fn choose(
    target: &Target,
    key: TuneKey,
    default: LaunchConfig,
    candidates: &[LaunchConfig],
    out_bytes: &[u64],
    run: &dyn Fn(LaunchConfig, &[u64]) -> Result<()>,
) -> Result<LaunchConfig> {
    let forced = FORCED.with(|c| c.borrow().iter().find(|f| f.0 == key.kernel).map(|f| f.1));
    if let Some(config) = forced {
        return Ok(config);
    }
    let slot = state()
        .tuned
        .get_or_init(target.device, || Mutex::new(HashMap::new()));
    if let Some(c) = slot.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(*c);
    }
    if !target.autotune || capturing(target)? {
        tracing::trace!(
            device = %target.device,
            kernel = key.kernel,
            autotune = target.autotune,
            config = ?default,
            "default launch config (not tuned: autotune off or stream capturing)"
        );
        return Ok(default);
    }
    let started = std::time::Instant::now();
    let timed = time_candidates(target, candidates, out_bytes, run)?;
    let chosen = timed.unwrap_or(default);
    tracing::debug!(
        device = %target.device,
        kernel = key.kernel,
        dtype = key.dtype,
        width = key.width,
        row_class = key.row,
        routes_class = key.routes,
        tokens_class = key.tokens,
        experts_class = key.experts,
        candidates = candidates.len(),
        config = ?chosen,
        is_default = chosen == default,
        timed = timed.is_some(),
        ms = %format_args!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
        "autotuned launch config"
    );
    AFTER_TUNING.with(|h| {
        if let Some(hook) = &*h.borrow() {
            hook(key.kernel)
        }
    });
    slot.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, chosen);
    Ok(chosen)
}

fn time_candidates(
    target: &Target,
    candidates: &[LaunchConfig],
    out_bytes: &[u64],
    run: &dyn Fn(LaunchConfig, &[u64]) -> Result<()>,
) -> Result<Option<LaunchConfig>> {
    let mut trial_outputs = Vec::new();
    for &b in out_bytes {
        match scratch(target, b) {
            Ok(s) => trial_outputs.push(s),
            // Too little memory for trials: keep the default config.
            Err(_) => return Ok(None),
        }
    }
    let outs: Vec<u64> = trial_outputs.iter().map(StreamAlloc::address).collect();
    // Warm-up of every candidate first (a config the compiled kernel
    // cannot launch with, too many threads for its registers, is left out),
    // so the clocks have settled before any is timed.
    let mut usable = Vec::new();
    for &c in candidates {
        match run(c, &outs) {
            Err(PermuteError::Unsupported(_)) => continue,
            r => r?,
        }
        usable.push(c);
    }
    // Screening: two passes over every candidate, each keeping its faster
    // pass. Then the fastest few confirm in more interleaved passes, and
    // the fastest median of those wins: a candidate that screened fast in
    // one lucky pass does not win on it.
    let screened = time_passes(target, &usable, 2, &outs, run)?;
    let best: Vec<(LaunchConfig, f32)> = usable
        .iter()
        .zip(&screened)
        .map(|(&c, ms)| (c, ms.iter().copied().fold(f32::INFINITY, f32::min)))
        .collect();
    let finals = finalists(&best, FINALISTS);
    let confirmed = time_passes(target, &finals, CONFIRM_PASSES, &outs, run)?;
    drop(trial_outputs);
    Ok(fastest_median(&finals, &confirmed))
}

/// Candidates that go on from the screening passes to the confirming ones.
const FINALISTS: usize = 4;
/// Confirming passes over the finalists.
const CONFIRM_PASSES: usize = 5;

/// Milliseconds of `REPS` launches of each config, `passes` times over
/// all of them in turn (waits for the stream once, at the end).
fn time_passes(
    target: &Target,
    configs: &[LaunchConfig],
    passes: usize,
    outs: &[u64],
    run: &dyn Fn(LaunchConfig, &[u64]) -> Result<()>,
) -> Result<Vec<Vec<f32>>> {
    const REPS: usize = 3;
    let (device, stream) = (target.device, stream(target));
    let mut events: Vec<(Event, Event, usize)> = Vec::new();
    for _pass in 0..passes {
        for (i, &c) in configs.iter().enumerate() {
            let (start, end) = (Event::new(device)?, Event::new(device)?);
            start.record_on(&stream)?;
            for _ in 0..REPS {
                run(c, outs)?;
            }
            end.record_on(&stream)?;
            events.push((start, end, i));
        }
    }
    let mut ms = vec![Vec::with_capacity(passes); configs.len()];
    for (start, end, i) in &events {
        ms[*i].push(end.elapsed_ms_since(start)?);
    }
    Ok(ms)
}

/// The `n` configs with the lowest times, fastest first.
fn finalists(best: &[(LaunchConfig, f32)], n: usize) -> Vec<LaunchConfig> {
    let mut sorted = best.to_vec();
    sorted.sort_by(|a, b| a.1.total_cmp(&b.1));
    sorted.into_iter().take(n).map(|(c, _)| c).collect()
}

/// The config whose passes have the lowest median (the earlier of equal
/// ones), or `None` for no configs.
fn fastest_median(configs: &[LaunchConfig], ms: &[Vec<f32>]) -> Option<LaunchConfig> {
    let median = |v: &[f32]| {
        let mut v = v.to_vec();
        v.sort_by(f32::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f32::INFINITY)
    };
    configs
        .iter()
        .zip(ms)
        .map(|(&c, v)| (c, median(v)))
        .fold(None, |acc: Option<(LaunchConfig, f32)>, (c, m)| match acc {
            Some((_, b)) if b <= m => acc,
            _ => Some((c, m)),
        })
        .map(|(c, _)| c)
}

/// The config cached for a kernel on a device, if any (tests and
/// benchmarks report it).
pub fn cached_configs(device: Device) -> Vec<(String, LaunchConfig)> {
    state().tuned.get(device).map_or_else(Vec::new, |slot| {
        let map = slot.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, LaunchConfig)> = map
            .iter()
            .map(|(k, c)| {
                (
                    format!(
                        "{} dtype={} vec={} row~{}2^{} routes~2^{} tokens~2^{} experts~2^{}",
                        k.kernel,
                        k.dtype,
                        k.width,
                        if k.row % 2 == 1 { "1.5x" } else { "" },
                        k.row / 2,
                        k.routes,
                        k.tokens,
                        k.experts
                    ),
                    *c,
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::config::{default_config, movement_candidates};

    #[test]
    fn routes_per_token_fall_into_power_of_two_classes() {
        let classes: Vec<u32> = [(100, 100), (100, 101), (100, 200), (100, 300), (100, 800)]
            .iter()
            .map(|&(t, n)| routes_class(t, n))
            .collect();
        assert_eq!(classes, [0, 1, 1, 2, 3]);
        assert_eq!(routes_class(0, 0), 0);
        assert_eq!(routes_class(4096, 4096 * 8 - 5), 3);
    }

    #[test]
    fn token_counts_fall_into_octaves() {
        let classes: Vec<u32> = [0, 1, 2, 3, 4096, 4097, 8192, 16384]
            .iter()
            .map(|&t| tokens_class(t))
            .collect();
        assert_eq!(classes, [0, 0, 1, 2, 12, 13, 13, 14]);
    }

    #[test]
    fn expert_counts_fall_into_octaves() {
        let classes: Vec<u32> = [1, 4, 8, 9, 64, 128, 160, 256]
            .iter()
            .map(|&e| experts_class(e))
            .collect();
        assert_eq!(classes, [0, 2, 3, 4, 6, 7, 8, 8]);
    }

    /// A routed launch's key: each shape class from its own dimension, so
    /// shapes that differ only in the expert octave tune apart and shapes
    /// within one class share a config.
    #[test]
    fn routed_keys_class_each_dimension() {
        let dims = |tokens, experts, out_rows| Dims {
            tokens,
            experts,
            hidden: 7168,
            out_rows,
            scales: 0,
        };
        let key = |d: Dims| TuneKey::routed("unpermute", 3, 16, 14336, &d);
        assert_eq!(
            key(dims(4096, 256, 32768)),
            TuneKey {
                kernel: "unpermute",
                dtype: 3,
                width: 16,
                row: row_class(14336),
                routes: 3,
                tokens: 12,
                experts: 8,
            }
        );
        assert_ne!(key(dims(4096, 4, 32768)), key(dims(4096, 256, 32768)));
        assert_eq!(key(dims(4096, 160, 32768)), key(dims(4096, 256, 32768)));
        assert_ne!(key(dims(16384, 256, 131072)), key(dims(4096, 256, 32768)));
        assert_ne!(key(dims(4096, 256, 4096)), key(dims(4096, 256, 32768)));
    }

    #[test]
    fn the_vector_width_divides_the_row_and_every_address() {
        assert_eq!(width(14336, &[0x1000, 0x2000]), 16);
        assert_eq!(width(14336, &[0x1000, 0x2008]), 8);
        assert_eq!(width(12, &[0x1000]), 4);
        assert_eq!(width(6, &[0x1000, 0x1002]), 2);
        assert_eq!(width(7, &[0x1000]), 1);
        // fp32 rows whose addresses are only 4-byte aligned: the element.
        assert_eq!(arith_width(DType::F32, 64, &[0x1004]), 4);
        assert_eq!(arith_width(DType::Bf16, 64, &[0x1000]), 16);
        assert_eq!(arith_width(DType::Bf16, 6, &[0x1000]), 2);
    }

    #[test]
    fn row_classes_are_half_octaves() {
        let rows = [0, 1, 2, 3, 4, 5, 6, 7, 1024, 1535, 1536, 2047, 2048];
        let classes: Vec<u32> = rows.iter().map(|&r| row_class(r)).collect();
        assert_eq!(classes, [0, 0, 2, 3, 4, 4, 5, 5, 20, 20, 21, 21, 22]);
        // bf16 rows of H = 4096 and H = 7168 tune apart.
        assert_eq!((row_class(8192), row_class(14336)), (26, 27));
        assert_eq!(row_class(u64::MAX), 127);
    }

    /// Configs told apart by their thread count.
    fn c(threads: u32) -> LaunchConfig {
        LaunchConfig {
            threads,
            ..default_config(64)
        }
    }

    #[test]
    fn finalists_are_the_fastest_few_fastest_first() {
        let best = [
            (c(1), 3.0),
            (c(2), 1.0),
            (c(3), 2.0),
            (c(4), 0.5),
            (c(5), 9.0),
        ];
        assert_eq!(finalists(&best, 3), [c(4), c(2), c(3)]);
        assert_eq!(finalists(&best, 9).len(), 5);
        assert!(finalists(&[], 4).is_empty());
    }

    #[test]
    fn the_fastest_median_wins_not_one_lucky_pass() {
        // c(1) has the single fastest pass; c(2) is faster in most.
        let ms = [
            vec![5.0, 0.5, 5.0, 5.0, 5.0],
            vec![2.0, 2.0, 9.0, 2.0, 2.0],
            vec![3.0, 3.0, 3.0, 3.0, 3.0],
        ];
        assert_eq!(fastest_median(&[c(1), c(2), c(3)], &ms), Some(c(2)));
        // Equal medians: the earlier (the faster screened) config.
        let tie = [vec![2.0, 1.0, 3.0], vec![2.0, 2.0, 2.0]];
        assert_eq!(fastest_median(&[c(7), c(8)], &tie), Some(c(7)));
        // An even count takes the upper middle value.
        let even = [vec![1.0, 4.0], vec![3.0, 3.0]];
        assert_eq!(fastest_median(&[c(1), c(2)], &even), Some(c(2)));
        assert_eq!(fastest_median(&[], &[]), None);
    }

    #[test]
    fn forced_configs_apply_to_the_named_kernel_only_and_are_reset() {
        let forced = |name| FORCED.with(|c| c.borrow().iter().find(|f| f.0 == name).map(|f| f.1));
        let c = movement_candidates()[5];
        with_configs(&[("permute", c)], || {
            assert_eq!(forced("permute"), Some(c));
            assert_eq!(forced("unpermute"), None);
        });
        assert_eq!(forced("permute"), None);
    }
}
