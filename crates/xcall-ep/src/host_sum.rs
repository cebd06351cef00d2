//! The Host steps' row arithmetic and their split over the cores: sums
//! of weighted rows with f32 accumulation (the CUDA kernels' operations,
//! in their order) and the tokens of a step run on the process's worker
//! pool.

use xcall_core::bf16_bits;

/// Tokens per task of [`par_tokens`].
const TOKENS_PER_TASK: usize = 32;

/// Runs `f` over the tokens `0..n` in ranges on the process's worker pool.
/// Host PEs reach a phase at different times: the pool keeps every core
/// busy with whichever PEs' tokens are left, one thread per core. Where
/// this process's Host PEs outnumber the pool's threads, each PE runs its
/// tokens on its own thread
/// ([`split_over_pool`](xcall_core::host_pool::split_over_pool)). Each
/// token's work is the same as in a plain loop, so results do not depend
/// on the split.
pub(crate) fn par_tokens(n: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    use rayon::prelude::*;
    if n <= TOKENS_PER_TASK || !xcall_core::host_pool::split_over_pool(rayon::current_num_threads())
    {
        return f(0..n);
    }
    (0..n.div_ceil(TOKENS_PER_TASK))
        .into_par_iter()
        .for_each(|c| f(c * TOKENS_PER_TASK..((c + 1) * TOKENS_PER_TASK).min(n)));
}

/// Element `i` of a row of f32 (`BF16` false) or bf16 (`BF16` true), as
/// f32.
#[inline(always)]
fn elem_at<const BF16: bool>(row: *const u8, i: usize) -> f32 {
    // SAFETY: callers pass rows of more than `i` elements.
    unsafe {
        if BF16 {
            f32::from_bits(u32::from((row as *const u16).add(i).read_unaligned()) << 16)
        } else {
            (row as *const f32).add(i).read_unaligned()
        }
    }
}

/// Stores `v` as element `i` of `out` (f32, or bf16 when `BF16`).
#[inline(always)]
fn put<const BF16: bool>(out: *mut u8, i: usize, v: f32) {
    // SAFETY: callers pass rows of more than `i` elements.
    unsafe {
        if BF16 {
            (out as *mut u16).add(i).write_unaligned(bf16_bits(v))
        } else {
            (out as *mut f32).add(i).write_unaligned(v)
        }
    }
}

/// `out = sum of w * row` over `rows` in their order, per element from
/// 0.0 with f32 products and sums rounded separately (as on CUDA), stored
/// rounded to `precision`'s type (0: f32, else bf16); zeros for no rows.
/// `acc` (h elements) holds the partial sums of three rows or more; one
/// and two rows take a single pass.
pub(crate) fn sum_rows(precision: i64, acc: &mut [f32], rows: &[(*const u8, f32)], out: *mut u8) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2 (just checked); the body is the same
        // (no fused multiply-add: products and sums still round apart).
        return unsafe {
            match precision {
                0 => sum_rows_avx2::<false>(acc, rows, out),
                _ => sum_rows_avx2::<true>(acc, rows, out),
            }
        };
    }
    match precision {
        0 => sum_rows_any::<false>(acc, rows, out),
        _ => sum_rows_any::<true>(acc, rows, out),
    }
}

/// [`sum_rows`] compiled for AVX2 (eight lanes where SSE2 has four).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_rows_avx2<const BF16: bool>(
    acc: &mut [f32],
    rows: &[(*const u8, f32)],
    out: *mut u8,
) {
    sum_rows_any::<BF16>(acc, rows, out)
}

/// The body of [`sum_rows`] for one element type, for any CPU: the type
/// fixed at compile time, so that every loop is a plain vector loop.
#[inline(always)]
fn sum_rows_any<const BF16: bool>(acc: &mut [f32], rows: &[(*const u8, f32)], out: *mut u8) {
    let h = acc.len();
    let at = elem_at::<BF16>;
    match rows {
        [] => (0..h).for_each(|i| put::<BF16>(out, i, 0.0)),
        [(r0, w0)] => (0..h).for_each(|i| put::<BF16>(out, i, 0.0 + w0 * at(*r0, i))),
        [(r0, w0), (r1, w1)] => (0..h).for_each(|i| {
            let v = (0.0 + w0 * at(*r0, i)) + w1 * at(*r1, i);
            put::<BF16>(out, i, v)
        }),
        [(r0, w0), middle @ .., (rl, wl)] => {
            for (i, a) in acc.iter_mut().enumerate() {
                *a = 0.0 + w0 * at(*r0, i);
            }
            for (r, w) in middle {
                for (i, a) in acc.iter_mut().enumerate() {
                    *a += w * at(*r, i);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                put::<BF16>(out, i, a + wl * at(*rl, i));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// The plain loop the CUDA kernels mirror: from 0.0, `acc += w * x`
    /// row by row, then rounded once.
    fn plain(precision: i64, rows: &[(Vec<u8>, f32)], h: usize) -> Vec<u8> {
        let mut acc = vec![0f32; h];
        for (row, w) in rows {
            for (i, a) in acc.iter_mut().enumerate() {
                let v = match precision {
                    0 => f32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap()),
                    _ => bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
                };
                *a += w * v;
            }
        }
        acc.iter()
            .flat_map(|&a| match precision {
                0 => a.to_le_bytes().to_vec(),
                _ => bf16::from_f32(a).to_bits().to_le_bytes().to_vec(),
            })
            .collect()
    }

    /// One, two and more rows summed in one pass write the bytes of the
    /// plain loop, special values (NaN, infinities, signed zeros, ties)
    /// included, in f32 and bf16.
    #[test]
    fn sums_of_rows_match_the_plain_loop_bit_for_bit() {
        let h = 67;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let specials = [
            f32::NAN,
            f32::INFINITY,
            -0.0,
            0.0,
            f32::NEG_INFINITY,
            1.0 + 1.0 / 256.0,
        ];
        for precision in [0i64, 1] {
            for n in 0..6 {
                let rows: Vec<(Vec<u8>, f32)> = (0..n)
                    .map(|r| {
                        let v: Vec<f32> = (0..h)
                            .map(|i| match (i + r) % 11 {
                                0 => specials[(i / 11 + r) % specials.len()],
                                _ => (next() >> 40) as f32 / (1u64 << 22) as f32 - 2.0,
                            })
                            .collect();
                        let bytes = v
                            .iter()
                            .flat_map(|&x| match precision {
                                0 => x.to_le_bytes().to_vec(),
                                _ => bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                            })
                            .collect();
                        (bytes, [0.5f32, -1.25, 3.0, 1.0, -0.0, 0.75][r])
                    })
                    .collect();
                let want = plain(precision, &rows, h);
                let mut got = vec![0xa5u8; want.len()];
                let ptrs: Vec<(*const u8, f32)> =
                    rows.iter().map(|(r, w)| (r.as_ptr(), *w)).collect();
                let mut acc = vec![0f32; h];
                sum_rows(precision, &mut acc, &ptrs, got.as_mut_ptr());
                assert_eq!(got, want, "precision {precision}, {n} rows");
            }
        }
    }

    /// Tokens split over the pool: every token once, in ranges that cover
    /// `0..n` without overlap, small counts on the calling thread.
    #[test]
    fn tokens_on_the_pool_are_each_run_once() {
        use std::sync::atomic::{AtomicU32, Ordering};
        for n in [0, 1, TOKENS_PER_TASK, TOKENS_PER_TASK + 1, 1000] {
            let seen: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            par_tokens(n, |r| {
                for t in r {
                    seen[t].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }
}
