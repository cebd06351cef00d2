//! The internal region at offset 0 of every heap, word by word: the
//! arrival words of barriers, the epoch and error words, the peer
//! pointers, the exchange words and the staged signal values.

use crate::heap::ALIGN;

/// Bytes reserved at offset 0 of every heap: `n` arrival words, the epoch
/// word, the error word, `n` peer pointers, `n` exchange words (one per
/// sender), [`STAGED_WORDS`] staged signal values. `n` is at most
/// [`MAX_PES`].
pub(super) fn internal_bytes(n: usize) -> usize {
    (8 * n + 16 + 8 * n + 8 * n + 8 * STAGED_WORDS).next_multiple_of(ALIGN)
}

/// The words that hold the values of signal words put through NCCL
/// ([`Live::stage_word`]), used in turn: a call's word is taken again
/// [`STAGED_WORDS`] calls later.
pub const STAGED_WORDS: usize = 64;

/// Offset of staged signal value `slot` in a heap, in a world of `n` PEs.
pub(super) fn staged_word(n: usize, slot: usize) -> u64 {
    (24 * n + 16 + 8 * slot) as u64
}

/// Offset of the exchange word that counts PE `from`'s exchanges into a
/// heap, in a world of `n` PEs.
pub(super) fn exchange_word(n: usize, from: usize) -> u64 {
    (16 * n + 16 + 8 * from) as u64
}

#[cfg(test)]
mod tests {
    use super::{exchange_word, internal_bytes, staged_word, STAGED_WORDS};
    use crate::heap::ALIGN;
    use crate::limits::MAX_PES;

    /// The internal region's layout, word by word: `n` arrival words, the
    /// epoch and error words, `n` peer pointers, `n` exchange words, then
    /// the staged signal values, each word once, all inside the region.
    #[test]
    fn every_internal_word_has_a_place_of_its_own() {
        for n in [1usize, 2, 3, 8, 1000, MAX_PES] {
            let mut words: Vec<u64> = (0..3 * n as u64 + 2).map(|i| 8 * i).collect();
            // The exchange words are the last n of the 3n + 2 before the
            // staged values.
            for from in 0..n {
                assert_eq!(exchange_word(n, from), 8 * (2 * n + 2 + from) as u64);
            }
            for slot in 0..STAGED_WORDS {
                words.push(staged_word(n, slot));
            }
            let end = internal_bytes(n) as u64;
            for (i, w) in words.iter().enumerate() {
                assert_eq!(*w, 8 * i as u64, "n {n}: word {i}");
                assert!(w + 8 <= end, "n {n}: word {i} at {w} past {end}");
            }
            assert_eq!(end % ALIGN as u64, 0);
            assert!(end < 8 * words.len() as u64 + ALIGN as u64, "n {n}: {end}");
        }
    }
}
