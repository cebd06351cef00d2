//! Per-device state.
//!
//! A [`DeviceMap`] holds one slot per device, created on first use. Slots live
//! in segments that double in size: segment `k` holds `base << k` slots, so any
//! `u32` ordinal fits without a compile-time maximum, and a segment, once
//! created, never moves. A lookup is two atomic loads (segment, slot) and
//! never takes a lock; creating a slot takes only that slot's own init lock,
//! so one device's initialisation never waits on another's.

use std::sync::{Mutex, OnceLock};

use crate::{Device, Platform};

/// Enough doubling segments to index every `u32` ordinal with a base of 1.
const SEGMENTS: usize = 33;

/// Aligned to 128 bytes (two cache lines, the span the adjacent-line
/// prefetcher pulls in) so that devices updating their own state never
/// share a cache line with a neighbour.
#[repr(align(128))]
struct Slot<T> {
    value: OnceLock<T>,
    /// Serialises initialisers of this slot only (so `init` runs once).
    init: Mutex<()>,
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Slot {
            value: OnceLock::new(),
            init: Mutex::new(()),
        }
    }
}

struct Table<T> {
    /// Size of segment 0; fixed on first use.
    base: OnceLock<usize>,
    segments: [OnceLock<Box<[Slot<T>]>>; SEGMENTS],
}

impl<T> Table<T> {
    fn new() -> Self {
        Table {
            base: OnceLock::new(),
            segments: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// (segment, index within it) of `ordinal` for segment-0 size `base`.
    fn locate(base: usize, ordinal: u32) -> (usize, usize) {
        // Segment k starts at base * (2^k - 1).
        let q = ordinal as u64 / base as u64 + 1;
        let k = (63 - q.leading_zeros()) as usize;
        let start = base as u64 * ((1u64 << k) - 1);
        (k, (ordinal as u64 - start) as usize)
    }

    fn existing_slot(&self, ordinal: u32) -> Option<&Slot<T>> {
        let base = *self.base.get()?;
        let (k, i) = Self::locate(base, ordinal);
        self.segments[k].get().map(|seg| &seg[i])
    }

    fn slot(&self, ordinal: u32, base_hint: impl FnOnce() -> usize) -> &Slot<T> {
        let base = *self.base.get_or_init(|| base_hint().max(1));
        let (k, i) = Self::locate(base, ordinal);
        let segment = self.segments[k].get_or_init(|| {
            (0..base << k)
                .map(|_| Slot::default())
                .collect::<Vec<_>>()
                .into_boxed_slice()
        });
        &segment[i]
    }
}

/// Per-device slots of `T`, created on first use, for any number of devices.
///
/// Thread-safe: lookups are lock-free and slots of different devices never
/// share a lock. Slots are never removed; put a `Mutex` (or any interior
/// mutability) inside `T` for state that changes.
///
/// Memory grows with the largest ordinal used (about twice that many empty
/// slots at most), so ordinals should come from a validated device
/// ([`Device::validate`]) or a world size, not from unchecked input.
pub struct DeviceMap<T> {
    tables: [Table<T>; 2],
    capacity_hint: Option<usize>,
}

impl<T> Default for DeviceMap<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> DeviceMap<T> {
    /// A map whose first segment per platform is sized from the device count
    /// found at run time when that platform is first used (Host: 1; CUDA: the
    /// driver's count). Sizing a CUDA table only happens when a CUDA device's
    /// slot is first created, so Host-only use never loads the driver.
    pub fn new() -> Self {
        DeviceMap {
            tables: [Table::new(), Table::new()],
            capacity_hint: None,
        }
    }

    /// A map whose first segment holds `devices` slots per platform. More
    /// devices still fit: further segments double in size.
    pub fn with_capacity(devices: usize) -> Self {
        DeviceMap {
            tables: [Table::new(), Table::new()],
            capacity_hint: Some(devices),
        }
    }

    fn table(&self, platform: Platform) -> &Table<T> {
        &self.tables[platform as usize]
    }

    fn base_hint(&self, platform: Platform) -> usize {
        self.capacity_hint
            .unwrap_or_else(|| platform.device_count().unwrap_or(1))
    }

    /// The slot of `device` if it has been created.
    pub fn get(&self, device: Device) -> Option<&T> {
        self.table(device.platform)
            .existing_slot(device.ordinal)?
            .value
            .get()
    }

    /// The slot of `device`, created with `init` if it does not exist yet.
    /// Concurrent callers for the same device run `init` once; callers for
    /// other devices never wait for it.
    pub fn get_or_init(&self, device: Device, init: impl FnOnce() -> T) -> &T {
        match self.get_or_try_init(device, || Ok::<T, std::convert::Infallible>(init())) {
            Ok(value) => value,
            Err(never) => match never {},
        }
    }

    /// Like [`DeviceMap::get_or_init`] with a fallible `init`; on error the
    /// slot stays empty and a later call tries again.
    pub fn get_or_try_init<E>(
        &self,
        device: Device,
        init: impl FnOnce() -> Result<T, E>,
    ) -> Result<&T, E> {
        let slot = self
            .table(device.platform)
            .slot(device.ordinal, || self.base_hint(device.platform));
        if let Some(value) = slot.value.get() {
            return Ok(value);
        }
        // A panicking initialiser leaves the slot empty; the lock itself
        // protects no data, so a poisoned lock is safe to reuse.
        let _guard = slot.init.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(value) = slot.value.get() {
            return Ok(value);
        }
        let value = init()?;
        Ok(slot.value.get_or_init(|| value))
    }

    /// Every created slot with its device, Host first, in ordinal order.
    pub fn iter(&self) -> impl Iterator<Item = (Device, &T)> + '_ {
        Platform::ALL.into_iter().flat_map(move |platform| {
            let table = self.table(platform);
            let base = table.base.get().copied().unwrap_or(0);
            table
                .segments
                .iter()
                .enumerate()
                .filter_map(|(k, seg)| seg.get().map(|seg| (k, seg)))
                .flat_map(move |(k, seg)| {
                    let start = base * ((1usize << k) - 1);
                    seg.iter().enumerate().filter_map(move |(i, slot)| {
                        let ordinal = u32::try_from(start + i).ok()?;
                        Some((Device::new(platform, ordinal), slot.value.get()?))
                    })
                })
        })
    }

    /// Number of created slots.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether no slot has been created.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for DeviceMap<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc, Barrier};
    use std::time::Duration;

    #[test]
    fn neighbouring_slots_never_share_a_cache_line() {
        let map: DeviceMap<std::sync::atomic::AtomicU64> = DeviceMap::with_capacity(4);
        let a =
            map.get_or_init(Device::new(Platform::Host, 0), Default::default) as *const _ as usize;
        let b =
            map.get_or_init(Device::new(Platform::Host, 1), Default::default) as *const _ as usize;
        assert!(
            a.abs_diff(b) >= 128,
            "slots {a:#x} and {b:#x} are {} bytes apart",
            a.abs_diff(b)
        );
    }

    #[test]
    fn locate_covers_every_ordinal_once() {
        // Independent reference: walk the segments in order and count.
        for base in [1usize, 2, 3, 8] {
            let mut expected = Vec::new();
            for k in 0..12 {
                for i in 0..(base << k) {
                    expected.push((k, i));
                }
            }
            for (ordinal, want) in expected.iter().enumerate().take(2000) {
                assert_eq!(Table::<()>::locate(base, ordinal as u32), *want);
            }
        }
        let (k, i) = Table::<()>::locate(1, u32::MAX);
        assert!(k < SEGMENTS && i < 1 << k);
    }

    #[test]
    fn sixty_four_simulated_devices_grow_past_the_initial_count() {
        let map: DeviceMap<u32> = DeviceMap::with_capacity(1);
        for ordinal in 0..64 {
            let value = *map.get_or_init(Device::new(Platform::Host, ordinal), || ordinal * 10);
            assert_eq!(value, ordinal * 10);
        }
        assert_eq!(map.len(), 64);
        let seen: Vec<(Device, u32)> = map.iter().map(|(d, v)| (d, *v)).collect();
        let want: Vec<(Device, u32)> = (0..64)
            .map(|o| (Device::new(Platform::Host, o), o * 10))
            .collect();
        assert_eq!(seen, want);
        assert!(map.get(Device::new(Platform::Host, 64)).is_none());
        assert!(map.get(Device::cuda(0)).is_none());
        // A far ordinal works too, and lands in its own segment.
        map.get_or_init(Device::new(Platform::Host, 1_000_000), || 7);
        assert_eq!(map.get(Device::new(Platform::Host, 1_000_000)), Some(&7));
    }

    #[test]
    fn the_capacity_sizes_the_first_segment_once() {
        let map: DeviceMap<u8> = DeviceMap::with_capacity(5);
        map.get_or_init(Device::cuda(4), || 4);
        assert_eq!(map.tables[Platform::Cuda as usize].base.get(), Some(&5));
        // Ordinals 0..5 share segment 0; the next five are segment 1.
        assert!(map.tables[Platform::Cuda as usize].segments[1]
            .get()
            .is_none());
        map.get_or_init(Device::cuda(5), || 5);
        assert_eq!(
            map.tables[Platform::Cuda as usize].segments[1]
                .get()
                .map(|s| s.len()),
            Some(10)
        );
        // Without a hint the Host's first segment holds its one device.
        let host: DeviceMap<u8> = DeviceMap::new();
        host.get_or_init(Device::HOST, || 0);
        assert_eq!(host.tables[Platform::Host as usize].base.get(), Some(&1));
        // A zero hint still makes room for a device.
        let zero: DeviceMap<u8> = DeviceMap::with_capacity(0);
        zero.get_or_init(Device::cuda(0), || 9);
        assert_eq!(zero.get(Device::cuda(0)), Some(&9));
    }

    #[test]
    fn emptiness_length_and_debug_follow_the_created_slots() {
        let map: DeviceMap<u32> = DeviceMap::with_capacity(2);
        assert!(map.is_empty());
        assert_eq!(map.len(), 0);
        assert_eq!(format!("{map:?}"), "{}");
        map.get_or_init(Device::cuda(3), || 30);
        assert!(!map.is_empty());
        map.get_or_init(Device::HOST, || 1);
        assert_eq!(map.len(), 2);
        assert_eq!(
            format!("{map:?}"),
            format!("{{{:?}: 1, {:?}: 30}}", Device::HOST, Device::cuda(3))
        );
    }

    #[test]
    fn platforms_have_separate_slots() {
        let map: DeviceMap<&str> = DeviceMap::with_capacity(4);
        map.get_or_init(Device::new(Platform::Host, 0), || "host");
        map.get_or_init(Device::cuda(0), || "cuda");
        assert_eq!(map.get(Device::HOST), Some(&"host"));
        assert_eq!(map.get(Device::cuda(0)), Some(&"cuda"));
    }

    #[test]
    fn init_runs_once_per_device_under_contention() {
        const DEVICES: u32 = 64;
        const THREADS_PER_DEVICE: usize = 4;
        let map: Arc<DeviceMap<u32>> = Arc::new(DeviceMap::with_capacity(2));
        let inits: Arc<Vec<AtomicUsize>> =
            Arc::new((0..DEVICES).map(|_| AtomicUsize::new(0)).collect());
        let start = Arc::new(Barrier::new(DEVICES as usize * THREADS_PER_DEVICE));
        let handles: Vec<_> = (0..DEVICES as usize * THREADS_PER_DEVICE)
            .map(|t| {
                let (map, inits, start) = (map.clone(), inits.clone(), start.clone());
                std::thread::spawn(move || {
                    let ordinal = (t % DEVICES as usize) as u32;
                    start.wait();
                    let v = *map.get_or_init(Device::new(Platform::Host, ordinal), || {
                        inits[ordinal as usize].fetch_add(1, Ordering::SeqCst);
                        ordinal + 1000
                    });
                    assert_eq!(v, ordinal + 1000);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        for (ordinal, n) in inits.iter().enumerate() {
            assert_eq!(n.load(Ordering::SeqCst), 1, "device {ordinal}");
        }
    }

    #[test]
    fn a_blocked_device_never_blocks_another() {
        // Device 0's initialiser blocks until the other 63 devices have been
        // created, initialised and read from another thread. A lock shared
        // between slots would deadlock here; the timeout turns that into a
        // failure instead of a hang.
        let map: Arc<DeviceMap<std::sync::Mutex<u64>>> = Arc::new(DeviceMap::with_capacity(1));
        let (others_done_tx, others_done_rx) = mpsc::channel::<()>();
        let (entered_tx, entered_rx) = mpsc::channel::<()>();
        let blocked = {
            let map = map.clone();
            std::thread::spawn(move || {
                let slot = map.get_or_init(Device::HOST, || {
                    entered_tx.send(()).unwrap();
                    others_done_rx
                        .recv_timeout(Duration::from_secs(20))
                        .expect("other devices were blocked by device 0");
                    std::sync::Mutex::new(0)
                });
                // Hold device 0's own lock while the others keep working.
                let _held = slot.lock().unwrap();
            })
        };
        entered_rx.recv().unwrap();
        let others = {
            let map = map.clone();
            std::thread::spawn(move || {
                for ordinal in 1..64 {
                    let d = Device::new(Platform::Host, ordinal);
                    *map.get_or_init(d, || std::sync::Mutex::new(0))
                        .lock()
                        .unwrap() += 1;
                    assert_eq!(*map.get(d).unwrap().lock().unwrap(), 1);
                }
                others_done_tx.send(()).unwrap();
            })
        };
        others.join().unwrap();
        blocked.join().unwrap();
        let created: BTreeSet<u32> = map.iter().map(|(d, _)| d.ordinal).collect();
        assert_eq!(created, (0..64).collect());
    }

    #[test]
    fn failed_init_leaves_the_slot_empty_for_a_retry() {
        let map: DeviceMap<u8> = DeviceMap::with_capacity(1);
        let err = map
            .get_or_try_init(Device::HOST, || Err::<u8, &str>("no"))
            .unwrap_err();
        assert_eq!(err, "no");
        assert!(map.get(Device::HOST).is_none());
        assert_eq!(
            map.get_or_try_init(Device::HOST, || Ok::<u8, &str>(5)),
            Ok(&5)
        );
    }
}
