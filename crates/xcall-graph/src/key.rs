//! The exact call key: (platform, device, target, attribute digest, buffers).
//!
//! Keys are stored and compared in full. A hash only picks the bucket, so a
//! hash collision can never replay another call's graph (a graph recorded
//! for other buffers or another device would read and write them); that
//! is also why a fast non-cryptographic hash (FxHash) is enough here.

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

/// The full identity of a custom call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CallKey {
    /// Platform and device ordinal.
    pub device: Device,
    /// Identifies the custom call target (for example a hash of its name,
    /// chosen by the caller; compared as given).
    pub target: u64,
    /// Digest of the call's attributes (chosen by the caller).
    pub attributes: u64,
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
        (self.device, self.target, self.attributes).hash(&mut h);
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

#[cfg(test)]
mod tests {
    use super::*;
    use xcall_core::Platform;

    fn key(device: Device, addresses: &[u64]) -> CallKey {
        CallKey {
            device,
            target: 7,
            attributes: 9,
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
        e.attributes = 10;
        assert!(!a.same_topology(&e));
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
