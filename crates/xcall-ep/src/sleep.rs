//! How a Host PE waits for a peer's announcement without holding a core:
//! a short spin, then a sleep on the announced word itself (a Linux futex
//! on its low 32 bits, which works between processes sharing the heap as
//! between threads), woken by the announcing PE. PEs often outnumber the
//! cores (four PE threads on two cores), and a waiter that spins or
//! yields takes turns from the PE it waits for.

use std::sync::atomic::AtomicU64;
#[cfg(not(target_os = "linux"))]
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long one sleep of a waiting PE lasts at most before it looks
/// again (and checks its timeout): a lost wake-up costs at most this much.
pub(crate) const NAP: Duration = Duration::from_millis(1);

/// Sleeps while `word` still reads `seen` (or until woken, or `nap`
/// passed). Returns at once if it no longer does.
pub(crate) fn sleep_while(word: &AtomicU64, seen: u64, nap: Duration) {
    #[cfg(target_os = "linux")]
    {
        let ts = libc::timespec {
            tv_sec: nap.as_secs() as libc::time_t,
            tv_nsec: nap.subsec_nanos() as libc::c_long,
        };
        // SAFETY: the futex word is the low half of a live, aligned u64
        // (little-endian: its first four bytes); the kernel compares it
        // with `seen`'s low half before sleeping, so a store made after
        // the caller's load is not missed. Shared (not private) futexes,
        // as the word may be mapped by other processes.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr() as *const u32,
                libc::FUTEX_WAIT,
                seen as u32,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        if word.load(Ordering::Acquire) == seen {
            std::thread::sleep(nap.min(Duration::from_micros(50)));
        }
    }
}

/// Wakes every PE sleeping on `word` (after the caller stored to it).
pub(crate) fn wake(word: &AtomicU64) {
    #[cfg(target_os = "linux")]
    // SAFETY: as in `sleep_while`; waking has no memory effect.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr() as *const u32,
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
    #[cfg(not(target_os = "linux"))]
    let _ = word.load(Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

    /// A PE asleep on a word for a long nap wakes when the word is stored
    /// and woken, long before the nap ends (a watchdog fails the test
    /// instead of waiting the nap out); a word that already changed does
    /// not put it to sleep, one that did not keeps it asleep.
    #[test]
    fn a_store_and_a_wake_end_the_sleep() {
        let word = Arc::new(AtomicU64::new(7));
        let started = Instant::now();
        sleep_while(&word, 6, Duration::from_secs(30));
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "slept on a changed word"
        );
        // Unchanged and not woken: it sleeps (about) its nap.
        let started = Instant::now();
        sleep_while(&word, 7, Duration::from_millis(200));
        assert!(
            started.elapsed() >= Duration::from_millis(100),
            "returned after {:?} from a 200 ms nap on an unchanged word",
            started.elapsed()
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let sleeper = {
            let word = Arc::clone(&word);
            std::thread::spawn(move || {
                while word.load(Ordering::Acquire) == 7 {
                    sleep_while(&word, 7, Duration::from_secs(30));
                }
                tx.send(()).ok();
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        word.store(8, Ordering::Release);
        wake(&word);
        assert!(
            rx.recv_timeout(Duration::from_secs(10)).is_ok(),
            "the sleeper was not woken"
        );
        sleeper.join().unwrap();
    }
}
