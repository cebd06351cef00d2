#![allow(dead_code)] // each test binary uses a part of it
//! What the multi-process Host tests share.

use std::time::Duration;

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

/// Bytes of PE `from`'s segment to PE `to` in round `round`: 1 to `max`,
/// from a hash of the three (both sides compute it alone).
pub fn segment_bytes(from: usize, to: usize, round: usize, max: usize) -> usize {
    let mut g = XorShift::new(((from * 7919 + to) * 104_729 + round) as u64 + 1);
    1 + (g.next_u64() as usize) % max
}

/// The data of PE `from`'s segment to PE `to` in round `round`.
pub fn segment_data(seed: u64, from: usize, to: usize, round: usize, bytes: usize) -> Vec<u8> {
    let mut g = XorShift::new(seed ^ ((from as u64) << 40 | (to as u64) << 20 | round as u64));
    (0..bytes).map(|_| g.next_u64() as u8).collect()
}

/// `rounds` all-to-all exchanges on a live world (every PE to every PE,
/// itself included), alternating two buffers of `n` slots of `max` bytes
/// with no barrier between rounds: PE `a`'s segment lands in slot `a` of
/// the receiver's buffer, and the segment to the right neighbour goes in
/// two pieces. Each round's sizes and data differ (stale data fails the
/// check), and every PE checks every slot it received against the data
/// computed here.
pub fn all_to_all(w: &mut World, rank: usize, n: usize, seed: u64, rounds: usize, max: usize) {
    use xcall_shmem::{Incoming, Outgoing};
    let bufs = [w.malloc(n * max).unwrap(), w.malloc(n * max).unwrap()];
    w.barrier_all().unwrap();
    let right = (rank + 1) % n;
    for round in 0..rounds {
        let buf = bufs[round % 2];
        let data: Vec<Vec<u8>> = (0..n)
            .map(|to| segment_data(seed, rank, to, round, segment_bytes(rank, to, round, max)))
            .collect();
        let mut outgoing = Vec::new();
        for (to, d) in data.iter().enumerate() {
            let dest = buf + (rank * max) as u64;
            let src = d.as_ptr() as u64;
            if to == right && d.len() > 1 {
                let half = d.len() / 2;
                outgoing.push(Outgoing {
                    pe: to,
                    src,
                    dest,
                    bytes: half,
                });
                outgoing.push(Outgoing {
                    pe: to,
                    src: src + half as u64,
                    dest: dest + half as u64,
                    bytes: d.len() - half,
                });
            } else {
                outgoing.push(Outgoing {
                    pe: to,
                    src,
                    dest,
                    bytes: d.len(),
                });
            }
        }
        let mut incoming = Vec::new();
        for from in 0..n {
            let bytes = segment_bytes(from, rank, round, max);
            let dest = buf + (from * max) as u64;
            if rank == (from + 1) % n && bytes > 1 {
                let half = bytes / 2;
                incoming.push(Incoming {
                    pe: from,
                    dest,
                    bytes: half,
                });
                incoming.push(Incoming {
                    pe: from,
                    dest: dest + half as u64,
                    bytes: bytes - half,
                });
            } else {
                incoming.push(Incoming {
                    pe: from,
                    dest,
                    bytes,
                });
            }
        }
        // SAFETY: every src is a live vector of its bytes.
        unsafe { w.exchange(&outgoing, &incoming) }.unwrap();
        for from in 0..n {
            let bytes = segment_bytes(from, rank, round, max);
            let want = segment_data(seed, from, rank, round, bytes);
            // SAFETY: slot `from` of this PE's buffer, `max` >= bytes.
            let got = unsafe {
                std::slice::from_raw_parts((buf + (from * max) as u64) as *const u8, bytes)
            };
            assert!(
                got == want.as_slice(),
                "rank {rank}, round {round}: the segment from PE {from}"
            );
        }
    }
    w.barrier_all().unwrap();
    for b in bufs {
        w.free(b).unwrap();
    }
}

/// What one PE of [`disagreeing_pe`] saw: the disagreeing exchange's
/// result, its buffer after it, and its buffer after the agreeing
/// exchange that follows (or that exchange's error).
pub type Disagreement = (
    Result<(), (xcall_core::Status, String)>,
    Vec<u8>,
    Result<Vec<u8>, String>,
);

/// One PE's part of two PEs' exchange whose lists disagree: rank 0 sends
/// 64 bytes to rank 1, which lists `listed` bytes (`None`: nothing) from
/// rank 0; then an exchange that agrees (`listed` bytes, or 64), whose
/// sender comes 300 ms late with new bytes. Finalizes the world.
pub fn disagreeing_pe(w: &mut World, rank: usize, listed: Option<usize>) -> Disagreement {
    use xcall_shmem::{Incoming, Outgoing};
    let buf = w.malloc(128).unwrap();
    // SAFETY: this PE's object of 128 bytes.
    unsafe { std::ptr::write_bytes(buf as *mut u8, 0xAA, 128) };
    w.barrier_all().unwrap();
    let old = [1u8; 64];
    let new = [2u8; 64];
    let r = if rank == 0 {
        let out = Outgoing {
            pe: 1,
            src: old.as_ptr() as u64,
            dest: buf,
            bytes: 64,
        };
        // SAFETY: `old` holds 64 bytes.
        unsafe { w.exchange(&[out], &[]) }
    } else {
        let inc: Vec<Incoming> = listed
            .map(|bytes| Incoming {
                pe: 0,
                dest: buf,
                bytes,
            })
            .into_iter()
            .collect();
        // SAFETY: nothing is sent.
        unsafe { w.exchange(&[], &inc) }
    };
    let e = r.map_err(|e| (e.status(), e.to_string()));
    // SAFETY: this PE's object of 128 bytes.
    let after = unsafe { std::slice::from_raw_parts(buf as *const u8, 128) }.to_vec();
    // The next exchange agrees; its sender comes late.
    let bytes = listed.unwrap_or(64);
    let agreed = if rank == 0 {
        std::thread::sleep(Duration::from_millis(300));
        let out = Outgoing {
            pe: 1,
            src: new.as_ptr() as u64,
            dest: buf,
            bytes,
        };
        // SAFETY: `new` holds 64 bytes.
        unsafe { w.exchange(&[out], &[]) }
    } else {
        let inc = Incoming {
            pe: 0,
            dest: buf,
            bytes,
        };
        // SAFETY: nothing is sent.
        unsafe { w.exchange(&[], &[inc]) }
    };
    // SAFETY: as above.
    let next = unsafe { std::slice::from_raw_parts(buf as *const u8, 128) }.to_vec();
    let next = agreed.map(|()| next).map_err(|e| e.to_string());
    // A world the bug left off step finalizes as it can.
    if w.barrier_all().is_ok() {
        let _ = w.free(buf);
    }
    let _ = w.finalize();
    (e, after, next)
}

/// What is wrong in `results` (rank 0's and rank 1's, or one of them
/// alone, `(rank, seen)`) of [`disagreeing_pe`] under setup `what`: each
/// PE must fail with the same COLLECTIVE_MISMATCH naming the ranks and
/// sizes, rank 1's buffer must be untouched, and the agreeing exchange
/// after it must return exactly the new bytes.
pub fn disagreement_failures(
    what: &str,
    listed: Option<usize>,
    results: &[(usize, Disagreement)],
) -> Vec<String> {
    use xcall_core::Status;
    let listed_text = match listed {
        None => "which lists no segment from rank 0".to_string(),
        Some(b) => format!("which lists 1 segment of {b} bytes from rank 0"),
    };
    let mut wrong = Vec::new();
    for (rank, (e, _, _)) in results.iter().map(|(r, d)| (*r, d)) {
        match e {
            Ok(()) => wrong.push(format!("{what}: rank {rank} returned OK")),
            Err((status, msg)) => {
                if *status != Status::CollectiveMismatch
                    || !msg.contains("rank 0 sends 1 segment of 64 bytes to rank 1")
                    || !msg.contains(&listed_text)
                {
                    wrong.push(format!("{what}: rank {rank}: {status:?} {msg}"));
                }
            }
        }
    }
    if results.windows(2).any(|p| p[0].1 .0 != p[1].1 .0) {
        wrong.push(format!("{what}: the PEs returned different results"));
    }
    let bytes = listed.unwrap_or(64);
    for (rank, (_, after, next)) in results.iter().map(|(r, d)| (*r, d)) {
        match next {
            Err(e) => wrong.push(format!(
                "{what}: rank {rank}'s agreeing exchange after it failed: {e}"
            )),
            Ok(next) if rank == 1 => {
                if next[..bytes].iter().any(|&b| b != 2) || next[bytes..].iter().any(|&b| b != 0xAA)
                {
                    wrong.push(format!(
                        "{what}: the agreeing exchange after it did not return exactly the new bytes: {next:?}"
                    ));
                }
            }
            Ok(_) => {}
        }
        if rank == 1 && after.iter().any(|&b| b != 0xAA) {
            wrong.push(format!(
                "{what}: the disagreeing exchange wrote into rank 1's buffer: {after:?}"
            ));
        }
    }
    wrong
}
