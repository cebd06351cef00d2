//! The Host steps of `combine_backward` (see [`crate::host`] for the
//! contract every step shares).

use crate::host::{at, base_of, load, store};
use crate::params::EpParams;

/// `combine_backward`'s exchange step: each received token's output
/// gradient read from its sender once; each kept route's row of the
/// experts' output gradient is it times the route's prob, and the route's
/// probs' gradient is its dot product with the expert's output (0 for a
/// dropped route), kept here for the sender to read.
///
/// # Safety
/// See the module docs.
pub unsafe fn scatter_grad(p: &EpParams) {
    let (t_max, k, h) = (p.tokens as usize, p.topk as usize, p.hidden as usize);
    let prec = if p.precision == 0 { 0 } else { 1 };
    let elem = if prec == 0 { 4 } else { 2 };
    let sent = at::<i32>(p.base, p.off_sent);
    let probs = at::<f32>(p.base, p.off_recv_probs);
    let local = at::<i32>(p.base, p.off_local);
    let gp = at::<f32>(p.base, p.off_grad_probs);
    let rows = at::<i32>(p.base, p.off_route_row);
    for s in 0..p.pes as usize {
        // SAFETY: see the module docs.
        let (bs, n) = unsafe { (base_of(p, s), *sent.add(s) as usize) };
        for t in 0..n {
            let g = at::<u8>(bs, p.off_send).wrapping_add(t * h * elem);
            for j in 0..k {
                let r = (s * t_max + t) * k + j;
                // SAFETY: the layout's arrays hold [P, T, k].
                let (loc, row, w) = unsafe { (*local.add(r), *rows.add(r), *probs.add(r)) };
                if loc < 0 {
                    continue;
                }
                let mut dot = 0f32;
                if row >= 0 {
                    let out = (p.out as *mut u8).wrapping_add(row as usize * h * elem);
                    let y = (p.expert_out as *const u8).wrapping_add(row as usize * h * elem);
                    for i in 0..h {
                        let gi = load(prec, g, i);
                        store(prec, out, i, w * gi);
                        dot += load(prec, y, i) * gi;
                    }
                }
                // SAFETY: grad_probs holds [P, T, k].
                unsafe { *gp.add(r) = dot };
            }
        }
    }
}

/// `combine_backward`'s last step: each route's probs' gradient read from
/// the PE hosting its expert (0 for an id that routes nowhere).
///
/// # Safety
/// See the module docs.
pub unsafe fn gather_probs(p: &EpParams) {
    let (t_max, k) = (p.tokens as usize, p.topk as usize);
    let me = p.rank as usize;
    let ids = at::<i32>(p.base, p.off_ids);
    for t in 0..p.n as usize {
        for j in 0..k {
            // SAFETY: ids holds [T, k]; PE q's grad_probs [P, T, k]; the
            // caller's output [n, k].
            unsafe {
                let id = *ids.add(t * k + j);
                let v = if id >= 0 && (id as i64) < p.experts {
                    let q = (id as i64 / p.local_experts) as usize;
                    *at::<f32>(base_of(p, q), p.off_grad_probs).add((me * t_max + t) * k + j)
                } else {
                    0.0
                };
                *(p.grad_probs_out as *mut f32).add(t * k + j) = v;
            }
        }
    }
}
