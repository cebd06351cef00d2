//! Per-device state of this process: which world and rank each device is
//! bound to (the rank -> device registry's reverse), and counters.
//!
//! One slot per device in a growable [`DeviceMap`] (no fixed maximum). A
//! world touches only its own device's slot, and only briefly: no lock of
//! this module is ever held across a collective or a wait on another PE,
//! so a caller may hold its own slot (through [`device_slot`]) while it
//! calls `barrier_all` (tested with 8 PEs).

use std::sync::{Mutex, MutexGuard, OnceLock};

use xcall_core::{Device, DeviceMap};

use crate::error::{Result, ShmemError};

/// What one device's slot holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceState {
    /// The live world bound to this device: (world name, rank).
    pub bound: Option<(String, usize)>,
    /// Worlds initialised on this device so far.
    pub inits: u64,
    /// Worlds finalized on this device so far.
    pub finalizes: u64,
}

fn slots() -> &'static DeviceMap<Mutex<DeviceState>> {
    static SLOTS: OnceLock<DeviceMap<Mutex<DeviceState>>> = OnceLock::new();
    // Sized for 64 devices per platform up front; more still fit.
    SLOTS.get_or_init(|| DeviceMap::with_capacity(64))
}

/// The slot of `device` (created on first use).
pub fn device_slot(device: Device) -> &'static Mutex<DeviceState> {
    slots().get_or_init(device, Default::default)
}

fn lock(device: Device) -> MutexGuard<'static, DeviceState> {
    device_slot(device)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Binds `device` to (`world`, `rank`); refused while another live world
/// holds it.
pub(crate) fn bind(device: Device, world: &str, rank: usize) -> Result<Binding> {
    let mut s = lock(device);
    if let Some((w, r)) = &s.bound {
        return Err(ShmemError::State(format!(
            "{device} is already bound to rank {r} of live world {w:?}; one PE per device"
        )));
    }
    s.bound = Some((world.to_string(), rank));
    s.inits += 1;
    Ok(Binding { device })
}

/// Unbinds the device when dropped (finalize, or a failed init).
pub(crate) struct Binding {
    device: Device,
}

impl Drop for Binding {
    fn drop(&mut self) {
        let mut s = lock(self.device);
        s.bound = None;
        s.finalizes += 1;
    }
}
