//! Launch configs and autotuning: the candidates of a tunable kernel, the
//! trials that time them on scratch outputs, and the per-device cache of
//! the fastest (see the `cuda` module docs).

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::sys;
use xcall_core::cuda::{Event, StreamAlloc};
use xcall_core::{DType, Device};

use super::module::{capturing, scratch};
use super::{device_facts, state, Result, MOVE_WIDTHS, UNROLLS};
use crate::args::Target;
use crate::check::Dims;
use crate::error::PermuteError;

/// The kernel name infix of the warp-per-row variants (`permute_w_16_2`).
pub(super) const WARP_INFIX: &str = "w_";

/// A launch config of a tunable kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// Threads per block.
    pub threads: u32,
    /// Vectors in flight per thread (movement, unpermute), or dot slots per
    /// thread (`unpermute_backward`: threads = 256 / slots).
    pub unroll: u32,
    /// Blocks per multiprocessor, each looping over rows; 0 for one block
    /// (or warp) per row, or, for the bulk-copy kernels, as many blocks as
    /// fit the multiprocessors at once.
    pub waves: u32,
    /// Each warp takes its own row (the `*_w_*` kernels) instead of the
    /// whole block taking one.
    pub per_warp: bool,
    /// `unpermute_backward` only: 16-byte groups of the token's gradient
    /// each of the block's 256 threads holds in registers for all of the
    /// token's routes (the `unpermute_bwd_h*` kernels, rows of at most
    /// 256 x `held` whole groups; `unroll` routes per batch); 0 otherwise.
    pub held: u32,
    /// `permute`: shared-memory stages of the bulk-copy kernel
    /// (`permute_bulk_S`: sm_90 or newer, rows and addresses in 16-byte
    /// units, pieces of [`bulk_piece`] bytes). `unpermute`: stages of the
    /// async kernel (`unpermute_aS_w_16_1`: a warp per token, 16-byte
    /// vectors, [`async_smem`] bytes of shared memory). 0 for the other
    /// kernels.
    pub stages: u32,
    /// `unpermute_backward`'s warp kernel only: warps that share a token,
    /// its routes dealt out among them (`T x split` warps' worth of work
    /// where few tokens would leave warp slots idle); 0 for one warp per
    /// token and for the other kernels.
    pub split: u32,
}

impl Config {
    /// Rows one block takes at a time.
    fn rows_per_block(self) -> u64 {
        if self.per_warp {
            (self.threads / 32).max(1) as u64
        } else {
            1
        }
    }

    /// The kernel name's variant infix: [`WARP_INFIX`] for a warp-per-row
    /// kernel.
    pub(super) fn infix(self) -> &'static str {
        if self.per_warp {
            WARP_INFIX
        } else {
            ""
        }
    }
}

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

pub(super) fn default_config(vectors_per_row: u64) -> Config {
    let threads = (vectors_per_row.div_ceil(2))
        .next_power_of_two()
        .clamp(64, 256) as u32;
    Config {
        threads,
        unroll: 2,
        waves: 0,
        per_warp: false,
        held: 0,
        stages: 0,
        split: 0,
    }
}

/// The configs tried for unpermute and sort_chunks_by_map, and permute's
/// register kernels (see [`permute_candidates`]).
#[doc(hidden)]
pub fn movement_candidates() -> Vec<Config> {
    let mut c = Vec::new();
    for per_warp in [false, true] {
        for threads in [128, 256, 512] {
            for unroll in UNROLLS {
                for waves in [0, 4, 8] {
                    c.push(Config {
                        threads,
                        unroll,
                        waves,
                        per_warp,
                        held: 0,
                        stages: 0,
                        split: 0,
                    });
                }
            }
        }
    }
    c
}

/// Stages of unpermute's async kernels (`unpermute_a2_w_16_1`, ...).
pub(super) const ASYNC_STAGES: [u32; 2] = [2, 3];

/// Routes whose vectors one stage of an async unpermute warp holds (the
/// kernels' `ASYNC_ROUTES`).
const ASYNC_ROUTES: u64 = 8;

/// The dynamic shared memory of an async unpermute block of `threads`
/// threads with `stages` stages: per warp, `stages` x [`ASYNC_ROUTES`] x 32
/// vectors of 16 bytes.
pub(super) fn async_smem(threads: u32, stages: u32) -> u64 {
    (threads / 32) as u64 * stages as u64 * ASYNC_ROUTES * 32 * 16
}

/// The configs tried for unpermute: the movement configs and, where rows
/// and addresses are whole 16-byte vectors (`async_rows`), the async
/// kernels' (a warp per token; blocks of 64 or 128 threads whose stages
/// fit [`BULK_SMEM`]).
#[doc(hidden)]
pub fn unpermute_candidates(async_rows: bool) -> Vec<Config> {
    let mut c = movement_candidates();
    if !async_rows {
        return c;
    }
    for threads in [64, 128] {
        for stages in ASYNC_STAGES {
            if async_smem(threads, stages) > BULK_SMEM {
                continue;
            }
            for waves in [0, 8] {
                c.push(Config {
                    threads,
                    unroll: 1,
                    waves,
                    per_warp: true,
                    held: 0,
                    stages,
                    split: 0,
                });
            }
        }
    }
    c
}

/// Stages of the bulk-copy permute kernels (`permute_bulk_4`, `_8`).
pub(super) const BULK_STAGES: [u32; 2] = [4, 8];

/// Shared memory the stages of a bulk-copy permute block take at most
/// (bytes): with the kernel's own arrays and the zero fill's, under the
/// 48 KiB a kernel may use without opting in.
pub(super) const BULK_SMEM: u64 = 40 * 1024;

/// Threads of a bulk-copy permute block: the mover's warp and the
/// router's.
pub(super) const BULK_THREADS: u32 = 64;

/// The bytes one bulk copy of a `row`-byte row moves with `stages` stages:
/// the row in as few pieces as keep the stages within [`BULK_SMEM`], each a
/// multiple of 16 bytes (the last piece may be shorter). `row` is a
/// positive multiple of 16 and `stages` one of [`BULK_STAGES`].
pub(super) fn bulk_piece(row: u64, stages: u32) -> u64 {
    let pieces = (row * stages as u64).div_ceil(BULK_SMEM).max(1);
    row.div_ceil(pieces).next_multiple_of(16)
}

/// The configs tried for permute: the movement kernels' and, where the
/// device and the row take them, the bulk-copy kernels' (a block of two
/// warps; `waves` blocks per multiprocessor, 0: as many as fit).
#[doc(hidden)]
pub fn permute_candidates() -> Vec<Config> {
    let mut c = movement_candidates();
    for stages in BULK_STAGES {
        for waves in [0, 4, 8, 16] {
            c.push(Config {
                threads: BULK_THREADS,
                unroll: 1,
                waves,
                per_warp: false,
                held: 0,
                stages,
                split: 0,
            });
        }
    }
    c
}

/// The configs tried for unpermute_backward: a block of 256 / slots
/// threads per token, a warp per token holding all 256 dot slots, or 2, 4
/// or 8 such warps per token sharing its routes.
#[doc(hidden)]
pub fn backward_candidates() -> Vec<Config> {
    let mut c = Vec::new();
    for waves in [0, 4, 8] {
        for unroll in UNROLLS {
            c.push(Config {
                threads: 256 / unroll,
                unroll,
                waves,
                per_warp: false,
                held: 0,
                stages: 0,
                split: 0,
            });
        }
        for threads in [128, 256] {
            for split in [0, 2, 4, 8] {
                if split > 0 && waves == 4 {
                    continue;
                }
                c.push(Config {
                    threads,
                    unroll: 8,
                    waves,
                    per_warp: true,
                    held: 0,
                    stages: 0,
                    split,
                });
            }
        }
    }
    for (held, unroll) in HELD {
        c.push(Config {
            threads: 256,
            unroll,
            waves: 0,
            per_warp: false,
            held,
            stages: 0,
            split: 0,
        });
    }
    c
}

/// The row-holding `unpermute_backward` kernels: (groups held per thread,
/// routes per batch).
pub(super) const HELD: [(u32, u32); 3] = [(4, 1), (4, 2), (8, 1)];

/// Whether a row-holding `unpermute_backward` config fits rows of `row`
/// bytes moved in `width`-byte vectors: whole 16-byte groups, at most 256
/// x `held` of them.
pub(super) fn held_fits(config: Config, width: usize, row: u64) -> bool {
    width == 16 && row % 16 == 0 && row / 16 <= 256 * config.held as u64
}

type Forced = Vec<(&'static str, Config)>;

thread_local! {
    static FORCED: std::cell::RefCell<Forced> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Test hook: runs `f` with each named tunable kernel (`"permute"`,
/// `"unpermute"`, `"unpermute_backward"`, `"sort_chunks"`) launched on this
/// thread under the given config (one of that kernel's candidates),
/// bypassing the cache and the trials, so tests can check every variant
/// against the Host.
#[doc(hidden)]
pub fn with_configs<R>(configs: &[(&'static str, Config)], f: impl FnOnce() -> R) -> R {
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
    default: Config,
    candidates: &[Config],
    out_bytes: &[u64],
    run: &dyn Fn(Config, &[u64]) -> Result<()>,
) -> Result<Config> {
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
    let best: Vec<(Config, f32)> = usable
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
    configs: &[Config],
    passes: usize,
    outs: &[u64],
    run: &dyn Fn(Config, &[u64]) -> Result<()>,
) -> Result<Vec<Vec<f32>>> {
    const REPS: usize = 3;
    let (device, stream) = (target.device, target.stream as sys::CUstream);
    let mut events: Vec<(Event, Event, usize)> = Vec::new();
    for _pass in 0..passes {
        for (i, &c) in configs.iter().enumerate() {
            let (start, end) = (Event::new(device)?, Event::new(device)?);
            // SAFETY: the target's stream is a live stream of its device.
            unsafe { start.record(stream) }?;
            for _ in 0..REPS {
                run(c, outs)?;
            }
            // SAFETY: as above.
            unsafe { end.record(stream) }?;
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
fn finalists(best: &[(Config, f32)], n: usize) -> Vec<Config> {
    let mut sorted = best.to_vec();
    sorted.sort_by(|a, b| a.1.total_cmp(&b.1));
    sorted.into_iter().take(n).map(|(c, _)| c).collect()
}

/// The config whose passes have the lowest median (the earlier of equal
/// ones), or `None` for no configs.
fn fastest_median(configs: &[Config], ms: &[Vec<f32>]) -> Option<Config> {
    let median = |v: &[f32]| {
        let mut v = v.to_vec();
        v.sort_by(f32::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f32::INFINITY)
    };
    configs
        .iter()
        .zip(ms)
        .map(|(&c, v)| (c, median(v)))
        .fold(None, |acc: Option<(Config, f32)>, (c, m)| match acc {
            Some((_, b)) if b <= m => acc,
            _ => Some((c, m)),
        })
        .map(|(c, _)| c)
}

/// Blocks for `rows` rows under `config`.
pub(super) fn grid_for(device: Device, rows: usize, config: Config) -> Result<u64> {
    let rows = (rows as u64).div_ceil(config.rows_per_block()).min(1 << 20);
    if config.waves == 0 {
        return Ok(rows);
    }
    let sms = device_facts(device)?.multiprocessors;
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
    fn bulk_pieces_keep_the_stages_within_their_shared_memory() {
        // Known answers: a 14 KiB row in 2 pieces at 4 stages, in 3 at 8
        // (4779 bytes rounded up to 4784; the last piece 4768); a row
        // that fits whole stays whole.
        assert_eq!(bulk_piece(14336, 4), 7168);
        assert_eq!(bulk_piece(14336, 8), 4784);
        assert_eq!(bulk_piece(4096, 8), 4096);
        assert_eq!(bulk_piece(16, 8), 16);
        for row in (16..=65536).step_by(16 * 37) {
            for stages in BULK_STAGES {
                let piece = bulk_piece(row, stages);
                assert_eq!(piece % 16, 0, "row {row}, {stages} stages");
                assert!(piece <= row && piece > 0, "row {row}: piece {piece}");
                assert!(
                    stages as u64 * piece <= BULK_SMEM + 16 * stages as u64,
                    "row {row}, {stages} stages: {piece}-byte pieces"
                );
                // The pieces cover the row with no empty last piece.
                let pieces = row.div_ceil(piece);
                assert!((pieces - 1) * piece < row, "row {row}: piece {piece}");
            }
        }
    }

    #[test]
    fn permute_tries_the_movement_configs_and_each_bulk_copy_grid() {
        let (moves, all) = (movement_candidates(), permute_candidates());
        assert_eq!(&all[..moves.len()], &moves[..]);
        let bulk: Vec<(u32, u32)> = all[moves.len()..]
            .iter()
            .inspect(|c| assert_eq!((c.threads, c.per_warp, c.held), (BULK_THREADS, false, 0)))
            .map(|c| (c.stages, c.waves))
            .collect();
        let want: Vec<(u32, u32)> = BULK_STAGES
            .iter()
            .flat_map(|&s| [0, 4, 8, 16].map(|w| (s, w)))
            .collect();
        assert_eq!(bulk, want);
        assert!(moves.iter().all(|c| c.stages == 0));
    }

    #[test]
    fn unpermute_tries_async_configs_only_where_rows_take_them_and_each_fits() {
        let moves = movement_candidates();
        assert_eq!(unpermute_candidates(false), moves);
        let all = unpermute_candidates(true);
        assert_eq!(&all[..moves.len()], &moves[..]);
        let extra: Vec<(u32, u32, u32)> = all[moves.len()..]
            .iter()
            .inspect(|c| assert_eq!((c.unroll, c.per_warp, c.held, c.split), (1, true, 0, 0)))
            .map(|c| (c.threads, c.stages, c.waves))
            .collect();
        // 64 threads: 16 and 24 KiB of stages; 128 threads: 32 KiB at two
        // stages, 48 KiB at three (over the limit, left out).
        let want = [(64, 2), (64, 3), (128, 2)];
        let want: Vec<(u32, u32, u32)> = want
            .iter()
            .flat_map(|&(t, s)| [0, 8].map(|w| (t, s, w)))
            .collect();
        assert_eq!(extra, want);
        assert_eq!(async_smem(64, 3), 24 * 1024);
        assert_eq!(async_smem(128, 2), 32 * 1024);
        assert_eq!(async_smem(128, 3), 48 * 1024);
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
    fn a_warp_per_row_config_takes_threads_over_32_rows_per_block() {
        let c = |threads, per_warp| Config {
            threads,
            unroll: 1,
            waves: 0,
            per_warp,
            held: 0,
            stages: 0,
            split: 0,
        };
        assert_eq!(c(256, true).rows_per_block(), 8);
        assert_eq!(c(256, false).rows_per_block(), 1);
        assert_eq!(c(256, true).infix(), "w_");
        assert_eq!(c(256, false).infix(), "");
        // No device is asked for the SM count with waves 0.
        assert_eq!(grid_for(Device::cuda(7), 1001, c(128, true)).unwrap(), 251);
        assert_eq!(
            grid_for(Device::cuda(7), 1001, c(128, false)).unwrap(),
            1001
        );
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

    #[test]
    fn backward_candidates_keep_256_dot_slots_per_token() {
        let c = backward_candidates();
        assert_eq!(c.len(), 30);
        for k in &c {
            if k.per_warp {
                assert_eq!(k.unroll, 8, "{k:?}");
                assert!(k.threads <= 256 && k.threads % 32 == 0, "{k:?}");
                assert!([0, 2, 4, 8].contains(&k.split), "{k:?}");
            } else if k.held > 0 {
                // One dot slot per thread; `unroll` routes per batch.
                assert_eq!((k.threads, k.waves), (256, 0), "{k:?}");
                assert!(HELD.contains(&(k.held, k.unroll)), "{k:?}");
            } else {
                assert_eq!(k.threads * k.unroll, 256, "{k:?}");
            }
            if !k.per_warp {
                assert_eq!(k.split, 0, "{k:?}");
            }
        }
        // Each split in blocks of 4 and 8 warps, with a warp for each share
        // of a token (waves 0) and with 8 blocks per multiprocessor.
        for split in [2, 4, 8] {
            let n = c.iter().filter(|k| k.split == split).count();
            assert_eq!(n, 4, "split {split}");
        }
        assert_eq!(movement_candidates().len(), 54);
    }

    /// Configs told apart by their thread count.
    fn c(threads: u32) -> Config {
        Config {
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
    fn a_held_row_is_whole_16_byte_groups_at_most_256_per_held() {
        let c = |held| Config {
            threads: 256,
            unroll: 1,
            waves: 0,
            per_warp: false,
            held,
            stages: 0,
            split: 0,
        };
        // 256 x 4 groups of 16 bytes: 16384 bytes.
        assert!(held_fits(c(4), 16, 16384));
        assert!(!held_fits(c(4), 16, 16384 + 16));
        assert!(held_fits(c(8), 16, 16384 + 16));
        assert!(held_fits(c(8), 16, 32768));
        assert!(!held_fits(c(8), 16, 32768 + 16));
        assert!(held_fits(c(4), 16, 16));
        // Vectors narrower than 16 bytes (an unaligned address), or a row
        // with a partial group, are not held.
        assert!(!held_fits(c(4), 8, 1024));
        assert!(!held_fits(c(4), 16, 1000));
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
