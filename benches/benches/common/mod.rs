//! Helpers shared by the benches.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Runs `work(thread, iters)` on `threads` threads at once; the wall time
/// is the time per iteration of one thread (flat means linear scaling).
pub fn parallel<W>(threads: u32, iters: u64, work: W) -> Duration
where
    W: Fn(u32, u64) + Send + Sync + Clone + 'static,
{
    let start = Arc::new(Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (start, work) = (start.clone(), work.clone());
            std::thread::spawn(move || {
                start.wait();
                work(t, iters);
            })
        })
        .collect();
    let t0 = Instant::now();
    start.wait();
    for h in handles {
        h.join().unwrap();
    }
    t0.elapsed()
}
