//! The table of explored states.

use crate::error::PlanError;

/// The explored states, each stored once: one flat arena of u32 words,
/// where each state starts, and an open-addressing index of state ids
/// (compared word for word, never by hash alone). Ids are given in
/// discovery order, which is also the breadth-first order of the search.
pub(super) struct StateSet {
    arena: Vec<u32>,
    starts: Vec<u64>,
    /// `id + 1` per slot, 0 for empty; a power of two long.
    table: Vec<u32>,
}

pub(super) fn hash_words(s: &[u32]) -> u64 {
    // FNV-1a over the words: fixed, so a search is reproducible.
    s.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| {
        (h ^ u64::from(w)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl StateSet {
    pub(super) fn new() -> Self {
        StateSet {
            arena: Vec::new(),
            starts: vec![0],
            table: vec![0; 1024],
        }
    }

    pub(super) fn len(&self) -> usize {
        self.starts.len() - 1
    }

    pub(super) fn get(&self, id: u32) -> &[u32] {
        let (a, b) = (self.starts[id as usize], self.starts[id as usize + 1]);
        &self.arena[a as usize..b as usize]
    }

    /// Bytes held by the set's tables.
    pub(super) fn bytes(&self) -> u64 {
        (self.arena.capacity() * 4 + self.starts.capacity() * 8 + self.table.len() * 4) as u64
    }

    pub(super) fn slot_of(&self, s: &[u32]) -> (usize, Option<u32>) {
        let mask = self.table.len() - 1;
        let mut i = hash_words(s) as usize & mask;
        loop {
            match self.table[i] {
                0 => return (i, None),
                id if self.get(id - 1) == s => return (i, Some(id - 1)),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// The id of `s`, and whether it is new. Allocation failures are
    /// errors (the budget normally stops the search long before).
    pub(super) fn insert(&mut self, s: &[u32]) -> Result<(u32, bool), PlanError> {
        let (slot, found) = self.slot_of(s);
        if let Some(id) = found {
            return Ok((id, false));
        }
        let held = self.len();
        self.arena
            .try_reserve(s.len())
            .map_err(|_| PlanError::Limit(format!("no memory for a state past {held}")))?;
        self.starts
            .try_reserve(1)
            .map_err(|_| PlanError::Limit("no memory for the state list".into()))?;
        let id = self.len() as u32;
        self.arena.extend_from_slice(s);
        self.starts.push(self.arena.len() as u64);
        self.table[slot] = id + 1;
        if self.len() * 2 > self.table.len() {
            self.grow()?;
        }
        Ok((id, true))
    }

    pub(super) fn grow(&mut self) -> Result<(), PlanError> {
        let n = self.table.len() * 2;
        let mut table = Vec::new();
        table
            .try_reserve_exact(n)
            .map_err(|_| PlanError::Limit(format!("no memory for an index of {n} states")))?;
        table.resize(n, 0);
        let old = std::mem::replace(&mut self.table, table);
        for id in old.into_iter().filter(|&id| id != 0) {
            let (slot, _) = self.slot_of(self.get(id - 1));
            self.table[slot] = id;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn the_state_sets_bytes_count_every_table() {
        let mut set = StateSet::new();
        // Empty: one start offset (8 bytes) and the 1024-slot index.
        assert_eq!(set.bytes(), 8 + 1024 * 4);
        // 1000 states of 10 words each: at least the words themselves, one
        // start per state and an index of at least two slots per state.
        for i in 0..1000u32 {
            let state: Vec<u32> = (0..10).map(|w| i * 10 + w).collect();
            assert_eq!(set.insert(&state).unwrap(), (i, true));
        }
        assert_eq!(
            set.insert(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap(),
            (0, false)
        );
        let least = 1000 * 10 * 4 + 1001 * 8 + 2048 * 4;
        assert!(set.bytes() >= least, "{} < {least}", set.bytes());
        // ... and not wildly more (amortized growth at most doubles each).
        assert!(set.bytes() <= 2 * least, "{} > 2 x {least}", set.bytes());
    }
}
