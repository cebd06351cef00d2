//! The exact call key: (platform, device, target, attributes, buffers).
//!
//! Keys are stored and compared in full, attributes included (their bytes,
//! not only their digest). A hash only picks the bucket, so a hash or
//! digest collision can never replay another call's graph (a graph
//! recorded for other attributes, other buffers or another device would
//! compute something else or read and write them); that is also why a
//! fast non-cryptographic hash (FxHash) is enough here.

use std::hash::{Hash, Hasher};

use rustc_hash::FxHasher;

use xcall_core::{Device, Error, Result};

/// How a call uses a buffer.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferRole {
    /// Read only.
    In = 0,
    /// Written only.
    Out = 1,
    /// Read and written.
    InOut = 2,
}

xcall_core::c_enum!(BufferRole, "role", [In, Out, InOut]);

/// One buffer of a call: device address, size in bytes and role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// Device address (0 only for an empty buffer).
    pub address: u64,
    /// Size in bytes (0 allowed: an empty tensor).
    pub bytes: u64,
    /// How the call uses it.
    pub role: BufferRole,
}

impl Buffer {
    /// A buffer of `bytes` at `address` used as `role`.
    pub fn new(address: u64, bytes: u64, role: BufferRole) -> Buffer {
        Buffer {
            address,
            bytes,
            role,
        }
    }

    /// Whether the buffer shares at least one byte with `[address, address + bytes)`.
    pub fn overlaps(&self, address: u64, bytes: u64) -> bool {
        ranges_overlap(self.address, self.bytes, address, bytes)
    }
}

/// Whether `[a, a + a_len)` and `[b, b + b_len)` share a byte. Empty ranges
/// share nothing. Ends are computed in 128 bits, so no range wraps.
pub fn ranges_overlap(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    let (a, a_end) = (a as u128, a as u128 + a_len as u128);
    let (b, b_end) = (b as u128, b as u128 + b_len as u128);
    a_len > 0 && b_len > 0 && a < b_end && b < a_end
}

/// A call's attributes as its key holds them: a 64-bit digest that picks
/// the bucket and the bytes that are compared in full.
///
/// Two forms, never equal to each other: a [word](Attributes::word) (the
/// caller's own 64-bit value is the whole identity: compared as given) and
/// [bytes](Attributes::from_bytes) (canonical bytes of the attributes,
/// their digest computed or [given](Attributes::with_digest)). Equal
/// attributes always have equal digests; equal digests decide nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attributes(Repr);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Repr {
    Word(u64),
    Bytes { digest: u64, bytes: Box<[u8]> },
}

impl Attributes {
    /// Attributes that are one 64-bit value, compared as given (a caller's
    /// own digest it vouches for; the C ABI's `attributes` field).
    pub const fn word(value: u64) -> Attributes {
        Attributes(Repr::Word(value))
    }

    /// Attributes given as canonical bytes (equal attributes, equal
    /// bytes), compared in full; the digest is their hash.
    pub fn from_bytes(bytes: impl Into<Box<[u8]>>) -> Attributes {
        let bytes = bytes.into();
        let mut h = FxHasher::default();
        bytes.hash(&mut h);
        Attributes::with_digest(h.finish(), bytes)
    }

    /// [`from_bytes`](Attributes::from_bytes) with a digest the caller
    /// chose: it only picks buckets (a digest shared by other bytes is a
    /// collision the full comparison resolves).
    pub fn with_digest(digest: u64, bytes: impl Into<Box<[u8]>>) -> Attributes {
        Attributes(Repr::Bytes {
            digest,
            bytes: bytes.into(),
        })
    }

    /// Named integer attributes (an XLA call's, say; names unique) in
    /// canonical form: sorted by name, each as its name's length (u32),
    /// the name's bytes and the value (i64), little-endian. The order the
    /// call lists them in does not matter.
    pub fn named_ints<N: AsRef<str>>(attributes: &[(N, i64)]) -> Attributes {
        let mut sorted: Vec<(&str, i64)> =
            attributes.iter().map(|(n, v)| (n.as_ref(), *v)).collect();
        sorted.sort_unstable();
        let mut bytes = Vec::with_capacity(sorted.iter().map(|(n, _)| 12 + n.len()).sum());
        for (name, value) in sorted {
            // A name is at most a few dozen bytes: u32 holds its length.
            bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
            bytes.extend_from_slice(name.as_bytes());
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        Attributes::from_bytes(bytes)
    }

    /// The digest: what picks the bucket and what log lines show.
    pub fn digest(&self) -> u64 {
        match &self.0 {
            Repr::Word(value) => *value,
            Repr::Bytes { digest, .. } => *digest,
        }
    }
}

impl Attributes {
    /// The bytes compared in full; `None` for a [word](Attributes::word).
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.0 {
            Repr::Word(_) => None,
            Repr::Bytes { bytes, .. } => Some(bytes),
        }
    }
}

impl From<u64> for Attributes {
    fn from(value: u64) -> Attributes {
        Attributes::word(value)
    }
}

impl Hash for Attributes {
    /// The digest only: equal attributes have equal digests.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.digest().hash(state);
    }
}

/// The full identity of a custom call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CallKey {
    /// Platform and device ordinal.
    pub device: Device,
    /// Identifies the custom call target (for example a hash of its name,
    /// chosen by the caller; compared as given).
    pub target: u64,
    /// The call's attributes (compared in full).
    pub attributes: Attributes,
    /// The buffers, in the call's order.
    pub buffers: Vec<Buffer>,
}

impl CallKey {
    /// Checks what the cache relies on: at least one buffer (without a buffer
    /// list, `invalidate_range` could not find the graph before its memory is
    /// freed) and no buffer that wraps the address space.
    pub fn validate(&self) -> Result<()> {
        if self.buffers.is_empty() {
            return Err(Error::InvalidArgument(
                "a call must name at least one buffer: graphs are invalidated by the memory they use".into(),
            ));
        }
        for (i, b) in self.buffers.iter().enumerate() {
            if b.address.checked_add(b.bytes).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "buffer {i} at {:#x} with {} bytes runs past the end of the address space",
                    b.address, b.bytes
                )));
            }
        }
        Ok(())
    }

    /// Bucket of the exact key.
    pub(crate) fn bucket(&self) -> u64 {
        let mut h = FxHasher::default();
        self.hash(&mut h);
        h.finish()
    }

    /// Bucket of the key without buffer addresses.
    pub(crate) fn topology_bucket(&self) -> u64 {
        let mut h = FxHasher::default();
        (self.device, self.target, &self.attributes).hash(&mut h);
        for b in &self.buffers {
            (b.bytes, b.role).hash(&mut h);
        }
        h.finish()
    }

    /// Whether `self` and `other` differ at most in buffer addresses.
    pub fn same_topology(&self, other: &CallKey) -> bool {
        self.device == other.device
            && self.target == other.target
            && self.attributes == other.attributes
            && self.buffers.len() == other.buffers.len()
            && self
                .buffers
                .iter()
                .zip(&other.buffers)
                .all(|(a, b)| a.bytes == b.bytes && a.role == b.role)
    }

    /// Whether any buffer overlaps `[address, address + bytes)`.
    pub fn overlaps(&self, address: u64, bytes: u64) -> bool {
        self.buffers.iter().any(|b| b.overlaps(address, bytes))
    }
}

/// Alignment a relocated buffer keeps: kernels chosen for an address
/// (vector widths up to 16 bytes, 128-byte rows) stay valid when the new
/// address has the old one's remainder modulo this.
pub const RELOCATION_ALIGN: u64 = 256;

/// How device pointers into one call's buffers move to the same places in
/// another call of the same topology: a pointer into buffer `i` of the old
/// key goes to the same offset in buffer `i` of the new key; a pointer into
/// no buffer (0, a scratch buffer the op owns) stays as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relocation {
    /// (old address, bytes, new address) per non-empty buffer.
    moves: Vec<(u64, u64, u64)>,
}

impl Relocation {
    /// The relocation from `old` to `new`, or `None` where moving pointers
    /// cannot stand for running the op again on the new buffers: a
    /// different topology, a buffer whose address changes its remainder
    /// modulo [`RELOCATION_ALIGN`] (the op may have chosen its kernel by
    /// alignment), or a pair of buffers placed differently relative to each
    /// other (overlapping in one key and not the other, or overlapping at
    /// another offset: the op may refuse aliasing or treat it specially).
    pub fn between(old: &CallKey, new: &CallKey) -> Option<Relocation> {
        if !old.same_topology(new) {
            return None;
        }
        let pairs: Vec<(&Buffer, &Buffer)> = old.buffers.iter().zip(&new.buffers).collect();
        for (o, n) in &pairs {
            if o.address % RELOCATION_ALIGN != n.address % RELOCATION_ALIGN {
                return None;
            }
        }
        for (i, (oi, ni)) in pairs.iter().enumerate() {
            for (oj, nj) in &pairs[i + 1..] {
                let old_overlap = oi.overlaps(oj.address, oj.bytes);
                let new_overlap = ni.overlaps(nj.address, nj.bytes);
                let same_offset =
                    oi.address.wrapping_sub(oj.address) == ni.address.wrapping_sub(nj.address);
                if old_overlap != new_overlap || (old_overlap && !same_offset) {
                    return None;
                }
            }
        }
        Some(Relocation {
            moves: pairs
                .iter()
                .filter(|(o, _)| o.bytes > 0)
                .map(|(o, n)| (o.address, o.bytes, n.address))
                .collect(),
        })
    }

    /// Where the pointer `p` goes. Buffers that overlap keep their offsets
    /// (checked by [`Relocation::between`]), so every buffer holding `p`
    /// gives the same answer.
    pub fn apply(&self, p: u64) -> u64 {
        match self
            .moves
            .iter()
            .find(|&&(old, bytes, _)| p >= old && p - old < bytes)
        {
            Some(&(old, _, new)) => new + (p - old),
            None => p,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xcall_core::Platform;

    #[test]
    fn relocation_moves_pointers_into_buffers_only() {
        let old = key(Device::cuda(0), &[0x1000, 0x2000]);
        let new = key(Device::cuda(0), &[0x9000, 0x4000]);
        let r = Relocation::between(&old, &new).unwrap();
        // (pointer, where it goes): starts, insides, last bytes, ends (one
        // past: not inside), outside, NULL.
        for (p, want) in [
            (0x1000, 0x9000),
            (0x1010, 0x9010),
            (0x10ff, 0x90ff),
            (0x1100, 0x1100),
            (0x2000, 0x4000),
            (0x20ff, 0x40ff),
            (0x2100, 0x2100),
            (0x0fff, 0x0fff),
            (0, 0),
        ] {
            assert_eq!(r.apply(p), want, "{p:#x}");
        }
        // The same key is the identity.
        let same = Relocation::between(&old, &old).unwrap();
        assert!((0..0x3000).step_by(8).all(|p| same.apply(p) == p));
    }

    #[test]
    fn relocation_refuses_what_a_pointer_move_cannot_express() {
        let old = key(Device::cuda(0), &[0x1000, 0x2000]);
        // Alignment below 256 changes.
        assert_eq!(
            Relocation::between(&old, &key(Device::cuda(0), &[0x9010, 0x4000])),
            None
        );
        // Disjoint buffers that overlap in the new call (in place).
        assert_eq!(
            Relocation::between(&old, &key(Device::cuda(0), &[0x4000, 0x4000])),
            None
        );
        // Overlapping buffers that no longer overlap, or at another offset.
        let aliased = key(Device::cuda(0), &[0x1000, 0x1000]);
        assert_eq!(
            Relocation::between(&aliased, &key(Device::cuda(0), &[0x1000, 0x2000])),
            None
        );
        let shifted = key(Device::cuda(0), &[0x1000, 0x1100]);
        assert_eq!(
            Relocation::between(&aliased, &shifted),
            None,
            "one buffer at +0x100 of the other: disjoint (256 bytes each)"
        );
        let half = |a: u64, b: u64| {
            let mut k = key(Device::cuda(0), &[a, b]);
            k.buffers[0].bytes = 512;
            k.buffers[1].bytes = 512;
            k
        };
        assert_eq!(
            Relocation::between(&half(0x1000, 0x1100), &half(0x5000, 0x5200)),
            None,
            "overlap at another offset"
        );
        // Overlap kept at the same offset: every containing buffer agrees.
        let r = Relocation::between(&half(0x1000, 0x1100), &half(0x5000, 0x5100)).unwrap();
        assert_eq!((r.apply(0x1150), r.apply(0x11ff)), (0x5150, 0x51ff));
        // Another topology.
        let mut other = key(Device::cuda(0), &[0x9000, 0x4000]);
        other.attributes = 10.into();
        assert_eq!(Relocation::between(&old, &other), None);
    }

    fn key(device: Device, addresses: &[u64]) -> CallKey {
        CallKey {
            device,
            target: 7,
            attributes: 9.into(),
            buffers: addresses
                .iter()
                .map(|&a| Buffer::new(a, 256, BufferRole::InOut))
                .collect(),
        }
    }

    #[test]
    fn overlap_rules() {
        // Independent reference: enumerate bytes of small ranges.
        for a in 0..6u64 {
            for al in 0..4u64 {
                for b in 0..6u64 {
                    for bl in 0..4u64 {
                        let want = (a..a + al).any(|x| (b..b + bl).contains(&x));
                        assert_eq!(ranges_overlap(a, al, b, bl), want, "{a}+{al} vs {b}+{bl}");
                    }
                }
            }
        }
        assert!(ranges_overlap(u64::MAX - 1, 1, u64::MAX - 1, u64::MAX));
        assert!(!ranges_overlap(u64::MAX, 0, 0, u64::MAX));
    }

    #[test]
    fn same_addresses_on_two_devices_are_different_keys() {
        let a = key(Device::cuda(0), &[0x7000_0000]);
        let b = key(Device::cuda(1), &[0x7000_0000]);
        assert_ne!(a, b);
        assert!(!a.same_topology(&b));
        let host = key(Device::new(Platform::Host, 0), &[0x7000_0000]);
        assert_ne!(a, host);
    }

    #[test]
    fn topology_ignores_addresses_only() {
        let a = key(Device::cuda(0), &[0x1000, 0x2000]);
        let b = key(Device::cuda(0), &[0x9000, 0xa000]);
        assert!(a.same_topology(&b));
        assert_eq!(a.topology_bucket(), b.topology_bucket());
        let mut c = b.clone();
        c.buffers[1].bytes = 512;
        assert!(!a.same_topology(&c));
        let mut d = b.clone();
        d.buffers[0].role = BufferRole::In;
        assert!(!a.same_topology(&d));
        let mut e = b;
        e.attributes = 10.into();
        assert!(!a.same_topology(&e));
    }

    #[test]
    fn attributes_compare_in_full_and_hash_by_digest() {
        let bucket = |a: &Attributes| {
            let mut h = FxHasher::default();
            a.hash(&mut h);
            h.finish()
        };
        // A forced digest collision: the same bucket, different attributes.
        let (x, y) = (
            Attributes::with_digest(7, *b"align=1"),
            Attributes::with_digest(7, *b"align=2"),
        );
        assert_eq!(bucket(&x), bucket(&y));
        assert_ne!(x, y);
        assert_eq!(x, Attributes::with_digest(7, *b"align=1"));
        // A word never equals bytes, whatever the digests.
        assert_ne!(Attributes::word(7), Attributes::with_digest(7, []));
        assert_eq!(Attributes::from(7), Attributes::word(7));
        // Named integers: the listing order does not matter, names and
        // values do, and a name cannot run into its value.
        let named = |list: &[(&str, i64)]| Attributes::named_ints(list);
        assert_eq!(named(&[("a", 1), ("b", 2)]), named(&[("b", 2), ("a", 1)]));
        assert_ne!(named(&[("a", 1)]), named(&[("a", 2)]));
        assert_ne!(named(&[("a", 1)]), named(&[("b", 1)]));
        assert_ne!(named(&[("a", 1)]), named(&[("a", 1), ("b", 0)]));
        assert_ne!(named(&[("ab", 1)]), named(&[("a", 1), ("b", 1)]));
    }

    #[test]
    fn validation() {
        assert!(key(Device::cuda(0), &[]).validate().is_err());
        let mut k = key(Device::cuda(0), &[u64::MAX - 10]);
        assert!(k.validate().is_err());
        k.buffers[0].bytes = 10;
        assert!(k.validate().is_ok());
    }
}
