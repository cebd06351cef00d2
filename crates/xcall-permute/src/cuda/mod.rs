//! The CUDA path: kernels from `kernels.cu`, compiled with NVRTC once per
//! device and module family, launched on the caller's stream.
//!
//! Autotuning: movement and arithmetic kernels have a launch config
//! (threads per block, vectors in flight per thread, blocks per SM, and
//! whether a block takes one token or each warp its own). The first call
//! per (device, kernel, dtype, vector width, row-size class, routes-per-
//! token class, token-count octave) with autotuning on and a stream that
//! is not capturing runs every candidate once, then times all of them in
//! two passes on scratch outputs (stream-ordered allocations freed right
//! after; nothing the caller can see is written), times the four fastest
//! again in five interleaved passes, and caches the config with the
//! fastest median for the device (the stream is waited on twice: after
//! each round of passes). A candidate the compiled kernel cannot launch
//! with (more threads than its registers allow) is left out. Under
//! capture, or with autotuning off, the cached config or the default is
//! used. Every config computes the same bits (the summation order never
//! depends on the config).
//!
//! permute has a second kind of candidate on sm_90 and newer, where the
//! row and every address are in 16-byte units and a token has three or
//! more routes on average: the bulk-copy kernels
//! (`permute_bulk_4`, `_8`; [`LaunchConfig::stages`]), which move rows through
//! shared memory with `cp.async.bulk` loads and one bulk store per route,
//! so no thread moves row data. A row is moved in pieces of at most
//! 40 KiB / stages (see `config::bulk_piece`).
//!
//! unpermute has a second kind too, where rows and addresses are 16-byte
//! vectors and a token has three or more routes on average: the async
//! kernels (`unpermute_a2_w_16_1`, `_a3_`; [`LaunchConfig::stages`]). A warp per
//! token copies its routes' vectors into shared memory with `cp.async`
//! (no registers held while in flight), a chunk of 32 vectors of up to
//! eight routes per stage, and sums one stage while the next lands.
//! Tokens with more than eight routes take the register path.
//!
//! `catalogue` lists the kernels, `module` builds, loads and launches
//! them, `config` holds the launch configs a tunable kernel may take and
//! `tune` picks one; the ops below check device memory, launch and never
//! return to the caller's modules.

mod catalogue;
mod config;
mod module;
mod params;
mod tune;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use xcall_core::{DeviceMap, Fp8, KernelCache};

use crate::args::{
    MakeChunkSortMapArgs, MakeRowIdMapArgs, PermuteArgs, SortChunksArgs, Target, Tensor,
    UnpermuteArgs, UnpermuteBackwardArgs,
};
use crate::check::{Checked, Dims};
use crate::chunks::{self, Direction};
use crate::error::PermuteError;
use catalogue::{Family, Kernel, UnpermutePath, BWD_WARP_SLOTS, SUMMING};
use config::{async_smem, bulk_piece, default_config, grid_for, held_fits, BULK_THREADS};
pub use config::{
    backward_candidates, movement_candidates, permute_candidates, unpermute_candidates,
    LaunchConfig,
};
use module::{
    capturing, check_device_memory, check_map_on_device, check_segments_reachable, launch,
    read_back, resident_blocks, Loaded, SMEM_LIMIT,
};
pub(crate) use module::{copy_of, take_faults};
use params::{
    segment_bases, ChunkMapParams, PermuteParams, RowIdMapParams, SortParams, UnpermuteParams,
};
use tune::{arith_width, choose, routes_class, row_class, tokens_class, width, TuneKey};
pub use tune::{cached_configs, set_after_tuning_hook, with_configs, TuningHook};

type Result<T> = std::result::Result<T, PermuteError>;

#[derive(Default)]
struct State {
    kernels: KernelCache,
    /// Loaded kernels (an arithmetic kernel's dtype tells its module: the
    /// arithmetic families share kernel names).
    functions: DeviceMap<Mutex<HashMap<Kernel, Arc<Loaded>>>>,
    tuned: DeviceMap<Mutex<HashMap<TuneKey, LaunchConfig>>>,
    /// What the launches need to know of each device.
    devices: DeviceMap<DeviceFacts>,
    /// The address of each loaded module's map fault word
    /// (`xcall_map_faults` in `kernels.cu`).
    fault_words: DeviceMap<Mutex<HashMap<Family, u64>>>,
}

/// What the launches need to know of a device.
struct DeviceFacts {
    multiprocessors: u64,
    /// It runs the bulk-copy kernels: `cp.async.bulk` and its mbarrier
    /// completion need sm_90 or newer (the modules compile for the
    /// device's own architecture).
    bulk_copies: bool,
}

/// `device`'s facts, asked of the driver once.
fn device_facts(device: xcall_core::Device) -> Result<&'static DeviceFacts> {
    Ok(state().devices.get_or_try_init(device, || {
        xcall_core::cuda::device_info(device).map(|i| DeviceFacts {
            multiprocessors: i.multiprocessors as u64,
            bulk_copies: i.compute_capability.0 >= 9,
        })
    })?)
}

/// Test hook: the kernels loaded on `device` so far, by name (sorted, each
/// once), so a test can tell that a forced config ran its own kernel.
#[doc(hidden)]
pub fn loaded_kernels(device: xcall_core::Device) -> Vec<String> {
    let mut names: Vec<String> = state().functions.get(device).map_or_else(Vec::new, |slot| {
        let map = slot.lock().unwrap_or_else(|p| p.into_inner());
        map.keys().map(|k| k.name()).collect()
    });
    names.sort();
    names.dedup();
    names
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(State::default)
}

fn opt(t: &Option<Tensor>) -> u64 {
    t.as_ref().map_or(0, |t| t.address)
}

fn opt_bytes(t: &Option<Tensor>) -> u64 {
    t.as_ref().map_or(0, Tensor::bytes)
}

/// See [`crate::call::make_row_id_map`]. Deterministic: three passes over
/// blocks of tokens, block prefix sums, no atomics.
pub(crate) unsafe fn make_row_id_map(
    target: &Target,
    c: &Checked<'_, MakeRowIdMapArgs>,
) -> Result<()> {
    let (a, d) = (c.args(), c.dims());
    check_device_memory(target, a)?;
    let (t, e) = (d.tokens, d.experts);
    if t > i32::MAX as usize {
        return Err(PermuteError::Unsupported(format!(
            "{t} tokens: the CUDA row-id map supports up to 2^31 - 1"
        )));
    }
    let max_experts = SMEM_LIMIT / 9;
    if e > max_experts {
        return Err(PermuteError::Unsupported(format!(
            "{e} experts: the CUDA row-id map supports up to {max_experts}"
        )));
    }
    // Small blocks of tokens for parallelism (about 512 blocks), at most
    // what shared memory holds.
    let tb = ((SMEM_LIMIT - 8 * e) / e).min(t.div_ceil(512).clamp(8, 128));
    let nblocks = t.div_ceil(tb) as u64;
    let p = RowIdMapParams {
        routing: a.routing.address,
        map: a.row_id_map.address,
        tpe: a.tokens_per_expert.address,
        offsets: a.expert_offsets.address,
        tokens: t as i64,
        experts: e as i64,
        block_tokens: tb as i64,
        blocks: nblocks as i64,
        align: a.options.align.unwrap_or(1) as i64,
        cap: a.options.num_out_tokens.map_or(i64::MAX, |c| c as i64),
        capacity: a.options.capacity.map_or(0, |c| c as i64),
        group_experts: a.options.groups.map_or(e, |g| g.experts) as i64,
        group_rows: a.options.groups.map_or(0, |g| g.rows) as i64,
    };
    let groups = a.options.groups.map_or(1, |g| e / g.experts) as u64;
    launch(target, Kernel::RimCount, nblocks, 256, tb * e, &p)?;
    launch(target, Kernel::RimScanBlocks, e as u64, 256, 0, &p)?;
    launch(target, Kernel::RimOffsets, groups, 1024, 0, &p)?;
    launch(target, Kernel::RimWrite, nblocks, 256, 8 * e + tb * e, &p)
}

/// The [`PermuteParams`] fields that place the outputs `out`, `pprobs` and
/// `pscales` (0 for an absent one): all the zero fill reads, and what
/// `permute` adds its inputs to.
fn permute_outputs(
    (out, pprobs, pscales): (u64, u64, u64),
    (tokens_per_expert, expert_offsets): (&Tensor, &Tensor),
    d: Dims,
    row: u64,
) -> PermuteParams {
    PermuteParams {
        out,
        pprobs,
        pscales,
        tpe: tokens_per_expert.address,
        offsets: expert_offsets.address,
        experts: d.experts as i64,
        out_rows: d.out_rows as i64,
        row: row as i64,
        nscales: d.scales as i64,
        ..PermuteParams::default()
    }
}

/// Zeroes the rows of the outputs of `p` that no route writes: each expert
/// chunk's padding and the rows past the last chunk (`p.nscales` values per
/// row of scales).
fn zero_unwritten(target: &Target, p: &PermuteParams) -> Result<()> {
    let width = width(p.row as u64, &[p.out]);
    launch(
        target,
        Kernel::Zero { width },
        p.experts as u64 + 1,
        256,
        0,
        p,
    )
}

/// See [`crate::call::permute`].
pub(crate) unsafe fn permute(target: &Target, c: &Checked<'_, PermuteArgs>) -> Result<()> {
    let (a, d) = (c.args(), c.dims());
    check_device_memory(target, a)?;
    let segs = a.output_segments.as_ref();
    if let Some(s) = segs {
        check_segments_reachable(target, "output", s, a.output.bytes() / s.bases.len() as u64)?;
    }
    check_map_on_device(
        target,
        &a.row_id_map,
        Some((&a.tokens_per_expert, &a.expert_offsets)),
        d,
    )?;
    let row = (d.hidden * a.input.dtype.size_bytes()) as u64;
    let dev = target.device;
    let outputs = permute_outputs(
        (
            a.output.address,
            opt(&a.permuted_probs),
            opt(&a.permuted_scales),
        ),
        (&a.tokens_per_expert, &a.expert_offsets),
        d,
        row,
    );
    if d.tokens == 0 || (row == 0 && d.scales == 0 && a.probs.is_none()) {
        // A segmented output keeps the rows no route writes.
        return match segs {
            Some(_) => Ok(()),
            None => zero_unwritten(target, &outputs),
        };
    }
    // The permute kernels zero the unwritten rows themselves (one launch).
    let mut addresses = vec![a.input.address, a.output.address];
    addresses.extend(segs.map_or(&[][..], |s| &s.bases));
    let v = width(row, &addresses);
    let bulk = v == 16 && row > 0 && device_facts(dev)?.bulk_copies;
    let default = default_config(row / v as u64);
    let run = |c: LaunchConfig, outs: &[u64]| -> Result<()> {
        // A bulk-copy config where the row or device cannot take it (only
        // ever forced) runs the default one.
        let c = if c.stages > 0 && !bulk { default } else { c };
        // Autotuning runs on dense scratch outputs; only the call's own
        // output is segmented.
        let (seg_rows, bases) = match segs {
            Some(s) if outs[0] == a.output.address => (s.rows as i64, segment_bases(&s.bases)),
            _ => (0, segment_bases(&[])),
        };
        let params = PermuteParams {
            input: a.input.address,
            map: a.row_id_map.address,
            probs: opt(&a.probs),
            scales: opt(&a.scales),
            out: outs[0],
            pprobs: outs[1],
            pscales: outs[2],
            tokens: d.tokens as i64,
            seg_rows,
            segs: bases,
            ..outputs
        };
        if c.stages > 0 {
            let piece = bulk_piece(row, c.stages);
            let items = (d.tokens as u64)
                .checked_mul(row.div_ceil(piece))
                .ok_or_else(|| crate::error::shape("permute: tokens x row pieces overflow"))?;
            let kernel = Kernel::PermuteBulk { stages: c.stages };
            let smem = (c.stages as u64 * piece) as usize;
            // waves 0: as many blocks as fit the multiprocessors at once.
            let waves = match c.waves {
                0 => resident_blocks(dev, kernel, BULK_THREADS, smem)?,
                w => w,
            };
            return launch(
                target,
                kernel,
                grid_for(dev, items as usize, LaunchConfig { waves, ..c })?,
                BULK_THREADS,
                smem,
                &PermuteParams {
                    piece: piece as i64,
                    ..params
                },
            );
        }
        launch(
            target,
            Kernel::Permute(c.lanes(v)),
            grid_for(dev, d.tokens, c)?,
            c.threads,
            0,
            &params,
        )
    };
    let config = choose(
        target,
        TuneKey::routed("permute", 0, v, row, &d),
        default,
        // The bulk copies pay off where a loaded row feeds several stores:
        // at one or two routes per token their picks replayed slower than
        // the register kernels' on the H200 grid (see docs/lab/).
        &if bulk && routes_class(d.tokens, d.out_rows) >= 2 {
            permute_candidates()
        } else {
            movement_candidates()
        },
        &[
            a.output.bytes(),
            opt_bytes(&a.permuted_probs),
            opt_bytes(&a.permuted_scales),
        ],
        &run,
    )?;
    run(
        config,
        &[
            a.output.address,
            opt(&a.permuted_probs),
            opt(&a.permuted_scales),
        ],
    )
}

/// See [`crate::call::unpermute`].
pub(crate) unsafe fn unpermute(target: &Target, c: &Checked<'_, UnpermuteArgs>) -> Result<()> {
    let (a, d) = (c.args(), c.dims());
    check_device_memory(target, a)?;
    let segs = a.input_segments.as_ref();
    if let Some(s) = segs {
        check_segments_reachable(target, "input", s, a.input.bytes() / s.bases.len() as u64)?;
    }
    check_map_on_device(target, &a.row_id_map, None, d)?;
    if d.tokens == 0 {
        return Ok(());
    }
    let dtype = a.input.dtype;
    let row = (d.hidden * dtype.size_bytes()) as u64;
    let mut addresses = vec![a.input.address, a.output.address];
    addresses.extend(segs.map_or(&[][..], |s| &s.bases));
    let v = arith_width(dtype, row, &addresses);
    let (seg_rows, bases) = match segs {
        Some(s) => (s.rows as i64, segment_bases(&s.bases)),
        None => (0, segment_bases(&[])),
    };
    let dev = target.device;
    // fp8 without probs, at most one (two) routes per token on average:
    // the kernels that copy a lone route's row as bytes (mapped as 0 + x
    // stores it) rather than converting it (and sum two routes in f16
    // rather than in f32).
    // fp8 at three or more: the summing kernels with streaming loads.
    // Other types, three or more routes per token on average and whole
    // 16-byte vectors: the kernels that load two routes ahead of adding.
    let routes = routes_class(d.tokens, d.out_rows) as usize;
    let path = match Fp8::of(dtype) {
        Some(_) if v % 4 == 0 && a.merging_probs.is_none() => match routes {
            0 => UnpermutePath::few(1),
            1 => UnpermutePath::few(2),
            _ => UnpermutePath::STREAM,
        },
        None if v == 16 && routes >= 2 => UnpermutePath::LOADS2,
        _ => SUMMING,
    };
    let default = default_config(row / v as u64);
    let run = |c: LaunchConfig, outs: &[u64]| -> Result<()> {
        // An async config where the row cannot take it (only ever forced)
        // runs the default one.
        let c = if c.stages > 0 && v != 16 { default } else { c };
        let (lanes, path, smem) = match c.stages {
            0 => (c.lanes(v), path, 0),
            s => (
                LaunchConfig {
                    unroll: 1,
                    per_warp: true,
                    ..c
                }
                .lanes(16),
                UnpermutePath::async_stages(s),
                async_smem(c.threads, s) as usize,
            ),
        };
        launch(
            target,
            Kernel::Unpermute { dtype, lanes, path },
            grid_for(dev, d.tokens, c)?,
            c.threads,
            smem,
            &UnpermuteParams {
                input: a.input.address,
                fwd: 0,
                map: a.row_id_map.address,
                mprobs: opt(&a.merging_probs),
                pprobs: opt(&a.permuted_probs),
                out: outs[0],
                oprobs: outs[1],
                tokens: d.tokens as i64,
                experts: d.experts as i64,
                hidden: d.hidden as i64,
                out_rows: d.out_rows as i64,
                seg_rows,
                split: 0,
                segs: bases,
            },
        )
    };
    let config = choose(
        target,
        TuneKey::routed("unpermute", dtype as u32, v, row, &d),
        default,
        // The async kernels pay where a token has several routes to
        // keep in flight: at one or two routes per token on average they
        // replayed slower on the H200 grid (see docs/lab/).
        &unpermute_candidates(v == 16 && routes >= 2),
        &[a.output.bytes(), opt_bytes(&a.unpermuted_probs)],
        &run,
    )?;
    run(config, &[a.output.address, opt(&a.unpermuted_probs)])
}

/// See [`crate::call::unpermute_backward`].
pub(crate) unsafe fn unpermute_backward(
    target: &Target,
    c: &Checked<'_, UnpermuteBackwardArgs>,
) -> Result<()> {
    let (a, d) = (c.args(), c.dims());
    check_device_memory(target, a)?;
    check_map_on_device(
        target,
        &a.row_id_map,
        Some((&a.tokens_per_expert, &a.expert_offsets)),
        d,
    )?;
    let dtype = a.grad.dtype;
    let row = (d.hidden * dtype.size_bytes()) as u64;
    let dev = target.device;
    let no_scales = Dims { scales: 0, ..d };
    zero_unwritten(
        target,
        &permute_outputs(
            (a.act_grad.address, 0, 0),
            (&a.tokens_per_expert, &a.expert_offsets),
            no_scales,
            row,
        ),
    )?;
    if d.tokens == 0 {
        return Ok(());
    }
    let v = arith_width(
        dtype,
        row,
        &[a.grad.address, a.fwd_input.address, a.act_grad.address],
    );
    let run = |c: LaunchConfig, outs: &[u64]| -> Result<()> {
        let kernel = match c.held {
            0 if c.per_warp && c.unroll == BWD_WARP_SLOTS => {
                Kernel::UnpermuteBwdWarp { dtype, width: v }
            }
            0 if c.per_warp => {
                return Err(PermuteError::Unsupported(format!(
                    "{c:?}: the warp-per-token backward holds {BWD_WARP_SLOTS} dot slots per thread"
                )))
            }
            0 => Kernel::UnpermuteBwd {
                dtype,
                width: v,
                unroll: c.unroll,
            },
            _ if held_fits(c, v, row) => Kernel::UnpermuteBwdHeld {
                dtype,
                held: c.held,
                routes: c.unroll,
            },
            _ => {
                return Err(PermuteError::Unsupported(format!(
                    "{c:?} holds rows of at most {} 16-byte groups; this row is {row} bytes in {v}-byte vectors",
                    256 * c.held
                )))
            }
        };
        // A split config's warps: `split` per token.
        let warps = d.tokens.saturating_mul(c.split.max(1) as usize);
        launch(
            target,
            kernel,
            grid_for(dev, warps, c)?,
            c.threads,
            0,
            &UnpermuteParams {
                input: a.grad.address,
                fwd: a.fwd_input.address,
                map: a.row_id_map.address,
                mprobs: a.merging_probs.address,
                pprobs: 0,
                out: outs[0],
                oprobs: outs[1],
                tokens: d.tokens as i64,
                experts: d.experts as i64,
                hidden: d.hidden as i64,
                out_rows: d.out_rows as i64,
                split: c.split as i64,
                ..UnpermuteParams::default()
            },
        )
    };
    let default = LaunchConfig {
        threads: 128,
        unroll: 2,
        waves: 0,
        per_warp: false,
        held: 0,
        stages: 0,
        split: 0,
    };
    let config = choose(
        target,
        TuneKey::routed("unpermute_backward", dtype as u32, v, row, &d),
        default,
        &backward_candidates(),
        &[a.act_grad.bytes(), a.probs_grad.bytes()],
        &run,
    )?;
    let outs = [a.act_grad.address, a.probs_grad.address];
    match run(config, &outs) {
        // A row-holding config chosen for a row it holds (16 KiB) and
        // given a wider row of the same class (20 KiB) launched nothing:
        // the default config takes the row.
        Err(PermuteError::Unsupported(_)) if config.held > 0 => run(default, &outs),
        r => r,
    }
}

/// Largest chunk count the CUDA chunk map holds in shared memory (two
/// 8-byte starts and a seen bit per chunk, with room to spare for the
/// scan's static shared memory).
pub const MAX_CUDA_CHUNKS: usize = (SMEM_LIMIT - 8) / 17;

/// See [`crate::call::make_chunk_sort_map`].
pub(crate) unsafe fn make_chunk_sort_map(
    target: &Target,
    c: &Checked<'_, MakeChunkSortMapArgs>,
) -> Result<()> {
    let (a, tokens) = (c.args(), c.dims().tokens);
    check_device_memory(target, a)?;
    let s = a.split_sizes.dims[0] as usize;
    if s > MAX_CUDA_CHUNKS {
        return Err(PermuteError::Unsupported(format!(
            "{s} chunks: the CUDA chunk map supports up to {MAX_CUDA_CHUNKS}"
        )));
    }
    if !capturing(target)? {
        // Read the split back and check it on the Host for a clear error.
        let mut sizes = vec![0i64; s];
        let mut sorted = vec![0i64; s];
        read_back(
            target,
            &mut [
                (&mut sizes[..], a.split_sizes.address),
                (&mut sorted[..], a.sorted_indices.address),
            ],
            |_| Ok(()),
        )?;
        chunks::check_split(&sizes, &sorted, tokens)?;
    }
    launch(
        target,
        Kernel::ChunkMap,
        (tokens as u64).div_ceil(256).clamp(1, 1 << 16),
        256,
        (2 * s + 1) * 8 + 4 * s.div_ceil(32),
        &ChunkMapParams {
            sizes: a.split_sizes.address,
            sorted: a.sorted_indices.address,
            map: a.map.address,
            chunks: s as i64,
            tokens: tokens as i64,
        },
    )
}

/// See [`crate::call::sort_chunks_by_map`].
pub(crate) unsafe fn sort_chunks_by_map(
    target: &Target,
    c: &Checked<'_, SortChunksArgs>,
) -> Result<()> {
    let (a, d) = (c.args(), c.dims());
    check_device_memory(target, a)?;
    let row = (d.hidden * a.input.dtype.size_bytes()) as u64;
    if d.tokens == 0 {
        return Ok(());
    }
    let v = width(row, &[a.input.address, a.output.address]);
    let dev = target.device;
    let backward = matches!(a.direction, Direction::Backward) as i64;
    let run = |c: LaunchConfig, outs: &[u64]| -> Result<()> {
        launch(
            target,
            Kernel::Sort(c.lanes(v)),
            grid_for(dev, d.tokens, c)?,
            c.threads,
            0,
            &SortParams {
                input: a.input.address,
                map: a.map.address,
                probs: opt(&a.probs),
                out: outs[0],
                pprobs: outs[1],
                tokens: d.tokens as i64,
                row: row as i64,
                backward,
            },
        )
    };
    let config = choose(
        target,
        TuneKey {
            kernel: "sort_chunks",
            dtype: 0,
            width: v,
            row: row_class(row),
            routes: 0,
            tokens: tokens_class(d.tokens),
            experts: 0,
        },
        default_config(row / v as u64),
        &movement_candidates(),
        &[a.output.bytes(), opt_bytes(&a.permuted_probs)],
        &run,
    )?;
    run(config, &[a.output.address, opt(&a.permuted_probs)])
}
