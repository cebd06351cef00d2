//! The steps of a call on Host PEs: the same steps, in the same order and
//! with the same arithmetic, as the CUDA kernels (`kernels.cu`), so a
//! Host run is the reference a CUDA run is compared with bit for bit
//! (the probs' gradient, a dot product summed in another order there,
//! aside). Peers' memory is read through the group's base table, as on
//! CUDA; announcements are release stores and waits acquire loads. PEs
//! of one process pull some of these steps' rows instead
//! ([`crate::host_pull`]).
//!
//! Every function takes the call's [`EpParams`]; its safety contract is
//! the group's: the allocation at `base` (and each peer's at `bases[q]`)
//! is the group's layout for these parameters, the caller's buffers hold
//! what the call checked they hold, and the phase protocol (see
//! [`crate::group`]) keeps anyone from writing what a step reads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use half::bf16;
use xcall_core::{fp8_decode, fp8_encode, Fp8};

use crate::config::{word, FP8_BLOCK, TILE_TOKENS};
use crate::error::{EpError, Result};
use crate::fp8::{fp8_divide_by, fp8_scale};
use crate::host_sum::{par_tokens, sum_rows};
use crate::params::EpParams;

pub(crate) fn at<T>(base: u64, offset: i64) -> *mut T {
    (base + offset as u64) as *mut T
}

/// A word of the group's words part.
///
/// # Safety
/// `base` is a group allocation of `p`'s layout.
pub(crate) unsafe fn word_of<'a>(p: &EpParams, base: u64, w: usize) -> &'a AtomicU64 {
    // SAFETY: the words part holds word::COUNT aligned u64s at every PE's
    // allocation; atomics because peers read them concurrently.
    unsafe { AtomicU64::from_ptr(at::<u64>(base, p.off_words).add(w)) }
}

/// PE `q`'s allocation as this PE reaches it.
///
/// # Safety
/// `p.bases` holds `p.pes` addresses.
pub(crate) unsafe fn base_of(p: &EpParams, q: usize) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { *(p.bases as *const u64).add(q) }
}

/// Element `i` of a row of `precision`'s element type, as f32.
pub(crate) fn load(precision: i64, row: *const u8, i: usize) -> f32 {
    // SAFETY: callers pass rows of at least `i + 1` elements.
    unsafe {
        match precision {
            0 => (row as *const f32).add(i).read_unaligned(),
            _ => bf16::from_bits((row as *const u16).add(i).read_unaligned()).to_f32(),
        }
    }
}

/// Stores `v` rounded to `precision`'s element type (bf16: nearest even).
pub(crate) fn store(precision: i64, row: *mut u8, i: usize, v: f32) {
    // SAFETY: callers pass rows of at least `i + 1` elements.
    unsafe {
        match precision {
            0 => (row as *mut f32).add(i).write_unaligned(v),
            _ => (row as *mut u16)
                .add(i)
                .write_unaligned(bf16::from_f32(v).to_bits()),
        }
    }
}

/// Publishes what peers read of this PE: for FP8 dispatch (`wire`) its
/// `n` rows of `src` quantized into `send`, for `combine_backward` (not
/// `wire`) the rows themselves, and with `src_ids` its routing, each id
/// outside `-1..E` or repeated within its token replaced by -1. Returns
/// how many ids were replaced.
///
/// # Safety
/// See the module docs.
pub unsafe fn publish(p: &EpParams, wire: bool) -> usize {
    let (h, n) = (p.hidden as usize, p.n as usize);
    let fp8 = wire && p.precision == 2;
    let elem = if p.precision == 0 { 4 } else { 2 };
    let send = at::<u8>(p.base, p.off_send);
    // Dispatch pushes f32 and bf16 rows from the caller's buffer: no copy;
    // nor for rows the caller wrote into the send buffer itself.
    let rows = fp8 || (!wire && p.src != send as u64);
    for t in (0..n).filter(|_| rows) {
        let row = (p.src as *const u8).wrapping_add(t * h * elem);
        if fp8 {
            let scales = at::<f32>(p.base, p.off_send_scales);
            for b in 0..h / FP8_BLOCK {
                let amax = (0..FP8_BLOCK)
                    .map(|i| load(1, row, b * FP8_BLOCK + i).abs())
                    .fold(0.0f32, f32::max);
                let scale = fp8_scale(amax);
                let divide = fp8_divide_by(scale);
                // SAFETY: send holds [T, H] bytes, scales [T, H/128].
                unsafe {
                    *scales.add(t * (h / FP8_BLOCK) + b) = scale;
                    for i in 0..FP8_BLOCK {
                        let e = b * FP8_BLOCK + i;
                        *send.add(t * h + e) = fp8_encode(Fp8::E4M3, divide(load(1, row, e)));
                    }
                }
            }
        } else {
            // SAFETY: `src` holds n rows, send T >= n rows of H*elem bytes.
            unsafe { std::ptr::copy_nonoverlapping(row, send.add(t * h * elem), h * elem) };
        }
    }
    let mut replaced = 0;
    if p.src_ids != 0 {
        let k = p.topk as usize;
        let ids = at::<i32>(p.base, p.off_ids);
        let probs = at::<f32>(p.base, p.off_probs);
        for t in 0..n {
            for j in 0..k {
                // SAFETY: src_ids/src_probs hold [n, k], ids/probs [T, k].
                unsafe {
                    let id = *(p.src_ids as *const i32).add(t * k + j);
                    let repeated = (0..j).any(|i| *(p.src_ids as *const i32).add(t * k + i) == id);
                    let ok = id == -1 || (id >= 0 && (id as i64) < p.experts && !repeated);
                    replaced += usize::from(!ok);
                    *ids.add(t * k + j) = if ok { id } else { -1 };
                    *probs.add(t * k + j) = *(p.src_probs as *const f32).add(t * k + j);
                }
            }
        }
        // SAFETY: see the module docs.
        unsafe { word_of(p, p.base, word::TOKENS) }.store(n as u64, Ordering::Relaxed);
    }
    replaced
}

/// Dispatch's exchange step: each of this PE's tokens stored once into the
/// receive rows (FP8: and scales) of each other PE hosting one of its
/// experts.
///
/// # Safety
/// See the module docs.
pub unsafe fn push(p: &EpParams) {
    let (t_max, h) = (p.tokens as usize, p.hidden as usize);
    let fp8 = p.precision == 2;
    let wire_row = if fp8 {
        h
    } else {
        h * if p.precision == 0 { 4 } else { 2 }
    };
    let blocks = h / FP8_BLOCK;
    let me = p.rank as usize;
    let src = if fp8 {
        at::<u8>(p.base, p.off_send) as usize
    } else {
        p.src as usize
    };
    par_tokens(p.n as usize, |tokens| {
        for t in tokens {
            // SAFETY: see the module docs.
            let mask = unsafe { destinations(p, t) } & !(1u64 << me);
            for q in (0..p.pes as usize).filter(|q| mask >> q & 1 == 1) {
                // SAFETY: `src` holds n rows; PE q's receive rows [P, T]
                // (and scales), of which row (me, t) only this PE writes,
                // this token's task alone.
                unsafe {
                    let bq = base_of(p, q);
                    std::ptr::copy_nonoverlapping(
                        (src as *const u8).add(t * wire_row),
                        at::<u8>(bq, p.off_recv).add((me * t_max + t) * wire_row),
                        wire_row,
                    );
                    if fp8 {
                        std::ptr::copy_nonoverlapping(
                            at::<f32>(p.base, p.off_send_scales).add(t * blocks),
                            at::<f32>(bq, p.off_recv_scales).add((me * t_max + t) * blocks),
                            blocks,
                        );
                    }
                }
            }
        }
    });
}

/// Announces a new phase to every PE (after everything this PE wrote
/// before it).
///
/// # Safety
/// See the module docs.
pub unsafe fn signal(p: &EpParams) {
    // SAFETY: see the module docs.
    let epoch = unsafe { word_of(p, p.base, word::EPOCH) }.fetch_add(1, Ordering::Relaxed) + 1;
    for q in 0..p.pes as usize {
        // SAFETY: PE q's ready words, one per PE; this PE writes only its own.
        let ready = unsafe {
            AtomicU64::from_ptr(at::<u64>(base_of(p, q), p.off_ready).add(p.rank as usize))
        };
        ready.store(epoch, Ordering::Release);
        crate::sleep::wake(ready);
    }
}

/// Waits until every PE announced this PE's current phase.
///
/// # Safety
/// See the module docs.
pub unsafe fn wait(p: &EpParams) -> Result<()> {
    // SAFETY: see the module docs.
    let epoch = unsafe { word_of(p, p.base, word::EPOCH) }.load(Ordering::Relaxed);
    let timeout = Duration::from_nanos(p.timeout_ns);
    let started = Instant::now();
    for s in 0..p.pes as usize {
        // SAFETY: this PE's ready words.
        let ready = unsafe { AtomicU64::from_ptr(at::<u64>(p.base, p.off_ready).add(s)) };
        let mut spins = 0u32;
        loop {
            let seen = ready.load(Ordering::Acquire);
            if seen >= epoch {
                break;
            }
            if started.elapsed() > timeout {
                return Err(EpError::Timeout(format!(
                    "PE {} waited {timeout:?} for PE {s} to reach phase {epoch}",
                    p.rank
                )));
            }
            // Spin briefly, then sleep until PE s announces: PEs may
            // outnumber the cores, and a PE spinning or yielding would
            // take turns from the one it waits for.
            spins += 1;
            if spins > 64 {
                crate::sleep::sleep_while(ready, seen, crate::sleep::NAP);
            } else {
                std::hint::spin_loop();
            }
        }
    }
    Ok(())
}

/// The first layout pass: each sender's routing, read once, kept here as
/// local expert numbers and probs, and each tile's routes per local
/// expert counted.
///
/// # Safety
/// See the module docs.
pub unsafe fn count(p: &EpParams) {
    let (t_max, k, l) = (p.tokens as usize, p.topk as usize, p.local_experts as usize);
    let local = at::<i32>(p.base, p.off_local);
    let probs = at::<f32>(p.base, p.off_recv_probs);
    let counts = at::<i32>(p.base, p.off_tile_counts);
    let sent = at::<i32>(p.base, p.off_sent);
    for s in 0..p.pes as usize {
        // SAFETY: see the module docs (the sender's words, ids and probs
        // are stable from its announcement until this PE's next one).
        let bs = unsafe { base_of(p, s) };
        // SAFETY: as above.
        let published = unsafe { word_of(p, bs, word::TOKENS) }.load(Ordering::Relaxed);
        let n = (published as usize).min(t_max);
        // SAFETY: sent holds P i32.
        unsafe { *sent.add(s) = n as i32 };
        for tile in 0..p.tiles_per_pe as usize {
            let row = s * p.tiles_per_pe as usize + tile;
            // SAFETY: tile_counts holds [tiles, L].
            let c = unsafe { std::slice::from_raw_parts_mut(counts.add(row * l), l) };
            c.fill(0);
            for t in tile * TILE_TOKENS..((tile + 1) * TILE_TOKENS).min(t_max) {
                for j in 0..k {
                    let r = (s * t_max + t) * k + j;
                    // SAFETY: ids/probs hold [T, k] at the sender, local
                    // and recv_probs [P, T, k] here.
                    unsafe {
                        let id = if t < n {
                            *at::<i32>(bs, p.off_ids).add(t * k + j)
                        } else {
                            -1
                        };
                        let mine = id >= 0
                            && (id as i64) < p.experts
                            && id as i64 / p.local_experts == p.rank;
                        let loc = if mine {
                            (id as i64 % p.local_experts) as i32
                        } else {
                            -1
                        };
                        *local.add(r) = loc;
                        *probs.add(r) = if t < n {
                            *at::<f32>(bs, p.off_probs).add(t * k + j)
                        } else {
                            0.0
                        };
                        if loc >= 0 {
                            c[loc as usize] += 1;
                        }
                    }
                }
            }
        }
    }
}

/// The second layout pass: each tile's counts become its first rank per
/// expert; each expert's kept routes, padded rows and first row follow,
/// and the routes a capacity drops are added to the dropped counter.
///
/// # Safety
/// See the module docs.
pub unsafe fn scan(p: &EpParams) {
    let (l, tiles) = (p.local_experts as usize, (p.pes * p.tiles_per_pe) as usize);
    let counts = at::<i32>(p.base, p.off_tile_counts);
    let start = at::<i64>(p.base, p.off_expert_start);
    let mut next = 0i64;
    let mut dropped = 0u64;
    for e in 0..l {
        let mut run = 0i64;
        for tile in 0..tiles {
            // SAFETY: tile_counts holds [tiles, L].
            unsafe {
                let c = counts.add(tile * l + e);
                let v = *c as i64;
                *c = run as i32;
                run += v;
            }
        }
        let kept = if p.capacity > 0 {
            run.min(p.capacity)
        } else {
            run
        };
        dropped += (run - kept) as u64;
        let padded = (kept + p.align - 1) / p.align * p.align;
        // SAFETY: expert_start holds L i64; the caller's arrays L (L + 1).
        unsafe {
            *start.add(e) = next;
            *(p.tokens_per_expert as *mut i64).add(e) = kept;
            if p.padded_per_expert != 0 {
                *(p.padded_per_expert as *mut i64).add(e) = padded;
            }
            if p.expert_offsets != 0 {
                *(p.expert_offsets as *mut i64).add(e) = next;
            }
        }
        next += padded;
    }
    if p.expert_offsets != 0 {
        // SAFETY: as above.
        unsafe { *(p.expert_offsets as *mut i64).add(l) = next };
    }
    // SAFETY: see the module docs.
    unsafe { word_of(p, p.base, word::DROPPED) }.fetch_add(dropped, Ordering::Relaxed);
}

/// The third layout pass: each route's row, ranks taken in (sender,
/// token, slot) order; a route past its expert's capacity gets -1.
///
/// # Safety
/// See the module docs.
pub unsafe fn assign(p: &EpParams) {
    let (t_max, k, l) = (p.tokens as usize, p.topk as usize, p.local_experts as usize);
    let local = at::<i32>(p.base, p.off_local);
    let rows = at::<i32>(p.base, p.off_route_row);
    let counts = at::<i32>(p.base, p.off_tile_counts);
    let start = at::<i64>(p.base, p.off_expert_start);
    for s in 0..p.pes as usize {
        for tile in 0..p.tiles_per_pe as usize {
            let c = (s * p.tiles_per_pe as usize + tile) * l;
            for t in tile * TILE_TOKENS..((tile + 1) * TILE_TOKENS).min(t_max) {
                for j in 0..k {
                    let r = (s * t_max + t) * k + j;
                    // SAFETY: the layout's arrays, indices in range.
                    unsafe {
                        let loc = *local.add(r);
                        let mut row = -1;
                        if loc >= 0 {
                            let rank = counts.add(c + loc as usize);
                            let taken = *rank as i64;
                            *rank += 1;
                            if p.capacity == 0 || taken < p.capacity {
                                let at = *start.add(loc as usize) + taken;
                                row = if at < p.expert_rows { at as i32 } else { -1 };
                            }
                        }
                        *rows.add(r) = row;
                    }
                }
            }
        }
    }
}

/// Token `t` of sender `s`'s kept routes here: (slot, row), in slot
/// order.
///
/// # Safety
/// See the module docs.
#[inline(always)]
unsafe fn routes(p: &EpParams, s: usize, t: usize) -> impl Iterator<Item = (usize, i32)> + '_ {
    let k = p.topk as usize;
    let rows = at::<i32>(p.base, p.off_route_row).wrapping_add((s * p.tokens as usize + t) * k);
    // SAFETY: route_row holds [P, T, k].
    (0..k)
        .map(move |j| (j, unsafe { *rows.add(j) }))
        .filter(|&(_, r)| r >= 0)
}

/// Pushes onto `rows` token `t` of sender `s`'s kept routes in the layout
/// of the PE whose allocation is `base`: each route's row of `src` (that
/// PE's expert-major rows) and its weight (its prob, or 1 unless
/// `p.weighted`), in slot order.
///
/// # Safety
/// `base` is a group allocation of `p`'s layout whose route rows and
/// probs are stable, and `src` holds its `expert_rows` rows.
#[inline(always)]
pub(crate) unsafe fn weighted_rows(
    p: &EpParams,
    (base, src): (u64, u64),
    (s, t): (usize, usize),
    rows: &mut Vec<(*const u8, f32)>,
) {
    let k = p.topk as usize;
    let row_bytes = p.hidden as usize * if p.precision == 0 { 4 } else { 2 };
    let first = (s * p.tokens as usize + t) * k;
    let (route_row, probs) = (
        at::<i32>(base, p.off_route_row),
        at::<f32>(base, p.off_recv_probs),
    );
    for j in 0..k {
        // SAFETY: route_row and recv_probs hold [P, T, k].
        unsafe {
            let r = *route_row.add(first + j);
            if r >= 0 {
                let w = match p.weighted {
                    1 => *probs.add(first + j),
                    _ => 1.0,
                };
                rows.push(((src as *const u8).wrapping_add(r as usize * row_bytes), w));
            }
        }
    }
}

/// Whether token `t` of sender `s` has a route to one of this PE's
/// experts (kept or dropped).
///
/// # Safety
/// See the module docs.
#[inline(always)]
unsafe fn routed_here(p: &EpParams, s: usize, t: usize) -> bool {
    let k = p.topk as usize;
    let local = at::<i32>(p.base, p.off_local);
    // SAFETY: local holds [P, T, k].
    (0..k).any(|j| unsafe { *local.add((s * p.tokens as usize + t) * k + j) } >= 0)
}

/// Dispatch's expansion: each received token's row (pushed here, or this
/// PE's own) read once and written to each of its kept routes' rows.
/// With `pull` (PEs of one process, see [`crate::host_pull`]) peers'
/// rows are read where their senders published them instead: their `x`,
/// or (FP8) their send rows and scales.
///
/// # Safety
/// See the module docs; with `pull`, every PE offered its rows
/// ([`crate::host_pull::offer`]) before announcing this phase, and keeps
/// them until the phase after it.
pub unsafe fn copy(p: &EpParams, pull: bool) {
    let h = p.hidden as usize;
    let elem = if p.precision == 0 { 4 } else { 2 };
    let fp8 = p.precision == 2;
    let sent = at::<i32>(p.base, p.off_sent);
    let (t_max, me) = (p.tokens as usize, p.rank as usize);
    for s in 0..p.pes as usize {
        // SAFETY: see the module docs.
        let n = unsafe { *sent.add(s) as usize };
        // Where sender s's rows are read (this PE's own: in place).
        let (base_s, src_s) = match pull && s != me {
            // SAFETY: see the module docs.
            true => unsafe {
                let b = base_of(p, s);
                (b, word_of(p, b, word::PULL).load(Ordering::Relaxed))
            },
            false => (p.base, p.src),
        };
        let own = s == me || pull;
        par_tokens(n, |tokens| {
            for t in tokens {
                // SAFETY: see the module docs.
                for (_, r) in unsafe { routes(p, s, t) } {
                    let r = r as usize;
                    // SAFETY: the sender's send rows (and scales) hold T rows;
                    // the caller's expert-major buffers hold expert_rows.
                    unsafe {
                        // Pushed peers' rows are in the receive rows; this
                        // PE's own, and pulled ones, are in their sender's
                        // buffer (FP8: send).
                        let tok = s * t_max + t;
                        if fp8 {
                            let blocks = h / FP8_BLOCK;
                            let (src, scales) = match own {
                                true => (
                                    at::<u8>(base_s, p.off_send).add(t * h),
                                    at::<f32>(base_s, p.off_send_scales).add(t * blocks),
                                ),
                                false => (
                                    at::<u8>(p.base, p.off_recv).add(tok * h),
                                    at::<f32>(p.base, p.off_recv_scales).add(tok * blocks),
                                ),
                            };
                            if p.out != 0 {
                                std::ptr::copy_nonoverlapping(
                                    src,
                                    (p.out as *mut u8).add(r * h),
                                    h,
                                );
                                std::ptr::copy_nonoverlapping(
                                    scales,
                                    (p.out_scales as *mut f32).add(r * blocks),
                                    blocks,
                                );
                            }
                            if p.out_bf16 != 0 {
                                let dst = (p.out_bf16 as *mut u8).add(r * h * 2);
                                for e in 0..h {
                                    let v = fp8_decode(Fp8::E4M3, *src.add(e))
                                        * *scales.add(e / FP8_BLOCK);
                                    store(1, dst, e, v);
                                }
                            }
                        } else {
                            let src = match own {
                                true => (src_s as *const u8).add(t * h * elem),
                                false => at::<u8>(p.base, p.off_recv).add(tok * h * elem),
                            };
                            std::ptr::copy_nonoverlapping(
                                src,
                                (p.out as *mut u8).add(r * h * elem),
                                h * elem,
                            );
                        }
                    }
                }
            }
        });
    }
}

/// Combine's exchange step: for each received token routed here, the sum
/// of its kept routes' rows of `src` (weighted by their probs, or not),
/// in slot order with f32 accumulation, stored into its partial row at
/// the token's PE; a token whose routes here were all dropped gets a zero
/// row. With one PE the sums go straight to the output (every token's row
/// written, zeros for a token with no route): nothing is left to gather.
///
/// # Safety
/// See the module docs.
pub unsafe fn reduce(p: &EpParams) {
    let (t_max, k, h) = (p.tokens as usize, p.topk as usize, p.hidden as usize);
    let prec = if p.precision == 0 { 0 } else { 1 };
    let elem = if prec == 0 { 4 } else { 2 };
    let sent = at::<i32>(p.base, p.off_sent);
    // One PE: the sums are the outputs (a token with no route: zeros).
    let solo = p.pes == 1;
    for s in 0..p.pes as usize {
        // SAFETY: see the module docs.
        let n = unsafe { *sent.add(s) } as usize;
        par_tokens(n, |tokens| {
            let mut acc = vec![0f32; h];
            let mut rows = Vec::with_capacity(k);
            for t in tokens {
                rows.clear();
                // SAFETY: see the module docs.
                if !unsafe { routed_here(p, s, t) } {
                    if solo {
                        let out = (p.out as *mut u8).wrapping_add(t * h * elem);
                        sum_rows(prec, &mut acc, &rows, out);
                    }
                    continue;
                }
                // SAFETY: see the module docs.
                unsafe { weighted_rows(p, (p.base, p.src), (s, t), &mut rows) };
                // Into the token's PE: its partial row from this PE.
                // SAFETY: see the module docs.
                let bs = unsafe { base_of(p, s) };
                let out = match solo {
                    true => (p.out as *mut u8).wrapping_add(t * h * elem),
                    false => at::<u8>(bs, p.off_partial)
                        .wrapping_add((p.rank as usize * t_max + t) * h * elem),
                };
                sum_rows(prec, &mut acc, &rows, out);
            }
        });
    }
}

/// The PEs hosting token `t`'s experts, from this PE's published ids: a
/// bit per rank.
///
/// # Safety
/// See the module docs.
#[inline(always)]
pub(crate) unsafe fn destinations(p: &EpParams, t: usize) -> u64 {
    let k = p.topk as usize;
    let ids = at::<i32>(p.base, p.off_ids);
    let mut mask = 0u64;
    for j in 0..k {
        // SAFETY: ids holds [T, k].
        let id = unsafe { *ids.add(t * k + j) };
        if id >= 0 && (id as i64) < p.experts {
            mask |= 1 << (id as i64 / p.local_experts);
        }
    }
    mask
}

/// Combine's last step: each of this PE's tokens is the sum, in rank order
/// with f32 accumulation, of the partial rows the PEs hosting its experts
/// stored here for it (zero when it has none).
///
/// # Safety
/// See the module docs.
pub unsafe fn gather_sum(p: &EpParams) {
    let (t_max, h) = (p.tokens as usize, p.hidden as usize);
    let prec = if p.precision == 0 { 0 } else { 1 };
    let elem = if prec == 0 { 4 } else { 2 };
    par_tokens(p.n as usize, |tokens| {
        let mut acc = vec![0f32; h];
        let mut rows = Vec::with_capacity(p.pes as usize);
        for t in tokens {
            rows.clear();
            // SAFETY: see the module docs.
            let mask = unsafe { destinations(p, t) };
            for q in (0..p.pes as usize).filter(|q| mask >> q & 1 == 1) {
                // SAFETY: the partials hold [P, T, H]; PE q stored row
                // (q, t) before announcing this phase.
                let row =
                    unsafe { at::<u8>(p.base, p.off_partial).add((q * t_max + t) * h * elem) };
                rows.push((row as *const u8, 1.0));
            }
            let out = (p.out as *mut u8).wrapping_add(t * h * elem);
            sum_rows(prec, &mut acc, &rows, out);
        }
    });
}

/// The error word's code for routing this PE replaced.
pub(crate) fn routing_error(p: &EpParams, replaced: usize) -> EpError {
    EpError::BadRouting(format!(
        "PE {}: {replaced} expert id(s) outside -1..{} or repeated within a token; \
         those routes were not taken",
        p.rank, p.experts
    ))
}
