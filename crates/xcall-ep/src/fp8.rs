//! FP8 dispatch's quantization of a block of 128 elements: its scale, and
//! each element's quotient by it as the CUDA quantize computes it (the
//! Host's publish computes the same, so the two agree bit for bit).

use crate::config::FP8_MAX;

/// The FP8 scale of a block whose largest magnitude is `amax`: it maps to
/// the largest e4m3 value (an all-zero block scales by 1).
pub fn fp8_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / FP8_MAX
    } else {
        1.0
    }
}

/// Division by a block's `scale` as the CUDA quantize computes it, from
/// the scale's reciprocal (taken once per block, as there): each
/// quotient is the product and one fused correction (Markstein's). For
/// every bf16 `x` of a block and its scale this is `x / scale` in every
/// quotient fp8 does not round to zero, and the same fp8 byte always (a
/// test checks every pair). A scale below 2^-80 is first scaled by 2^64,
/// exactly on both sides, so the correction's remainder stays a normal
/// f32; an infinite scale (a block holding an infinity) divides.
pub fn fp8_divide_by(scale: f32) -> impl Fn(f32) -> f32 {
    // Written with the powers of two's bits: 2^-80 and 2^64.
    let (tiny, up) = (f32::from_bits(0x1780_0000), f32::from_bits(0x5f80_0000));
    let k = if scale < tiny { up } else { 1.0 };
    let s = scale * k;
    let inv = 1.0 / s;
    move |x: f32| {
        if !scale.is_finite() {
            return x / scale;
        }
        let a = x.abs() * k;
        let q = a * inv;
        let r = (-s).mul_add(q, a);
        r.mul_add(inv, q).copysign(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xcall_core::{fp8_encode, Fp8};

    /// A block's largest magnitude maps to e4m3's largest value; an
    /// all-zero block scales by 1 (not 0, which would make its values
    /// NaN).
    #[test]
    fn fp8_scales_map_the_largest_magnitude_to_448_and_zero_blocks_to_1() {
        assert_eq!(fp8_scale(448.0), 1.0);
        assert_eq!(fp8_scale(896.0), 2.0);
        assert_eq!(fp8_scale(0.0), 1.0);
    }

    /// The quotient the quantize computes from the reciprocal is the
    /// division for every pair of a bf16 block's largest magnitude (every
    /// bf16 value from 0 to infinity) and a bf16 element of the block,
    /// wherever fp8 keeps it: down to 2^-21 of the largest magnitude, in
    /// every f32 bit (a quotient at least 448 * 2^-21 = 2^-12.2, below
    /// fp8's smallest nonzero value's half 2^-10), in both signs. Below that
    /// the fp8 bytes agree (both a signed zero), checked for every element
    /// of one block magnitude in 61.
    #[test]
    fn the_quotient_from_the_reciprocal_is_the_division_for_every_bf16_block() {
        use rayon::prelude::*;
        let bf = |b: u16| f32::from_bits((b as u32) << 16);
        // Per block magnitude: how many of its pairs differ, and the first.
        let per_block: Vec<(usize, Option<String>)> = (0..=0x7f80u16)
            .into_par_iter()
            .map(|ab| {
                let scale = fp8_scale(bf(ab));
                let divide = fp8_divide_by(scale);
                // The smallest element kept exactly: 2^21 below the largest.
                let low = if ab & 0x7f80 > 21 << 7 {
                    ab - (21 << 7)
                } else {
                    0
                };
                let first = if ab % 61 == 0 { 0 } else { low };
                let mut bad = (0, None);
                for xb in (first..=ab).flat_map(|xb| [xb, xb | 0x8000]) {
                    let x = bf(xb);
                    let (want, got) = (x / scale, divide(x));
                    let same = if xb & 0x7fff >= low {
                        want.to_bits() == got.to_bits()
                    } else {
                        fp8_encode(Fp8::E4M3, want) == fp8_encode(Fp8::E4M3, got)
                    };
                    if !same {
                        bad.0 += 1;
                        bad.1.get_or_insert_with(|| {
                            format!("x {x:e} / scale {scale:e}: {want:e}, got {got:e}")
                        });
                    }
                }
                bad
            })
            .collect();
        let differ: usize = per_block.iter().map(|b| b.0).sum();
        let first = per_block.iter().find_map(|b| b.1.clone());
        assert_eq!(differ, 0, "pairs differ, the first: {first:?}");
        // Known answers: -0 keeps its sign; 3 / 1.5 is 2.
        assert_eq!(fp8_divide_by(2.0)(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(fp8_divide_by(1.5)(3.0), 2.0);
    }
}
