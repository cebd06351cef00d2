//! Host groups whose PEs all share one process (a world of threads): every
//! PE's memory, the caller's buffers included, is at the same address for
//! every PE, so the exchange reads rows where their owners keep them
//! instead of storing them into peers first. Dispatch copies each
//! received token from its sender's `x` (FP8: its send rows) straight
//! into the expert-major rows, with no receive rows between; combine
//! sums each of this PE's tokens from the experts' outputs of every PE
//! hosting one of its experts, each PE's partial row in a scratch row of
//! the summing thread, with no partial rows stored between. Each call then ends with an
//! empty phase, so no PE returns while a peer may still read the
//! caller's buffers it offered.
//!
//! The arithmetic is the push steps' ([`crate::host`]): each PE's partial
//! is its routes' rows summed in slot order (f32) and rounded to the
//! row type, and the partials are added in PE rank order (f32) from 0.0.
//! A pulled call writes the same bytes as a pushed one (and as CUDA),
//! and moves about half the exchange's bytes through memory at `xcall
//! moe`'s default shape: no receive rows and no partial rows are written
//! and read back.

use std::sync::atomic::Ordering;

use crate::config::word;
use crate::host::{base_of, destinations, weighted_rows, word_of};
use crate::host_sum::{par_tokens, sum_rows};
use crate::params::EpParams;

/// Offers this call's rows (`p.src`: `x` in dispatch, the experts'
/// outputs in combine) to peers, before the phase's announcement (whose
/// release store publishes it).
///
/// # Safety
/// `p.base` is a group allocation of `p`'s layout.
pub unsafe fn offer(p: &EpParams) {
    // SAFETY: the caller's contract.
    unsafe { word_of(p, p.base, word::PULL) }.store(p.src, Ordering::Relaxed);
}

/// Combine's sums, pulled: each of this PE's tokens is the sum, in rank
/// order with f32 accumulation, of one partial row per PE hosting one of
/// its experts (zero when it has none); each partial row is that PE's
/// kept routes' rows of its offered outputs, weighted by their probs (or
/// not: `p.weighted`), summed in slot order and rounded to the row type,
/// kept in a scratch row of this thread.
///
/// # Safety
/// Every PE is of this process, has offered its outputs and announced
/// the phase this PE waited for, and keeps its outputs and layout until
/// the phase after it.
pub unsafe fn gather(p: &EpParams) {
    let (k, h) = (p.topk as usize, p.hidden as usize);
    let prec = if p.precision == 0 { 0 } else { 1 };
    let elem = if prec == 0 { 4 } else { 2 };
    let me = p.rank as usize;
    // Each PE's allocation and offered rows.
    let peers: Vec<(u64, u64)> = (0..p.pes as usize)
        .map(|q| {
            // SAFETY: the caller's contract.
            unsafe {
                let b = base_of(p, q);
                (b, word_of(p, b, word::PULL).load(Ordering::Relaxed))
            }
        })
        .collect();
    // A token's partial rows, one per PE hosting its experts (k at most).
    let most = (p.pes as usize).min(k);
    par_tokens(p.n as usize, |tokens| {
        let mut acc = vec![0f32; h];
        let mut scratch = vec![0u8; most * h * elem];
        // One pointer for every partial row (no reborrow of the buffer
        // between them).
        let parts = scratch.as_mut_ptr();
        let mut rows = Vec::with_capacity(k);
        let mut partials = Vec::with_capacity(most);
        for t in tokens {
            partials.clear();
            // SAFETY: see the function's contract.
            let mask = unsafe { destinations(p, t) };
            for q in (0..p.pes as usize).filter(|q| mask >> q & 1 == 1) {
                rows.clear();
                // SAFETY: see the function's contract.
                unsafe { weighted_rows(p, peers[q], (me, t), &mut rows) };
                // A token's ids are distinct experts (publish replaced
                // repeats), so at most `most` PEs: each partial has a row.
                assert!(
                    partials.len() < most,
                    "token {t} reaches more PEs than it has routes"
                );
                let part = parts.wrapping_add(partials.len() * h * elem);
                sum_rows(prec, &mut acc, &rows, part);
                partials.push((part as *const u8, 1.0));
            }
            let out = (p.out as *mut u8).wrapping_add(t * h * elem);
            sum_rows(prec, &mut acc, &partials, out);
        }
    });
}
