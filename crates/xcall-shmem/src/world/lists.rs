//! The agreement that opens every exchange: each PE's lists of outgoing
//! and incoming segments, summed per peer, are gathered before anything
//! moves, and every PE reaches the same verdict from the same records.
//! A pair whose lists disagree (a segment only one side lists, other
//! sizes, other destinations, another order) fails the exchange on every
//! PE with [`ShmemError::Mismatch`] naming the ranks and sizes, and
//! nothing is written: no copy lands outside what its receiver listed,
//! and no arrival is counted for a later exchange.

use std::collections::BTreeMap;

use crate::error::{Result, ShmemError};

/// The most disagreeing pairs one message names; the rest are counted.
const NAMED_PAIRS: usize = 8;

/// One direction of one pair: how many segments, their bytes, and a
/// digest of their (heap offset, bytes) in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Side {
    segments: u64,
    bytes: u64,
    digest: u64,
}

impl Side {
    fn add(&mut self, offset: u64, bytes: usize) {
        self.segments += 1;
        self.bytes = self.bytes.saturating_add(bytes as u64);
        // FNV-1a over the segment's offset and length, chained in order.
        let mut h = self.digest ^ 0xcbf2_9ce4_8422_2325;
        for b in offset
            .to_le_bytes()
            .into_iter()
            .chain((bytes as u64).to_le_bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        self.digest = h;
    }

    /// "1 segment of 64 bytes", "no segment".
    fn describe(&self) -> String {
        match self.segments {
            0 => "no segment".into(),
            1 => format!("1 segment of {} bytes", self.bytes),
            s => format!("{s} segments of {} bytes", self.bytes),
        }
    }
}

/// One PE's exchange lists, summed per peer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Lists {
    outgoing: BTreeMap<usize, Side>,
    incoming: BTreeMap<usize, Side>,
}

impl Lists {
    /// A segment to PE `pe`, landing at heap offset `offset`.
    pub(super) fn send(&mut self, pe: usize, offset: u64, bytes: usize) {
        self.outgoing.entry(pe).or_default().add(offset, bytes);
    }

    /// A segment from PE `pe`, landing at heap offset `offset`.
    pub(super) fn receive(&mut self, pe: usize, offset: u64, bytes: usize) {
        self.incoming.entry(pe).or_default().add(offset, bytes);
    }

    /// Lines `o PE SEGMENTS BYTES DIGEST` and `i ...`.
    pub(super) fn encode(&self) -> String {
        let mut s = String::new();
        for (tag, map) in [("o", &self.outgoing), ("i", &self.incoming)] {
            for (pe, side) in map {
                s.push_str(&format!(
                    "{tag} {pe} {} {} {}\n",
                    side.segments, side.bytes, side.digest
                ));
            }
        }
        s
    }

    /// The lists [`Lists::encode`] wrote, or `None` when malformed.
    pub(super) fn decode(text: &str) -> Option<Lists> {
        let mut lists = Lists::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            let [tag, pe, segments, bytes, digest] = f.as_slice() else {
                return None;
            };
            let side = Side {
                segments: segments.parse().ok()?,
                bytes: bytes.parse().ok()?,
                digest: digest.parse().ok()?,
            };
            let map = match *tag {
                "o" => &mut lists.outgoing,
                "i" => &mut lists.incoming,
                _ => return None,
            };
            map.insert(pe.parse().ok()?, side);
        }
        Some(lists)
    }
}

/// The verdict of exchange `seq` whose PEs listed `all` (indexed by
/// rank): `Ok` when, for every pair, what the sender lists to the
/// receiver is what the receiver lists from the sender; otherwise the
/// disagreeing pairs, by rank and size. Every PE computes it alike.
pub(super) fn verdict(seq: u64, all: &[Lists]) -> Result<()> {
    let n = all.len();
    let mut pairs: BTreeMap<(usize, usize), (Side, Side)> = BTreeMap::new();
    for (from, l) in all.iter().enumerate() {
        for (&to, side) in &l.outgoing {
            pairs.entry((from, to)).or_default().0 = *side;
        }
    }
    for (to, l) in all.iter().enumerate() {
        for (&from, side) in &l.incoming {
            pairs.entry((from, to)).or_default().1 = *side;
        }
    }
    let mut named = Vec::new();
    let mut more = 0usize;
    for (&(from, to), (sent, listed)) in &pairs {
        if sent == listed {
            continue;
        }
        if named.len() == NAMED_PAIRS {
            more += 1;
            continue;
        }
        let at = if from >= n || to >= n {
            " (a PE outside the world)"
        } else if sent.segments == listed.segments && sent.bytes == listed.bytes {
            " at other destinations or in another order"
        } else {
            ""
        };
        named.push(format!(
            "rank {from} sends {} to rank {to}, which lists {} from rank {from}{at}",
            sent.describe(),
            listed.describe()
        ));
    }
    if named.is_empty() {
        return Ok(());
    }
    if more > 0 {
        named.push(format!("and {more} more pair(s)"));
    }
    Err(ShmemError::Mismatch(format!(
        "the PEs' lists disagree in exchange #{seq} (PE a lists a segment to b exactly when b lists one from a, with the same bytes and destination, in the same order); nothing moved: {}",
        named.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::{verdict, Lists, NAMED_PAIRS};

    fn lists(out: &[(usize, u64, usize)], inc: &[(usize, u64, usize)]) -> Lists {
        let mut l = Lists::default();
        for &(pe, o, b) in out {
            l.send(pe, o, b);
        }
        for &(pe, o, b) in inc {
            l.receive(pe, o, b);
        }
        l
    }

    #[test]
    fn lists_round_trip_through_their_text() {
        let l = lists(&[(1, 4096, 64), (1, 8192, 3), (0, 0, 0)], &[(2, 64, 9)]);
        assert_eq!(Lists::decode(&l.encode()), Some(l));
        assert_eq!(Lists::decode("o 1 2 3"), None);
        assert_eq!(Lists::decode("x 1 2 3 4"), None);
        assert_eq!(Lists::decode(""), Some(Lists::default()));
    }

    #[test]
    fn lists_that_agree_pass() {
        let a = lists(&[(1, 4096, 64), (1, 8192, 8), (0, 0, 4)], &[(0, 0, 4)]);
        let b = lists(&[], &[(0, 4096, 64), (0, 8192, 8)]);
        verdict(3, &[a, b]).unwrap();
        verdict(0, &[Lists::default(), Lists::default()]).unwrap();
    }

    /// Every kind of disagreement is named with its ranks and sizes.
    #[test]
    fn each_disagreement_names_the_pair_and_sizes() {
        let sends = lists(&[(1, 4096, 64)], &[]);
        let cases = [
            (lists(&[], &[]), "which lists no segment from rank 0"),
            (
                lists(&[], &[(0, 4096, 32)]),
                "which lists 1 segment of 32 bytes from rank 0",
            ),
            (
                lists(&[], &[(0, 8192, 64)]),
                "at other destinations or in another order",
            ),
            (
                lists(&[], &[(0, 4096, 32), (0, 4128, 32)]),
                "which lists 2 segments of 64 bytes",
            ),
        ];
        for (receiver, want) in cases {
            let e = verdict(7, &[sends.clone(), receiver]).unwrap_err();
            let msg = e.to_string();
            assert_eq!(e.status(), xcall_core::Status::CollectiveMismatch);
            assert!(msg.contains("exchange #7"), "{msg}");
            assert!(
                msg.contains("rank 0 sends 1 segment of 64 bytes to rank 1"),
                "{msg}"
            );
            assert!(msg.contains(want), "{want}: {msg}");
        }
        // Two segments swapped between the same pair.
        let a = lists(&[(1, 0, 8), (1, 64, 8)], &[]);
        let b = lists(&[], &[(0, 64, 8), (0, 0, 8)]);
        let e = verdict(0, &[a, b]).unwrap_err();
        assert!(e.to_string().contains("another order"), "{e}");
        // A receive nobody sends.
        let e = verdict(0, &[Lists::default(), lists(&[], &[(0, 0, 8)])]).unwrap_err();
        assert!(
            e.to_string()
                .contains("rank 0 sends no segment to rank 1, which lists 1 segment of 8 bytes"),
            "{e}"
        );
    }

    #[test]
    fn a_long_verdict_names_a_few_pairs_and_counts_the_rest() {
        let n = 20;
        let all: Vec<Lists> = (0..n).map(|r| lists(&[((r + 1) % n, 0, 8)], &[])).collect();
        let msg = verdict(0, &all).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("and {} more pair(s)", n - NAMED_PAIRS)),
            "{msg}"
        );
    }
}
