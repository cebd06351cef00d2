//! The symmetric heap's allocator: offsets in `[0, size)`, 256-byte
//! alignment, first fit, neighbours coalesced on free.
//!
//! Every PE runs the same allocator over its own heap. Because `malloc` and
//! `free` are collective (same order, same sizes on every PE, checked), the
//! allocators stay identical and an object has the same offset everywhere:
//! that is what makes the memory symmetric.

use std::collections::BTreeMap;

use crate::error::{Result, ShmemError};

/// Alignment (and granularity) of every allocation, in bytes.
pub const ALIGN: usize = 256;

/// First-fit allocator over `[0, size)`.
#[derive(Clone, Debug)]
pub struct Allocator {
    size: usize,
    /// Free blocks: offset -> length; never two adjacent ones.
    free: BTreeMap<usize, usize>,
    /// Live allocations: offset -> length (rounded up to [`ALIGN`]).
    used: BTreeMap<usize, usize>,
}

impl Allocator {
    /// An allocator over `size` bytes (rounded down to [`ALIGN`]).
    pub fn new(size: usize) -> Allocator {
        let size = size / ALIGN * ALIGN;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Allocator {
            size,
            free,
            used: BTreeMap::new(),
        }
    }

    /// The managed size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Total free bytes.
    pub fn free_bytes(&self) -> usize {
        self.free.values().sum()
    }

    /// The largest free block.
    pub fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }

    /// Live allocations as (offset, length), in offset order.
    pub fn live(&self) -> Vec<(usize, usize)> {
        self.used.iter().map(|(&o, &l)| (o, l)).collect()
    }

    /// The lowest-addressed free block that fits `bytes` (rounded up to
    /// [`ALIGN`]; 0 bytes take one granule so every object has its own
    /// address). Returns the offset.
    pub fn alloc(&mut self, bytes: usize) -> Result<usize> {
        let len = bytes
            .max(1)
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(|| ShmemError::InvalidArgument(format!("{bytes} bytes overflow")))?;
        let Some((&offset, &block)) = self.free.iter().find(|(_, &l)| l >= len) else {
            let (total, largest) = (self.free_bytes(), self.largest_free());
            let why = if total >= len {
                "fragmented: no single free block is large enough"
            } else {
                "exhausted"
            };
            return Err(ShmemError::OutOfMemory(format!(
                "{bytes} bytes requested ({len} aligned); heap of {} bytes {why}: {total} bytes free, largest free block {largest} bytes",
                self.size
            )));
        };
        self.free.remove(&offset);
        if block > len {
            self.free.insert(offset + len, block - len);
        }
        self.used.insert(offset, len);
        Ok(offset)
    }

    /// Frees the allocation at `offset`, merging it with free neighbours.
    pub fn free(&mut self, offset: usize) -> Result<usize> {
        let len = self.used.remove(&offset).ok_or_else(|| {
            ShmemError::InvalidArgument(format!(
                "offset {offset} is not the start of a live allocation (double free or not from malloc)"
            ))
        })?;
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&o, &l)) = self.free.range(..offset).next_back() {
            if o + l == start {
                self.free.remove(&o);
                start = o;
            }
        }
        if let Some(l) = self.free.remove(&end) {
            end += l;
        }
        self.free.insert(start, end - start);
        Ok(len)
    }

    /// The live allocation that contains `[offset, offset + bytes)`, if
    /// any, as (start, length).
    pub fn containing(&self, offset: usize, bytes: usize) -> Option<(usize, usize)> {
        let (&o, &l) = self.used.range(..=offset).next_back()?;
        (offset.checked_add(bytes)? <= o + l).then_some((o, l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The allocator against a byte map: every granule is free or owned,
    /// first fit by a linear scan.
    #[test]
    fn random_alloc_free_matches_a_granule_map() {
        let granules = 64;
        let mut a = Allocator::new(granules * ALIGN + 100);
        assert_eq!(a.size(), granules * ALIGN);
        let mut owner: Vec<Option<usize>> = vec![None; granules];
        let mut live: Vec<usize> = Vec::new();
        let mut g = xcall_core::testing::XorShift::new(9);
        for step in 0..5000 {
            if live.is_empty() || g.next_u64() % 3 != 0 {
                let want = (g.next_u64() % (6 * ALIGN as u64)) as usize;
                let n = want.max(1).div_ceil(ALIGN);
                let first_fit = (0..=granules - n.min(granules))
                    .find(|&s| n <= granules && owner[s..s + n].iter().all(Option::is_none));
                match (a.alloc(want), first_fit) {
                    (Ok(off), Some(s)) => {
                        assert_eq!(off, s * ALIGN, "step {step}: first fit");
                        owner[s..s + n].iter_mut().for_each(|o| *o = Some(off));
                        live.push(off);
                    }
                    (Err(ShmemError::OutOfMemory(_)), None) => {}
                    (got, want) => panic!("step {step}: {got:?} vs first fit {want:?}"),
                }
            } else {
                let off = live.swap_remove((g.next_u64() % live.len() as u64) as usize);
                a.free(off).unwrap();
                owner
                    .iter_mut()
                    .filter(|o| **o == Some(off))
                    .for_each(|o| *o = None);
            }
            let free_granules = owner.iter().filter(|o| o.is_none()).count();
            assert_eq!(a.free_bytes(), free_granules * ALIGN);
            // Coalesced: the number of free blocks is the number of free runs.
            let runs = (0..granules)
                .filter(|&i| owner[i].is_none() && (i == 0 || owner[i - 1].is_some()))
                .count();
            assert_eq!(a.free.len(), runs, "step {step}: free blocks not coalesced");
        }
    }

    #[test]
    fn exhaustion_and_fragmentation_are_told_apart() {
        let mut a = Allocator::new(4 * ALIGN);
        let x: Vec<usize> = (0..4).map(|_| a.alloc(ALIGN).unwrap()).collect();
        assert_eq!(x, vec![0, 256, 512, 768]);
        let e = a.alloc(1).unwrap_err().to_string();
        assert!(e.contains("exhausted") && e.contains("0 bytes free"), "{e}");
        a.free(x[0]).unwrap();
        a.free(x[2]).unwrap();
        let e = a.alloc(2 * ALIGN).unwrap_err().to_string();
        assert!(
            e.contains("fragmented") && e.contains("512 bytes free"),
            "{e}"
        );
        a.free(x[1]).unwrap();
        // 0..768 is one block now.
        assert_eq!(a.largest_free(), 3 * ALIGN);
        assert_eq!(a.alloc(3 * ALIGN).unwrap(), 0);
        assert!(matches!(a.free(5), Err(ShmemError::InvalidArgument(_))));
        assert!(a.free(0).is_ok());
        assert!(a.free(0).is_err(), "double free is refused");
        assert!(Allocator::new(100).alloc(1).is_err());
        assert!(a.alloc(usize::MAX).is_err());
    }

    #[test]
    fn containing_finds_the_allocation() {
        let mut a = Allocator::new(8 * ALIGN);
        let x = a.alloc(300).unwrap();
        let y = a.alloc(10).unwrap();
        assert_eq!(a.containing(x + 100, 412), Some((x, 512)));
        assert_eq!(a.containing(x + 100, 413), None);
        assert_eq!(a.containing(y, 256), Some((y, 256)));
        assert_eq!(a.containing(y + 256, 1), None);
    }
}
