//! Launch configs and autotuning: the candidates of a tunable kernel, the
//! trials that time them on scratch outputs, and the per-device cache of
//! the fastest (see the `cuda` module docs).

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::sys;
use xcall_core::cuda::{Event, StreamAlloc};
use xcall_core::{DType, Device};

use super::module::{capturing, scratch};
use super::{state, Result, MOVE_WIDTHS, UNROLLS};
use crate::args::Target;

/// A launch config of a tunable kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// Threads per block.
    pub threads: u32,
    /// Vectors in flight per thread (movement, unpermute), or dot slots per
    /// thread (`unpermute_backward`: threads = 256 / slots).
    pub unroll: u32,
    /// Blocks per multiprocessor, each looping over rows; 0 for one block
    /// per row.
    pub waves: u32,
}

pub(super) type TuneKey = (&'static str, u32, usize, u32);

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

pub(super) fn row_class(row_bytes: u64) -> u32 {
    64 - row_bytes.max(1).leading_zeros()
}

pub(super) fn default_config(vectors_per_row: u64) -> Config {
    let threads = (vectors_per_row.div_ceil(2))
        .next_power_of_two()
        .clamp(64, 256) as u32;
    Config {
        threads,
        unroll: 2,
        waves: 0,
    }
}

pub(super) fn movement_candidates() -> Vec<Config> {
    let mut c = Vec::new();
    for threads in [128, 256, 512] {
        for unroll in UNROLLS {
            for waves in [0, 4, 8] {
                c.push(Config {
                    threads,
                    unroll,
                    waves,
                });
            }
        }
    }
    c
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
    default: Config,
    candidates: &[Config],
    out_bytes: &[u64],
    run: &dyn Fn(Config, &[u64]) -> Result<()>,
) -> Result<Config> {
    let slot = state()
        .tuned
        .get_or_init(target.device, || Mutex::new(HashMap::new()));
    if let Some(c) = slot.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(*c);
    }
    if !target.autotune || capturing(target)? {
        return Ok(default);
    }
    let chosen = time_candidates(target, candidates, out_bytes, run)?.unwrap_or(default);
    AFTER_TUNING.with(|h| {
        if let Some(hook) = &*h.borrow() {
            hook(key.0)
        }
    });
    slot.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, chosen);
    Ok(chosen)
}

fn time_candidates(
    target: &Target,
    candidates: &[Config],
    out_bytes: &[u64],
    run: &dyn Fn(Config, &[u64]) -> Result<()>,
) -> Result<Option<Config>> {
    let mut trial_outputs = Vec::new();
    for &b in out_bytes {
        match scratch(target, b) {
            Ok(s) => trial_outputs.push(s),
            // Too little memory for trials: keep the default config.
            Err(_) => return Ok(None),
        }
    }
    let outs: Vec<u64> = trial_outputs.iter().map(StreamAlloc::address).collect();
    const REPS: usize = 3;
    let (device, stream) = (target.device, target.stream as sys::CUstream);
    let mut timed: Vec<(Event, Event, Config)> = Vec::new();
    for &c in candidates {
        run(c, &outs)?; // warm-up
        let (start, end) = (Event::new(device)?, Event::new(device)?);
        // SAFETY: the target's stream is a live stream of its device.
        unsafe { start.record(stream) }?;
        for _ in 0..REPS {
            run(c, &outs)?;
        }
        // SAFETY: as above.
        unsafe { end.record(stream) }?;
        timed.push((start, end, c));
    }
    let mut best: Option<(f32, Config)> = None;
    for (start, end, c) in &timed {
        let ms = end.elapsed_ms_since(start)?;
        if best.is_none_or(|(b, _)| ms < b) {
            best = Some((ms, *c));
        }
    }
    drop(timed);
    drop(trial_outputs);
    Ok(best.map(|(_, c)| c))
}

/// Blocks for `rows` rows under `config`.
pub(super) fn grid_for(device: Device, rows: usize, config: Config) -> Result<u64> {
    let rows = (rows as u64).min(1 << 20);
    if config.waves == 0 {
        return Ok(rows);
    }
    let sms = *state().multiprocessors.get_or_try_init(device, || {
        xcall_core::cuda::device_info(device).map(|i| i.multiprocessors as u64)
    })?;
    Ok(rows.min(sms * config.waves as u64))
}

/// The config cached for a kernel on a device, if any (tests and
/// benchmarks report it).
pub fn cached_configs(device: Device) -> Vec<(String, Config)> {
    state().tuned.get(device).map_or_else(Vec::new, |slot| {
        let map = slot.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, Config)> = map
            .iter()
            .map(|(k, c)| {
                (
                    format!("{} dtype={} vec={} row~2^{}", k.0, k.1, k.2, k.3),
                    *c,
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    })
}
