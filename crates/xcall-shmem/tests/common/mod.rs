//! What the multi-process Host tests share.

use xcall_core::testing::XorShift;
use xcall_shmem::{Cmp, SignalOp, World};

/// One PE's turn of a ring exchange on a live world: allocates a buffer
/// of `bytes` and a signal word, puts random data (seeded `seed + rank`)
/// to the right neighbour with a signal, waits for the left neighbour's,
/// and checks its bytes. Returns (buffer, signal, the data sent).
pub fn ring(w: &mut World, rank: usize, n: usize, seed: u64, bytes: usize) -> (u64, u64, Vec<u8>) {
    let buf = w.malloc(bytes).unwrap();
    let sig = w.malloc(8).unwrap();
    // SAFETY: this PE's own signal word.
    unsafe { (sig as *mut u64).write(0) };
    w.barrier_all().unwrap();
    let mut g = XorShift::new(seed + rank as u64);
    let data: Vec<u8> = (0..bytes).map(|_| g.next_u64() as u8).collect();
    let right = (rank + 1) % n;
    // SAFETY: `data` has `bytes` bytes.
    unsafe {
        w.put_signal(
            buf,
            data.as_ptr() as u64,
            bytes,
            sig,
            1,
            SignalOp::Add,
            right,
        )
    }
    .unwrap();
    w.wait_until(sig, Cmp::Eq, 1).unwrap();
    let left = (rank + n - 1) % n;
    let mut want = XorShift::new(seed + left as u64);
    // SAFETY: this PE's object of `bytes` bytes.
    let got = unsafe { std::slice::from_raw_parts(buf as *const u8, bytes) };
    assert!(
        got.iter().all(|&b| b == want.next_u64() as u8),
        "rank {rank}: data from rank {left}"
    );
    (buf, sig, data)
}
