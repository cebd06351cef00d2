//! The CUDA driver, loaded lazily.
//!
//! Nothing here runs until a CUDA device is asked for: the driver library is
//! opened on the first call to [`available`] (or anything that needs it), and
//! a machine without a driver gets [`Error::CudaUnavailable`] saying why,
//! never a panic. Host-only work never reaches this module.
//!
//! Calls that need a context make it current only for their own duration and
//! restore the caller's context afterwards ([`ContextGuard`],
//! [`with_context`]): a framework's worker thread keeps whatever device it had
//! current.
//!
//! The toolkit every capability crate uses, so none of them reaches for the
//! driver in its own way:
//! - [`check`] and [`on`]: a driver call whose failure names the call and
//!   the device ([`Error::CudaDriver`]);
//! - [`ContextGuard`]: a context made current until the guard drops (also on
//!   a panic), then the caller's previous one again;
//! - [`Event`] and [`StreamAlloc`]: driver objects destroyed or freed on drop;
//! - [`Params`] and [`launch`]: one way to pass a kernel's parameters;
//! - [`KernelRecord`] and [`kernel_params!`](crate::kernel_params): a
//!   kernel's parameter struct written once in Rust, its CUDA C twin
//!   generated with layout assertions;
//! - [`Stream`] (borrowed) and [`OwnedStream`]: one stream type, with
//!   capture status, waits, copies, memsets and stream-ordered scratch;
//! - [`Graph`] and [`GraphExec`]: capture, instantiate, update in place,
//!   launch ([`Stream::begin_capture`], [`Stream::launch_graph`]);
//! - [`max_active_blocks`] and the function attributes; [`pointer_device`]
//!   and [`reach`]: which device owns an address, whether one reaches it;
//! - [`device`]: the device-side helpers (mbarrier, bulk copy, bf16/fp8
//!   conversions) as CUDA C sources to prepend to a kernel's.

mod context;
pub mod device;
mod function;
mod graph;
mod launch;
mod memory;
mod objects;
mod record;
mod stream;

pub use context::{
    clear_current_context, current_context, retain_primary_context, with_context, ContextGuard,
};
pub use function::{
    max_active_blocks, max_threads_per_block, module_global, pointer_device, reach,
    set_max_dynamic_shared, Reach,
};
pub use graph::{
    kernel_node_shape, Graph, GraphExec, InstantiateFlags, KernelNodeShape, RawGraphNode,
};
pub use launch::{launch, launch_raw, recording_launches, Launch, Params, RecordedLaunch};
pub use memory::{
    copy_dtoh_sync, copy_htod_sync, enable_peer_access, ipc_close, ipc_handle, ipc_open, mem_alloc,
    mem_free, mem_get_info, memset_d8_sync, peer_readable,
};
pub use objects::{Event, StreamAlloc};
pub use record::{pointer_offsets, KernelRecord, ParamField};
pub use stream::{CaptureMode, OwnedStream, RawContext, RawDevice, RawStream, Stream};

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cudarc::driver::{result as cu, sys};
pub use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};

use crate::{Device, Error, Platform, Result};

/// The flags of a timing event for cudarc's `CudaContext::new_event`
/// (`CU_EVENT_DEFAULT`: timing on; cudarc's `None` turns timing off).
pub const TIMED_EVENT: Option<sys::CUevent_flags> = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);

/// Environment variable that hides CUDA from xcall when true (a boolean,
/// see [`crate::env`]; the library then behaves as on a machine without a
/// GPU). A value that is not a boolean makes CUDA unavailable with a
/// message naming it.
pub const DISABLE_ENV: &str = "XCALL_DISABLE_CUDA";

static PROBE: OnceLock<std::result::Result<Probe, String>> = OnceLock::new();
static LOAD_ATTEMPTED: AtomicBool = AtomicBool::new(false);

#[derive(Debug)]
struct Probe {
    device_count: usize,
    driver_version: i32,
}

/// "libcuda.so.1 and N other names tried", from the loader's candidates.
fn tried_names(lib: &str) -> String {
    let mut names = cudarc::get_lib_name_candidates(lib);
    names.sort();
    names.dedup();
    let canonical = format!("lib{lib}.so.1");
    let shown = if names.contains(&canonical) {
        canonical
    } else {
        names.first().cloned().unwrap_or_default()
    };
    format!(
        "{shown} and {} other names tried",
        names.len().saturating_sub(1)
    )
}

fn run_probe() -> std::result::Result<Probe, String> {
    match crate::env::flag(DISABLE_ENV) {
        Ok(Some(true)) => return Err(format!("disabled by {DISABLE_ENV}")),
        Ok(_) => {}
        Err(e) => return Err(e.to_string()),
    }
    LOAD_ATTEMPTED.store(true, Ordering::SeqCst);
    // SAFETY: only opens (and closes) the driver library by name; no symbol
    // of it is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "no CUDA driver library could be opened ({}; is the NVIDIA driver installed and on the loader path?)",
            tried_names("cuda")
        ));
    }
    // cudarc panics when an entry point is missing from an older driver;
    // turn that into an error instead of unwinding into the caller.
    let outcome = catch_unwind(AssertUnwindSafe(
        || -> std::result::Result<Probe, String> {
            cu::init().map_err(|e| format!("cuInit failed: {}", describe(e)))?;
            let count = cu::device::get_count()
                .map_err(|e| format!("cuDeviceGetCount failed: {}", describe(e)))?;
            let mut version = 0;
            // SAFETY: writes one int through a valid pointer.
            unsafe { sys::cuDriverGetVersion(&mut version) }
                .result()
                .map_err(|e| format!("cuDriverGetVersion failed: {}", describe(e)))?;
            Ok(Probe {
                device_count: usize::try_from(count).unwrap_or(0),
                driver_version: version,
            })
        },
    ));
    let probe = outcome.unwrap_or_else(|panic| {
        Err(format!(
            "the CUDA driver could not be used: {}",
            crate::panic_message(&*panic)
        ))
    })?;
    if probe.device_count == 0 {
        return Err("the CUDA driver found no devices".into());
    }
    Ok(probe)
}

fn probe() -> Result<&'static Probe> {
    PROBE
        .get_or_init(run_probe)
        .as_ref()
        .map_err(|reason| Error::CudaUnavailable {
            reason: reason.clone(),
        })
}

/// `Ok` when the CUDA driver loads and reports at least one device; otherwise
/// [`Error::CudaUnavailable`] with the reason. The first call loads the
/// driver; the answer is then cached for the life of the process.
pub fn available() -> Result<()> {
    probe().map(|_| ())
}

/// Whether this process has tried to load the CUDA driver (through
/// [`available`] or any call that needs CUDA). Host-only work leaves it false.
pub fn driver_load_attempted() -> bool {
    LOAD_ATTEMPTED.load(Ordering::SeqCst)
}

/// Number of CUDA devices, or [`Error::CudaUnavailable`].
pub fn device_count() -> Result<usize> {
    probe().map(|p| p.device_count)
}

/// The driver's CUDA version as (major, minor), for example (13, 0).
pub fn driver_version() -> Result<(i32, i32)> {
    probe().map(|p| (p.driver_version / 1000, (p.driver_version % 1000) / 10))
}

/// NVRTC's version as (major, minor), or [`Error::CudaUnavailable`] when the
/// NVRTC library cannot be opened.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_present()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints through valid pointers; the library is present.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::CudaUnavailable {
            reason: format!("nvrtcVersion failed: {e:?}"),
        })?;
    Ok((major, minor))
}

/// `Ok` when the NVRTC library can be opened.
pub(crate) fn nvrtc_present() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens (and closes) the NVRTC library by name.
    if *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }) {
        Ok(())
    } else {
        Err(Error::CudaUnavailable {
            reason: format!(
                "no NVRTC library could be opened ({})",
                tried_names("nvrtc")
            ),
        })
    }
}

/// The driver's name and description of an error, for example
/// `CUDA_ERROR_INVALID_VALUE (invalid argument)`.
pub fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", e.0 as i32));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// An [`Error::CudaDriver`] for a failed `call` on `device`.
pub fn driver_error(call: &'static str, device: Device, e: DriverError) -> Error {
    Error::CudaDriver {
        call,
        device,
        message: describe(e),
    }
}

/// Turns the result `r` of the driver call `call` on `device` into a
/// [`Result`] whose error names the call.
pub fn check(call: &'static str, device: Device, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| driver_error(call, device, e))
}

/// Runs the driver call `f` (named `call`) with `device`'s primary context
/// current, then restores the caller's context.
pub fn on(device: Device, call: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<()> {
    with_context(device, |_| check(call, device, f()))
}

/// Checks that `device` is a CUDA device that exists; returns its ordinal.
pub fn check_device(device: Device) -> Result<u32> {
    if device.platform != Platform::Cuda {
        return Err(Error::InvalidArgument(format!(
            "{device} is not a CUDA device"
        )));
    }
    device.validate().map(|d| d.ordinal)
}

/// What `xcall doctor` and the kernel cache need to know about a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device.
    pub device: Device,
    /// The marketing name, for example `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Number of streaming multiprocessors.
    pub multiprocessors: i32,
    /// The PCI address, `domain:bus:device.0` in hex (`0000:19:00.0`):
    /// what tells two ordinals apart as GPUs, where processes see
    /// different devices under one ordinal (`CUDA_VISIBLE_DEVICES`).
    pub pci_address: String,
    /// Whether processes may hold this GPU at once, taking turns on it:
    /// its compute mode is the default, not exclusive-process or
    /// prohibited.
    pub processes_may_share: bool,
}

impl DeviceInfo {
    /// The NVRTC architecture name of the device, for example `sm_90`.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

fn attribute(device: Device, dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` came from cuDeviceGet for a validated ordinal.
    unsafe { cu::device::get_attribute(dev, attr) }
        .map_err(|e| driver_error("cuDeviceGetAttribute", device, e))
}

/// Name, compute capability, memory, SM count, PCI address and compute
/// mode of a CUDA device. Needs no context.
pub fn device_info(device: Device) -> Result<DeviceInfo> {
    let ordinal = check_device(device)?;
    let dev =
        cu::device::get(ordinal as i32).map_err(|e| driver_error("cuDeviceGet", device, e))?;
    let name = cu::device::get_name(dev).map_err(|e| driver_error("cuDeviceGetName", device, e))?;
    use sys::CUdevice_attribute as A;
    let major = attribute(device, dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(device, dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let multiprocessors = attribute(device, dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let pci_address = format!(
        "{:04x}:{:02x}:{:02x}.0",
        attribute(device, dev, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        attribute(device, dev, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        attribute(device, dev, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
    );
    let processes_may_share = attribute(device, dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)?
        == sys::CUcomputemode::CU_COMPUTEMODE_DEFAULT as i32;
    // SAFETY: `dev` came from cuDeviceGet.
    let total_memory = unsafe { cu::device::total_mem(dev) }
        .map_err(|e| driver_error("cuDeviceTotalMem", device, e))?;
    Ok(DeviceInfo {
        device,
        name,
        compute_capability: (major, minor),
        total_memory,
        multiprocessors,
        pci_address,
        processes_may_share,
    })
}

/// The driver's handle of `device` (`cuDeviceGet`), as
/// [`Stream::driver_device`] answers it. Needs no context.
pub fn driver_device(device: Device) -> Result<RawDevice> {
    let ordinal = check_device(device)?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one value through a valid pointer.
    check("cuDeviceGet", device, unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32)
    })?;
    Ok(dev)
}

/// Whether `from` can map memory of `to` directly (cuDeviceCanAccessPeer).
/// A device is reported as able to access itself.
pub fn can_access_peer(from: Device, to: Device) -> Result<bool> {
    let a = check_device(from)?;
    let b = check_device(to)?;
    if a == b {
        return Ok(true);
    }
    let da = cu::device::get(a as i32).map_err(|e| driver_error("cuDeviceGet", from, e))?;
    let db = cu::device::get(b as i32).map_err(|e| driver_error("cuDeviceGet", to, e))?;
    let mut can = 0;
    // SAFETY: writes one int; both handles came from cuDeviceGet.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, da, db) }
        .result()
        .map_err(|e| driver_error("cuDeviceCanAccessPeer", from, e))?;
    Ok(can != 0)
}
