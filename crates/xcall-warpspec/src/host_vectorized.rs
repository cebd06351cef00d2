//! The Host's vectorized path of the built-in ops
//! ([`HostExecutor::Vectorized`](crate::ops::HostExecutor)): blocks of
//! elements decoded, computed and encoded in a loop, large buffers split
//! over the cores; bf16 `silu` looked up from a table of its 65536 values.
//! Every element takes the f32 operations and the rounding of the pipeline
//! model, so both write the same bytes.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use xcall_core::{bf16_bits, DType, FloatCodec};

/// Elements per block of the vectorized path (decoded, computed, encoded).
const BLOCK: usize = 2048;

/// Elements of one range of the vectorized path run on the worker pool (a
/// multiple of [`BLOCK`]); a buffer of fewer than two stays on the
/// calling thread.
const PER_THREAD: usize = 1 << 18;

/// What the vectorized path computes over one block: `out[j]` from the
/// inputs' `[j]` for the elements `first..first + out.len()` (`first`
/// counted from the buffer's start).
pub(crate) type BlockFn<'a> = &'a (dyn Fn(usize, &[&[f32]], &mut [f32]) + Sync);

/// What the vectorized path runs: a [`BlockFn`] over decoded elements, or
/// `silu(x) * scale` of one bf16 input straight from its bits to the
/// output's (the same f32 operations and rounding, no decoded block).
#[derive(Clone, Copy)]
pub(crate) enum Block<'a> {
    F32(BlockFn<'a>),
    SiluBf16(f32),
}

/// `silu(x)` in f32, as [`silu_scale_f32`](crate::ops::silu_scale_f32)
/// computes it before its scale.
pub(crate) fn silu_f32(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// [`silu_f32`] of every bf16 value, by its bits: a bf16 input has 65536
/// values, so the vectorized path looks them up instead of calling `exp`
/// per element (the same f32 operations, so the same bits).
pub(crate) fn silu_bf16_table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|h| silu_f32(f32::from_bits(u32::from(h) << 16)))
            .collect()
    })
}

/// `out[j] = silu(x[j]) * scale` (`table`: [`silu_bf16_table`] for
/// bf16 inputs).
pub(crate) fn silu_run(table: Option<&[f32]>, x: &[f32], out: &mut [f32], scale: f32) {
    match table {
        Some(t) => {
            for (o, v) in out.iter_mut().zip(x) {
                *o = t[(v.to_bits() >> 16) as usize] * scale;
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = silu_f32(v) * scale;
            }
        }
    }
}

/// Elements from which `silu(x) * scale` over bf16 first tabulates its
/// 65536 results for the scale (bits to bits), then looks each one up.
const SCALED_TABLE_FROM: usize = 1 << 17;

/// `silu(x) * scale` of every bf16 value as bf16 bits, by its bits.
type ScaledTable = [u16; 1 << 16];

/// [`ScaledTable`] for `scale`.
fn silu_bf16_scaled(scale: f32) -> Box<ScaledTable> {
    let mut t = Box::new([0u16; 1 << 16]);
    for (o, v) in t.iter_mut().zip(silu_bf16_table()) {
        *o = bf16_bits(v * scale);
    }
    t
}

/// Scaled tables kept for reuse, at most (128 KiB each): an MoE layer
/// calls silu with each local expert's scale at every step.
const SCALED_KEPT: usize = 16;

/// [`silu_bf16_scaled`] of `scale`, made once and kept among the last
/// [`SCALED_KEPT`] scales' (the lock is held only to look up or insert;
/// a table is made outside it).
fn silu_bf16_scaled_kept(scale: f32) -> Arc<ScaledTable> {
    static KEPT: Mutex<Vec<(u32, Arc<ScaledTable>)>> = Mutex::new(Vec::new());
    let key = scale.to_bits();
    let found = KEPT
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, t)| Arc::clone(t));
    if let Some(t) = found {
        return t;
    }
    let made: Arc<ScaledTable> = Arc::from(silu_bf16_scaled(scale));
    let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
    if !kept.iter().any(|(k, _)| *k == key) {
        if kept.len() >= SCALED_KEPT {
            kept.remove(0);
        }
        kept.push((key, Arc::clone(&made)));
    }
    made
}

/// `out = silu(x) * scale` over bf16 bytes: each input's bits look up
/// [`silu_bf16_table`], the product rounds as [`bf16_bits`] does, or
/// look up `scaled`, those results for `scale` tabulated.
fn silu_bf16_range(x: &[u8], out: &mut [u8], scale: f32, scaled: Option<&ScaledTable>) {
    if let Some(scaled) = scaled {
        // SAFETY: any two bytes are a u16; `align_to` splits off what is
        // not aligned.
        let ((xh, xs, xt), (oh, os, ot)) =
            unsafe { (x.align_to::<u16>(), out.align_to_mut::<u16>()) };
        if xh.is_empty() && oh.is_empty() && xt.is_empty() && ot.is_empty() {
            // The common case, both aligned: a table indexed by a u16 has
            // no bounds to check.
            for (o, &i) in os.iter_mut().zip(xs) {
                *o = scaled[usize::from(u16::from_le(i))].to_le();
            }
            return;
        }
        for (o, i) in out.chunks_exact_mut(2).zip(x.chunks_exact(2)) {
            let h = u16::from_le_bytes([i[0], i[1]]);
            o.copy_from_slice(&scaled[usize::from(h)].to_le_bytes());
        }
        return;
    }
    let table = silu_bf16_table();
    for (o, i) in out.chunks_exact_mut(2).zip(x.chunks_exact(2)) {
        let h = u16::from_le_bytes([i[0], i[1]]);
        o.copy_from_slice(&bf16_bits(table[h as usize] * scale).to_le_bytes());
    }
}

/// `f` over the elements of `out` and `inputs` from element `first`, in
/// blocks, on the calling thread.
fn vectorized_range(
    codec: FloatCodec,
    inputs: &[&[u8]],
    out: &mut [u8],
    first: usize,
    f: BlockFn<'_>,
) {
    let elements = out.len() / codec.dtype().size_bytes();
    let mut loaded = vec![vec![0f32; BLOCK]; inputs.len()];
    let mut results = vec![0f32; BLOCK];
    let mut at = 0;
    while at < elements {
        let len = BLOCK.min(elements - at);
        for (l, input) in loaded.iter_mut().zip(inputs) {
            codec.load_slice(input, at, &mut l[..len]);
        }
        let args: Vec<&[f32]> = loaded.iter().map(|l| &l[..len]).collect();
        f(first + at, &args, &mut results[..len]);
        if codec.dtype() == DType::Bf16 {
            let dst = &mut out[2 * at..2 * (at + len)];
            for (b, &v) in dst.chunks_exact_mut(2).zip(&results[..len]) {
                b.copy_from_slice(&bf16_bits(v).to_le_bytes());
            }
        } else {
            codec.store_slice(out, at, &results[..len]);
        }
        at += len;
    }
}

/// The vectorized path: `out` cut into ranges of [`PER_THREAD`] elements
/// (for large buffers), run on the process's worker pool. PEs run as
/// threads and may call at once: one shared pool keeps one busy thread per
/// core, where threads of their own per call would oversubscribe them;
/// where this process's Host PEs outnumber the pool's threads, each runs
/// on its own thread ([`split_over_pool`](xcall_core::host_pool::split_over_pool)).
pub(crate) fn vectorized(codec: FloatCodec, inputs: &[&[u8]], out: &mut [u8], block: Block<'_>) {
    use rayon::prelude::*;
    let size = codec.dtype().size_bytes();
    let elements = out.len() / size;
    // A long bf16 silu looks its results up in a table for its scale,
    // one for every range, kept for the next calls with that scale.
    let scaled = match block {
        Block::SiluBf16(scale) if elements >= SCALED_TABLE_FROM => {
            Some(silu_bf16_scaled_kept(scale))
        }
        _ => None,
    };
    let range = |first: usize, ins: &[&[u8]], range: &mut [u8]| match block {
        Block::SiluBf16(scale) => silu_bf16_range(ins[0], range, scale, scaled.as_deref()),
        Block::F32(f) => vectorized_range(codec, ins, range, first, f),
    };
    if elements < 2 * PER_THREAD
        || !xcall_core::host_pool::split_over_pool(rayon::current_num_threads())
    {
        return range(0, inputs, out);
    }
    out.par_chunks_mut(PER_THREAD * size)
        .enumerate()
        .for_each(|(t, out)| {
            let (first, len) = (t * PER_THREAD, out.len());
            // Each range reads the same elements of every input.
            let ins: Vec<&[u8]> = inputs
                .iter()
                .map(|i| &i[first * size..first * size + len])
                .collect();
            range(first, &ins, out);
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `silu(x) * scale` straight on bf16 bits writes what decoding,
    /// looking up, scaling and rounding writes, for every bf16 value, in
    /// a short buffer (looked up per element) and a long one (through the
    /// table for the scale, on the pool).
    #[test]
    fn silu_on_bits_is_the_decoded_path() {
        let codec = FloatCodec::new(DType::Bf16).unwrap();
        let table = silu_bf16_table();
        let every: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let long: Vec<u8> = every
            .iter()
            .copied()
            .cycle()
            .take(2 * SCALED_TABLE_FROM * 2 + 6)
            .collect();
        // Also from an odd byte: the rows' bytes need not be aligned for
        // a u16.
        let padded: Vec<u8> = std::iter::once(0x5a).chain(long.iter().copied()).collect();
        let odd = &padded[(padded.as_ptr() as usize + 1) % 2..][..long.len()];
        assert_eq!(odd.as_ptr() as usize % 2, 1);
        let cases = [
            (&every[..4000], 0.75f32, 0),
            (&long[..], -3.5, 0),
            (odd, 1.25, 0),
            (odd, 1.25, 1),
            (&long[..], 2.0, 1),
        ];
        for (x, scale, odd_out) in cases {
            // The output starts at an even byte, or an odd one.
            let mut buf = vec![0xa5u8; x.len() + 2];
            let at = (buf.as_ptr() as usize + odd_out) % 2;
            let out = &mut buf[at..at + x.len()];
            vectorized(codec, &[x], out, Block::SiluBf16(scale));
            let mut want = vec![0u8; x.len()];
            for (i, b) in x.chunks_exact(2).enumerate() {
                let h = u16::from_le_bytes([b[0], b[1]]);
                codec.store(&mut want, i, table[h as usize] * scale);
            }
            assert!(
                *out == want[..],
                "{} elements (output odd: {odd_out}): the paths differ",
                x.len() / 2
            );
        }
    }

    /// A scale's table is made once and kept for the next calls (the same
    /// table, the same bytes as a fresh one) until [`SCALED_KEPT`] other
    /// scales came after it.
    #[test]
    fn scaled_tables_are_kept_for_the_last_scales() {
        // Scales no other test uses.
        let first = silu_bf16_scaled_kept(1001.5);
        assert!(Arc::ptr_eq(&first, &silu_bf16_scaled_kept(1001.5)));
        assert!(first[..] == silu_bf16_scaled(1001.5)[..]);
        for i in 0..SCALED_KEPT {
            let other = silu_bf16_scaled_kept(2000.0 + i as f32);
            assert!(!Arc::ptr_eq(&first, &other));
        }
        let again = silu_bf16_scaled_kept(1001.5);
        assert!(
            !Arc::ptr_eq(&first, &again),
            "kept past {SCALED_KEPT} other scales"
        );
        assert!(again[..] == first[..]);
    }

    /// A buffer cut into ranges on the pool: every element computed once,
    /// with its own index and its own inputs' elements.
    #[test]
    fn ranges_on_the_pool_cover_the_buffer_in_place() {
        let codec = FloatCodec::new(DType::F32).unwrap();
        let n = 2 * PER_THREAD + 3 * BLOCK + 17;
        let a: Vec<u8> = (0..n)
            .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        let mut out = vec![0xa5u8; n * 4];
        vectorized(
            codec,
            &[&a],
            &mut out,
            Block::F32(&|first, v, out| {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = v[0][j] + (first + j) as f32;
                }
            }),
        );
        for (i, b) in out.chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            assert_eq!(got, i as f32 * 1.5, "element {i}");
        }
    }

    /// The table holds `silu` of every bf16 value as the op's definition,
    /// `x / (1 + exp(-x)) * scale`, computes it, so looking up and scaling
    /// gives its bits.
    #[test]
    fn the_bf16_table_is_the_definition() {
        let table = silu_bf16_table();
        for h in 0..=u16::MAX {
            let x = f32::from_bits(u32::from(h) << 16);
            for scale in [1.0f32, 0.75, -3.5] {
                assert_eq!(
                    (table[h as usize] * scale).to_bits(),
                    (x / (1.0 + (-x).exp()) * scale).to_bits(),
                    "{h:#06x} x {scale}"
                );
            }
        }
    }
}
