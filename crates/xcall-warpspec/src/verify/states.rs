//! The table of explored states: each state packed into a few bytes, its
//! parent in the search tree, and an index, all within a byte budget that
//! is checked before every allocation.

/// The explored states, each stored once, packed (see [`pack`]) into one
/// flat byte arena; where each state starts; the search tree (each state's
/// parent and the event from it); and an open-addressing index of state
/// ids (compared byte for byte, never by hash alone). Ids are given in
/// discovery order, which is also the breadth-first order of the search.
///
/// Every table grows only after [`StateSet::insert`] has checked that the
/// capacity after the growth keeps all of them within `limit` bytes, so the
/// tables never hold more than the budget.
pub(super) struct StateSet {
    /// The words a state is packed against (the initial state).
    reference: Vec<u32>,
    arena: Vec<u8>,
    starts: Vec<u64>,
    /// `parent id << 32 | event code` per state (`u64::MAX` for the root).
    parents: Vec<u64>,
    /// `id + 1` per slot, 0 for empty; a power of two long.
    table: Vec<u32>,
    limit: u64,
    /// Scratch for the packed form of the state being looked up.
    packed: Vec<u8>,
}

/// Why a state could not be added.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Full {
    /// Growing a table would pass the byte limit.
    Budget,
    /// The allocator refused the growth.
    Allocation,
}

pub(super) fn hash_bytes(s: &[u8]) -> u64 {
    // FNV-1a over the bytes: fixed, so a search is reproducible.
    s.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| {
        (h ^ u64::from(w)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn put_varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push((x as u8) | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

fn get_varint(s: &[u8], at: &mut usize) -> u64 {
    let (mut x, mut shift) = (0u64, 0);
    loop {
        let b = s[*at];
        *at += 1;
        x |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return x;
        }
        shift += 7;
    }
}

/// Packs `s` into `out`: each word as its difference from the reference
/// word at the same place (0 past the reference's end), zigzag-coded, and
/// every run of unchanged words as one token. A state is mostly barriers
/// at rest and buffers untouched, so most words cost nothing; an in-flight
/// copy costs at most 5 bytes. The packing is one-to-one, so packed states
/// are compared as bytes.
pub(super) fn pack(reference: &[u32], s: &[u32], out: &mut Vec<u8>) {
    out.clear();
    let mut run = 0u64;
    for (k, &w) in s.iter().enumerate() {
        let d = w.wrapping_sub(reference.get(k).copied().unwrap_or(0)) as i32;
        if d == 0 {
            run += 1;
            continue;
        }
        if run > 0 {
            put_varint(out, (run - 1) << 1 | 1);
            run = 0;
        }
        let zigzag = ((d << 1) ^ (d >> 31)) as u32;
        put_varint(out, u64::from(zigzag) << 1);
    }
    if run > 0 {
        put_varint(out, (run - 1) << 1 | 1);
    }
}

/// The words of a packed state.
pub(super) fn unpack(reference: &[u32], p: &[u8], out: &mut Vec<u32>) {
    out.clear();
    let mut at = 0;
    let base = |k: usize| reference.get(k).copied().unwrap_or(0);
    while at < p.len() {
        let t = get_varint(p, &mut at);
        if t & 1 == 1 {
            for _ in 0..=(t >> 1) {
                out.push(base(out.len()));
            }
        } else {
            let z = (t >> 1) as u32;
            let d = ((z >> 1) as i32) ^ -((z & 1) as i32);
            out.push(base(out.len()).wrapping_add(d as u32));
        }
    }
}

/// The capacity a table grows to when it needs `need` elements: 1.5 times
/// the old one, at least `need`.
fn grown(capacity: usize, need: usize) -> usize {
    need.max(capacity + capacity / 2).max(64)
}

impl StateSet {
    /// An empty set whose tables may hold at most `limit` bytes.
    pub(super) fn new(reference: Vec<u32>, limit: u64) -> Self {
        StateSet {
            reference,
            arena: Vec::new(),
            starts: vec![0],
            parents: Vec::new(),
            table: vec![0; 1024],
            limit,
            packed: Vec::new(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// The words of state `id`, into `out`.
    pub(super) fn get(&self, id: u32, out: &mut Vec<u32>) {
        let (a, b) = (self.starts[id as usize], self.starts[id as usize + 1]);
        unpack(&self.reference, &self.arena[a as usize..b as usize], out);
    }

    fn packed_of(&self, id: u32) -> &[u8] {
        let (a, b) = (self.starts[id as usize], self.starts[id as usize + 1]);
        &self.arena[a as usize..b as usize]
    }

    /// The parent of state `id` and the event code from it (`None` for the
    /// initial state).
    pub(super) fn parent(&self, id: u32) -> Option<(u32, u32)> {
        let p = self.parents[id as usize];
        (p != u64::MAX).then_some(((p >> 32) as u32, p as u32))
    }

    /// Bytes held by the set's tables (their capacities).
    pub(super) fn bytes(&self) -> u64 {
        (self.arena.capacity()
            + self.starts.capacity() * 8
            + self.parents.capacity() * 8
            + self.table.len() * 4) as u64
    }

    fn slot_of_packed(&self) -> (usize, Option<u32>) {
        let mask = self.table.len() - 1;
        let mut i = hash_bytes(&self.packed) as usize & mask;
        loop {
            match self.table[i] {
                0 => return (i, None),
                id if self.packed_of(id - 1) == self.packed.as_slice() => return (i, Some(id - 1)),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Whether `s` is already in the set.
    pub(super) fn contains(&mut self, s: &[u32]) -> bool {
        let mut packed = std::mem::take(&mut self.packed);
        pack(&self.reference, s, &mut packed);
        self.packed = packed;
        self.slot_of_packed().1.is_some()
    }

    /// The id of `s`, and whether it is new; a new state records `parent`
    /// (`None` for the root). Before any table grows, the bytes all of them
    /// would hold after the growth are checked against the limit.
    pub(super) fn insert(
        &mut self,
        s: &[u32],
        parent: Option<(u32, u32)>,
    ) -> Result<(u32, bool), Full> {
        let mut packed = std::mem::take(&mut self.packed);
        pack(&self.reference, s, &mut packed);
        self.packed = packed;
        let (slot, found) = self.slot_of_packed();
        if let Some(id) = found {
            return Ok((id, false));
        }
        // The growth this insertion needs, in bytes, before any of it.
        let n = self.packed.len();
        let arena_to = if self.arena.len() + n > self.arena.capacity() {
            grown(self.arena.capacity(), self.arena.len() + n)
        } else {
            self.arena.capacity()
        };
        let starts_to = if self.starts.len() == self.starts.capacity() {
            grown(self.starts.capacity(), self.starts.len() + 1)
        } else {
            self.starts.capacity()
        };
        let parents_to = if self.parents.len() == self.parents.capacity() {
            grown(self.parents.capacity(), self.parents.len() + 1)
        } else {
            self.parents.capacity()
        };
        let table_to = if (self.len() + 1) * 2 > self.table.len() {
            self.table.len() * 2
        } else {
            self.table.len()
        };
        let after = (arena_to + starts_to * 8 + parents_to * 8 + table_to * 4) as u64;
        if after > self.limit {
            return Err(Full::Budget);
        }
        self.arena
            .try_reserve_exact(arena_to - self.arena.len())
            .map_err(|_| Full::Allocation)?;
        self.starts
            .try_reserve_exact(starts_to - self.starts.len())
            .map_err(|_| Full::Allocation)?;
        self.parents
            .try_reserve_exact(parents_to - self.parents.len())
            .map_err(|_| Full::Allocation)?;
        let id = self.len() as u32;
        self.arena.extend_from_slice(&self.packed);
        self.starts.push(self.arena.len() as u64);
        self.parents.push(match parent {
            Some((p, e)) => u64::from(p) << 32 | u64::from(e),
            None => u64::MAX,
        });
        self.table[slot] = id + 1;
        if table_to != self.table.len() {
            self.grow(table_to)?;
        }
        Ok((id, true))
    }

    fn grow(&mut self, n: usize) -> Result<(), Full> {
        let mut table = Vec::new();
        table.try_reserve_exact(n).map_err(|_| Full::Allocation)?;
        table.resize(n, 0);
        let old = std::mem::replace(&mut self.table, table);
        let mask = n - 1;
        for id in old.into_iter().filter(|&id| id != 0) {
            let mut i = hash_bytes(self.packed_of(id - 1)) as usize & mask;
            while self.table[i] != 0 {
                i = (i + 1) & mask;
            }
            self.table[i] = id;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_is_one_to_one_and_small() {
        let reference = vec![0, 0, 5, 1, 0, 7, u32::MAX, 0, 0];
        let states: [&[u32]; 5] = [
            &[0, 0, 5, 1, 0, 7, u32::MAX, 0, 0],
            &[3, 0, 4, 1, 0, 7, 2, 1, 0, 0x0102_0304, 9],
            &[0, 0, 5, 1, 0, 7, u32::MAX, 0, 0, 0],
            &[u32::MAX, 0x8000_0000, 5, 1, 0, 7, u32::MAX, 0, 0x7fff_ffff],
            &[],
        ];
        let (mut p, mut back) = (Vec::new(), Vec::new());
        let mut seen = std::collections::HashSet::new();
        for s in states {
            pack(&reference, s, &mut p);
            unpack(&reference, &p, &mut back);
            assert_eq!(back, s);
            assert!(seen.insert(p.clone()), "two states, one packing");
        }
        pack(&reference, &reference, &mut p);
        assert_eq!(p.len(), 1, "the reference is one run");
    }

    #[test]
    fn the_state_sets_bytes_count_every_table() {
        let mut set = StateSet::new(vec![0; 10], u64::MAX);
        // Empty: one start offset (8 bytes) and the 1024-slot index.
        assert_eq!(set.bytes(), 8 + 1024 * 4);
        // 1000 states of 10 words each: at least their packed bytes, one
        // start and one parent per state and an index of at least two slots
        // per state.
        let mut packed = 0;
        let mut p = Vec::new();
        for i in 0..1000u32 {
            let state: Vec<u32> = (0..10).map(|w| i * 10 + w).collect();
            pack(&[0; 10], &state, &mut p);
            packed += p.len();
            let parent = i.checked_sub(1).map(|p| (p, 7));
            assert_eq!(set.insert(&state, parent).unwrap(), (i, true));
        }
        assert_eq!(
            set.insert(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], None),
            Ok((0, false))
        );
        assert_eq!(set.parent(0), None);
        assert_eq!(set.parent(5), Some((4, 7)));
        let mut back = Vec::new();
        set.get(999, &mut back);
        assert_eq!(back, (0..10).map(|w| 9990 + w).collect::<Vec<u32>>());
        let least = (packed + 1001 * 8 + 1000 * 8 + 2048 * 4) as u64;
        assert!(set.bytes() >= least, "{} < {least}", set.bytes());
        // ... and not wildly more (amortized growth at most doubles each).
        assert!(set.bytes() <= 2 * least, "{} > 2 x {least}", set.bytes());
    }

    #[test]
    fn the_limit_is_checked_before_a_table_grows() {
        // Fill until the set refuses: its tables never held more than the
        // limit, at any point, and it refuses with a budget error.
        let limit = 64 << 10;
        let mut set = StateSet::new(vec![0; 8], limit);
        let mut refused = None;
        for i in 0..100_000u32 {
            let state: Vec<u32> = (0..8).map(|w| i.wrapping_mul(2_654_435_761) ^ w).collect();
            match set.insert(&state, None) {
                Ok(_) => assert!(set.bytes() <= limit, "{} > {limit}", set.bytes()),
                Err(e) => {
                    refused = Some((i, e));
                    break;
                }
            }
        }
        let (at, why) = refused.expect("the limit stops the set");
        assert_eq!(why, Full::Budget);
        assert!(set.bytes() <= limit);
        assert!(at > 100, "refused only near the limit: {at}");
    }
}
