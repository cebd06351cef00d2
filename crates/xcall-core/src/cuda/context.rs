//! Making a context current for a scope and restoring the caller's.

use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};

use super::{check, check_device, driver_error};
use crate::{Device, DeviceMap, Result};

fn contexts() -> &'static DeviceMap<Arc<CudaContext>> {
    static CONTEXTS: OnceLock<DeviceMap<Arc<CudaContext>>> = OnceLock::new();
    CONTEXTS.get_or_init(DeviceMap::new)
}

/// The primary context of `device`, retained on first use for the rest of
/// the process. The caller's current context stays current.
fn primary(device: Device) -> Result<&'static Arc<CudaContext>> {
    let ordinal = check_device(device)?;
    contexts().get_or_try_init(device, || {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle through a valid pointer.
        check("cuCtxGetCurrent", device, unsafe {
            sys::cuCtxGetCurrent(&mut previous)
        })?;
        // cudarc makes the new context current; the caller's is restored.
        let made = CudaContext::new(ordinal as usize)
            .map_err(|e| driver_error("cuDevicePrimaryCtxRetain", device, e));
        // SAFETY: `previous` is null or the context current a moment ago.
        let restored = check("cuCtxSetCurrent", device, unsafe {
            sys::cuCtxSetCurrent(previous)
        });
        let made = made?;
        restored.map(|()| made)
    })
}

/// A context made current on this thread until the guard is dropped or
/// [`restore`](Self::restore)d; the context that was current before is then
/// current again, also when the scope unwinds from a panic.
///
/// Not `Send`: a guard restores the context of the thread that made it.
#[must_use = "the context is current only while the guard lives"]
pub struct ContextGuard {
    device: Device,
    previous: sys::CUcontext,
    restored: bool,
    _thread: PhantomData<*const ()>,
}

impl ContextGuard {
    /// Makes `device`'s primary context current (retaining it on first use).
    pub fn primary(device: Device) -> Result<ContextGuard> {
        let ctx = primary(device)?;
        // SAFETY: the primary context is retained for the life of the
        // process, so the handle stays valid while it is current.
        unsafe { Self::enter(device, ctx.cu_ctx()) }
    }

    /// Makes `context` current; `device` names it in errors.
    ///
    /// # Safety
    /// `context` must be a live context, and stay alive until the guard is
    /// dropped.
    pub unsafe fn enter(device: Device, context: sys::CUcontext) -> Result<ContextGuard> {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle through a valid pointer.
        check("cuCtxGetCurrent", device, unsafe {
            sys::cuCtxGetCurrent(&mut previous)
        })?;
        // Already current (the common case: one device per thread): no
        // switch now, and on restore only if something switched meanwhile.
        if previous != context {
            // SAFETY: `context` is live (the caller's contract).
            check("cuCtxSetCurrent", device, unsafe {
                sys::cuCtxSetCurrent(context)
            })?;
        }
        Ok(ContextGuard {
            device,
            previous,
            restored: false,
            _thread: PhantomData,
        })
    }

    /// Makes the previous context current again, reporting a failure (the
    /// drop that a panic runs can only ignore it).
    pub fn restore(mut self) -> Result<()> {
        self.restored = true;
        self.set_previous()
    }

    fn set_previous(&self) -> Result<()> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle through a valid pointer.
        check("cuCtxGetCurrent", self.device, unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        if current == self.previous {
            return Ok(());
        }
        // SAFETY: `previous` is null or the context that was current on this
        // thread when the guard was made; its owner keeps it alive.
        check("cuCtxSetCurrent", self.device, unsafe {
            sys::cuCtxSetCurrent(self.previous)
        })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if !self.restored {
            let _ = self.set_previous();
        }
    }
}

/// Runs `f` with the primary context of `device` current on this thread, then
/// makes the caller's previous context current again (also when `f` fails or
/// panics).
pub fn with_context<T>(
    device: Device,
    f: impl FnOnce(&Arc<CudaContext>) -> Result<T>,
) -> Result<T> {
    let ctx = primary(device)?;
    // SAFETY: the primary context is retained for the life of the process.
    let guard = unsafe { ContextGuard::enter(device, ctx.cu_ctx()) }?;
    let result = f(ctx);
    let restored = guard.restore();
    match (result, restored) {
        (Ok(value), Ok(())) => Ok(value),
        (Err(e), _) | (Ok(_), Err(e)) => Err(e),
    }
}

/// Retains `device`'s primary context for the rest of the process (once;
/// later calls are a lock-free lookup). Objects that live in that context,
/// such as cached graphs, can then never outlive it. The caller's current
/// context is left as it was, and no context is made current.
pub fn retain_primary_context(device: Device) -> Result<()> {
    primary(device).map(|_| ())
}

/// The context current on this thread (`cuCtxGetCurrent`; null: none).
/// `device` names the call in errors.
pub fn current_context(device: Device) -> Result<sys::CUcontext> {
    crate::cuda::available()?;
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle through a valid pointer.
    check("cuCtxGetCurrent", device, unsafe {
        sys::cuCtxGetCurrent(&mut current)
    })?;
    Ok(current)
}

/// Leaves this thread with no current context (`cuCtxSetCurrent(NULL)`);
/// `device` names the call in errors.
pub fn clear_current_context(device: Device) -> Result<()> {
    crate::cuda::available()?;
    // SAFETY: setting no current context is always valid.
    check("cuCtxSetCurrent", device, unsafe {
        sys::cuCtxSetCurrent(std::ptr::null_mut())
    })
}
