//! The host-side collectives of a live world through its bootstrap: the
//! checked collective calls (malloc, free, barrier_all, finalize), and
//! allgather; and how a disagreement between PEs is described.

use super::agreement::fields;
use super::live::Live;
use crate::error::{Result, ShmemError};
use crate::limits::MAX_GATHER_BYTES;

impl Live {
    /// Checks that every PE makes the same collective call: (what, seq,
    /// argument) must be equal everywhere; a difference is reported on
    /// every PE with every PE's call.
    pub(super) fn collective(&mut self, what: &str, arg: u64) -> Result<()> {
        // A failed world has a PE that will never come.
        self.state.check()?;
        let seq = self.seq;
        self.seq += 1;
        let mine = format!("{what}\n{seq}\n{arg}");
        let all = self.boot.allgather(mine.as_bytes())?;
        if all.iter().all(|a| a == mine.as_bytes()) {
            return Ok(());
        }
        Err(disagreement(seq, &all))
    }

    /// Every PE's `data` (at most [`MAX_GATHER_BYTES`]) through the
    /// bootstrap, as a collective: a PE in another collective is a
    /// mismatch, and a PE offering too much makes every PE fail naming it.
    /// `offered` bytes, `data` when they fit (see
    /// [`World::allgather_offered`]).
    pub(super) fn allgather(&mut self, offered: u64, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let fits = offered <= MAX_GATHER_BYTES as u64;
        if fits && data.len() as u64 != offered {
            return Err(ShmemError::InvalidArgument(format!(
                "allgather offers {offered} bytes with {} bytes of data",
                data.len()
            )));
        }
        self.state.check()?;
        let seq = self.seq;
        self.seq += 1;
        let mut mine = format!("allgather\n{seq}\n{offered}\n").into_bytes();
        if fits {
            mine.extend_from_slice(data);
        }
        let all = self.boot.allgather(&mine)?;
        // (bytes offered, where the data starts) of an allgather #seq.
        let head = |a: &[u8]| -> Option<(usize, usize)> {
            let record = call_record(a);
            if record.len() == a.len() {
                return None;
            }
            match fields(record).as_slice() {
                [w, s, n] if w == "allgather" && *s == seq.to_string() => {
                    Some((n.parse().ok()?, record.len() + 1))
                }
                _ => None,
            }
        };
        let mut out = Vec::with_capacity(all.len());
        for (r, a) in all.iter().enumerate() {
            let Some((n, at)) = head(a) else {
                return Err(disagreement(seq, &all));
            };
            if n > MAX_GATHER_BYTES {
                return Err(ShmemError::InvalidArgument(format!(
                    "rank {r} offered {n} bytes to allgather #{seq}; at most {MAX_GATHER_BYTES} bytes per PE"
                )));
            }
            if a.len() - at != n {
                return Err(ShmemError::Mismatch(format!(
                    "rank {r}'s allgather #{seq} record is malformed"
                )));
            }
            out.push(a[at..].to_vec());
        }
        Ok(out)
    }
}

/// A collective's record without its data: up to the third line break
/// (`what\nseq\narg`), or all of it.
pub(super) fn call_record(record: &[u8]) -> &[u8] {
    let mut breaks = record.iter().enumerate().filter(|(_, &b)| b == b'\n');
    match breaks.nth(2) {
        Some((i, _)) => &record[..i],
        None => record,
    }
}

/// The error of collective call `seq` whose PEs made the calls `all`.
pub(super) fn disagreement(seq: u64, all: &[Vec<u8>]) -> ShmemError {
    let calls: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(r, a)| format!("rank {r}: {}", describe_call(call_record(a))))
        .collect();
    ShmemError::Mismatch(format!(
        "PEs disagree in collective call #{seq} (malloc, free, barrier_all, allgather, exchange and finalize must be called in the same order with the same sizes on every PE): {}",
        calls.join("; ")
    ))
}

/// One PE's collective call as the others see it ("malloc #3 of 4096
/// bytes"), from its `what\nseq\narg` record.
pub(super) fn describe_call(record: &[u8]) -> String {
    let f = fields(record);
    let (what, seq, arg) = match f.as_slice() {
        [w, s, a] => (w.as_str(), s.as_str(), a.as_str()),
        _ => {
            return "a call that is not malloc, free, barrier_all, allgather, exchange or finalize"
                .into()
        }
    };
    match what {
        "malloc" => format!("malloc #{seq} of {arg} bytes"),
        "free" if arg == u64::MAX.to_string() => {
            format!("free #{seq} of an address outside the heap")
        }
        "free" => format!("free #{seq} of offset {arg}"),
        "allgather" => format!("allgather #{seq} of {arg} bytes"),
        "exchange" => format!("exchange #{seq} of {arg} segments"),
        _ => format!("{what} #{seq}"),
    }
}
