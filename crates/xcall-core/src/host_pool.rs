//! Whether the Host's data-parallel loops should split their work over
//! the process's worker pool. Host PEs are threads of one process or
//! processes of their own; while a process's live Host PEs already
//! outnumber the pool's threads, every core is busy with some PE's work,
//! and a split only adds hand-offs between threads and wake-ups (measured
//! on two cores: four PE threads stepped about 1.3x slower through the
//! pool than each on its own thread, two about 1.25x faster through it).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Live Host PEs of this process.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// A Host PE of this process, counted while it lives (a Host world holds
/// one).
#[must_use = "the PE is counted only while this lives"]
#[derive(Debug)]
pub struct HostPe(());

impl HostPe {
    /// Counts one more live Host PE until the result drops.
    pub fn enter() -> HostPe {
        LIVE.fetch_add(1, Ordering::Relaxed);
        HostPe(())
    }
}

impl Drop for HostPe {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Live Host PEs of this process.
pub fn live_host_pes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Whether a Host loop should split over a pool of `workers` threads: at
/// least two of them, and no more live Host PEs in this process than
/// there are workers (none: a call outside any world).
pub fn split_over_pool(workers: usize) -> bool {
    workers >= 2 && live_host_pes() <= workers
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split is taken while the PEs leave workers free and refused
    /// once they outnumber them, and again taken when they leave; never
    /// with one worker. (The only test of this binary that counts PEs.)
    #[test]
    fn the_pool_is_split_only_while_pes_leave_workers_free() {
        assert!(split_over_pool(2));
        assert!(!split_over_pool(1));
        let two = [HostPe::enter(), HostPe::enter()];
        assert_eq!(live_host_pes(), 2);
        assert!(split_over_pool(2));
        let third = HostPe::enter();
        assert!(!split_over_pool(2));
        assert!(split_over_pool(3));
        drop(third);
        assert!(split_over_pool(2));
        drop(two);
        assert_eq!(live_host_pes(), 0);
    }
}
