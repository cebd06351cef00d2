//! Support for tests that need a GPU.
//!
//! GPU tests detect CUDA at run time. Without a usable GPU they print one
//! `SKIP` line and pass; with `XCALL_REQUIRE_CUDA=1` a missing GPU is a test
//! failure, so a GPU run cannot pass by skipping.

use crate::cuda;

/// Environment variable that turns "no GPU" from a skip into a failure.
pub const REQUIRE_ENV: &str = "XCALL_REQUIRE_CUDA";

/// Whether `XCALL_REQUIRE_CUDA=1` is set.
pub fn cuda_required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// The number of CUDA devices for GPU test `test`, or `None` after printing
/// a skip line when CUDA is unavailable.
///
/// # Panics
/// When CUDA is unavailable and `XCALL_REQUIRE_CUDA=1` is set: that is the
/// test failing.
pub fn cuda_devices_or_skip(test: &str) -> Option<usize> {
    match cuda::device_count() {
        Ok(n) => Some(n),
        Err(e) if cuda_required() => panic!("{test}: {REQUIRE_ENV}=1 but {e}"),
        Err(e) => {
            skip(test, &e.to_string());
            None
        }
    }
}

/// Prints `SKIP <test>: <reason>` on stderr. It writes to the stream
/// directly, so the line shows even when the test harness captures output.
pub fn skip(test: &str, reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIP {test}: {reason}");
}

/// Deterministic pseudo-random numbers for tests and benchmarks
/// (xorshift64): fresh data for every seed, never all zeros.
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator for `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value, uniform in [-1, 1) on a 2^-23 grid.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `n` values uniform in [-1, 1) from `seed`.
pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut g = XorShift::new(seed);
    (0..n).map(|_| g.next_f32()).collect()
}

/// Times every variant once per round, round after round (so clock drift
/// affects all alike), after a warm-up of 30 rounds; returns each
/// variant's CUDA-event median in ms. The variants enqueue work on
/// `stream` (of `ctx`) and nothing else.
pub fn interleaved_medians(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    stream: &cudarc::driver::CudaStream,
    rounds: usize,
    variants: &mut [Box<dyn FnMut() + '_>],
) -> Vec<f64> {
    for _ in 0..30 {
        for v in variants.iter_mut() {
            v();
        }
    }
    stream.synchronize().unwrap();
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut samples = vec![Vec::with_capacity(rounds); variants.len()];
    for _ in 0..rounds {
        for (v, out) in variants.iter_mut().zip(samples.iter_mut()) {
            let (a, b) = (ctx.new_event(timed).unwrap(), ctx.new_event(timed).unwrap());
            a.record(stream).unwrap();
            v();
            b.record(stream).unwrap();
            b.synchronize().unwrap();
            out.push(a.elapsed_ms(&b).unwrap() as f64);
        }
    }
    samples
        .into_iter()
        .map(|mut t| {
            t.sort_by(|x, y| x.total_cmp(y));
            t[t.len() / 2]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_values_are_reproducible_in_range_and_not_constant() {
        let a = random_f32(10_000, 3);
        assert_eq!(a, random_f32(10_000, 3));
        assert_ne!(a, random_f32(10_000, 4));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().map(|&v| v as f64).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!(random_f32(100, 0).iter().any(|&v| v != 0.0));
    }
}
