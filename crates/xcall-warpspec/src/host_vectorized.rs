//! The Host's vectorized path of the built-in ops
//! ([`HostExecutor::Vectorized`](crate::ops::HostExecutor)): blocks of
//! elements decoded, computed and encoded in a loop, large buffers split
//! over the cores; bf16 `silu` looked up from a table of its 65536 values.
//! Every element takes the f32 operations and the rounding of the pipeline
//! model, so both write the same bytes.

use std::sync::OnceLock;

use xcall_core::{DType, FloatCodec};

/// Elements per block of the vectorized path (decoded, computed, encoded).
const BLOCK: usize = 2048;

/// Elements below which the vectorized path stays on the calling thread.
const PER_THREAD: usize = 1 << 18;

/// What the vectorized path computes over one block: `out[j]` from the
/// inputs' `[j]` for the elements `first..first + out.len()` (`first`
/// counted from the buffer's start).
pub(crate) type BlockFn<'a> = &'a (dyn Fn(usize, &[&[f32]], &mut [f32]) + Sync);

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

/// `v` as bf16 bits, rounded to nearest even, a NaN quieted with the upper
/// half of its payload: the codec's rounding, bit for bit, without
/// branches (so that the loop around it vectorizes).
fn bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let nan = (x >> 16) | 0x40;
    (if x & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }) as u16
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

/// The vectorized path: `out` cut into one range per core (for large
/// buffers), each range on its own scoped thread; a range whose thread
/// cannot be started runs on the calling thread.
pub(crate) fn vectorized(codec: FloatCodec, inputs: &[&[u8]], out: &mut [u8], f: BlockFn<'_>) {
    let size = codec.dtype().size_bytes();
    let elements = out.len() / size;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(elements / PER_THREAD).max(1);
    if threads == 1 {
        return vectorized_range(codec, inputs, out, 0, f);
    }
    let per = elements.div_ceil(threads).next_multiple_of(BLOCK);
    std::thread::scope(|scope| {
        for (t, range) in out.chunks_mut(per * size).enumerate() {
            let (first, len) = (t * per, range.len());
            // Each range reads the same elements of every input.
            let ins = || -> Vec<&[u8]> {
                inputs
                    .iter()
                    .map(|i| &i[first * size..first * size + len])
                    .collect()
            };
            let (theirs, (tx, rx)) = (ins(), std::sync::mpsc::channel::<&mut [u8]>());
            let started = std::thread::Builder::new().spawn_scoped(scope, move || {
                if let Ok(range) = rx.recv() {
                    vectorized_range(codec, &theirs, range, first, f);
                }
            });
            // The range goes to a thread that started, else runs here.
            let here = match started {
                Ok(_) => tx.send(range).err().map(|e| e.0),
                Err(_) => Some(range),
            };
            if let Some(range) = here {
                vectorized_range(codec, &ins(), range, first, f);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized path's bf16 rounding is the codec's, bit for bit:
    /// every 2^32 / 4099-th f32 pattern, and the edges (ties either way,
    /// the largest finite values, infinities, NaN payloads).
    #[test]
    fn bf16_bits_rounds_like_the_codec() {
        let codec = FloatCodec::new(DType::Bf16).unwrap();
        let edges = [
            0x3f80_8000u32,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x7fc0_1234,
            0x8000_0000,
            0,
        ];
        for bits in (0..=u32::MAX).step_by(4099).chain(edges) {
            let mut want = [0u8; 2];
            codec.store(&mut want, 0, f32::from_bits(bits));
            assert_eq!(
                bf16_bits(f32::from_bits(bits)).to_le_bytes(),
                want,
                "{bits:#010x}"
            );
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
