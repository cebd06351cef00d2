//! C ABI of the graph cache (xcall-graph).

use std::ffi::c_void;

use static_assertions::{assert_eq_align, assert_eq_size};
use xcall_core::{Device, Status};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{
    Attributes, Buffer, BufferRole, CacheConfig, Call, CallKey, GraphCache, GraphError, Outcome,
    Policy, Stats,
};

use crate::guard::{c_code, code_arg, ffi_call, out_ptr, FfiError};
use crate::handle::{self, Handle};
use crate::target::xcall_target;

/// A device-aware graph cache for custom calls.
///
/// Thread safety: every function taking a cache may be called concurrently
/// from any number of threads, except `xcall_graph_cache_free`, which must
/// be the last call on it.
///
/// A cache freed already, or a pointer not made by `xcall_graph_cache_new`,
/// is `XCALL_STATUS_INVALID_HANDLE` in every function taking a cache (the
/// check is by address: a freed cache whose address a new cache reuses
/// names the new one).
pub struct xcall_graph_cache {
    pub(crate) inner: GraphCache<CudaGraphs>,
}

impl Handle for xcall_graph_cache {
    const TYPE: &'static str = "xcall_graph_cache";
}

/// Configuration of a graph cache. Fill it with
/// `xcall_graph_cache_config_default` and change what you need.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_graph_cache_config {
    /// Graphs kept per device (least recently used evicted); at least 1.
    pub capacity: usize,
    /// Limit on the total graph nodes kept per device; 0 for no limit.
    pub max_nodes: usize,
    /// An `xcall_graph_policy` value.
    pub policy: PolicyCode,
    /// After a failed capture, eager runs before capture is tried again.
    pub retry_after: u32,
    /// Executables kept per topology before new addresses update one in
    /// place (ExecUpdate policy); at least 1.
    pub variants_per_topology: usize,
}

/// One buffer of a call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_buffer {
    /// Device address (`CUdeviceptr`, or a host pointer cast to an integer).
    pub address: u64,
    /// Size in bytes.
    pub bytes: u64,
    /// An `xcall_buffer_role` value.
    pub role: BufferRoleCode,
}

/// One custom call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_call {
    /// Where the call runs; on CUDA its stream is the call's (not the
    /// legacy NULL stream).
    pub target: xcall_target,
    /// Identifies the custom call target (for example a hash of its name).
    pub target_id: u64,
    /// The call's attributes as one value, compared as given: calls with
    /// the same value (and target, device and buffers) share a graph, so
    /// it must tell every attribute set apart, not merely hash it.
    pub attributes: u64,
    /// The call's buffers (`num_buffers` of them, at least one).
    pub buffers: *const xcall_buffer,
    /// Number of buffers.
    pub num_buffers: usize,
    /// `XCALL_CALL_*` bits, 0 for none (a zero-initialised call).
    pub flags: u32,
}

/// `xcall_call::flags`: the call's work depends on its buffers only
/// through their addresses, and every kernel it enqueues is an xcall op
/// (`xcall_permute_*`, `xcall_ws_run*`) over those buffers. The cache may
/// then move a cached graph to new buffer addresses by patching the ops'
/// pointer parameters in place, without calling `record`
/// (`XCALL_GRAPH_OUTCOME_PATCHED`), when the buffers keep their sizes,
/// their alignment modulo 256 and their placement relative to each other.
/// A graph with any other kernel is never patched (the cache falls back to
/// recapture and exec-update).
pub const XCALL_CALL_RELOCATABLE: u32 = 1;

/// Every bit `xcall_call::flags` may hold.
const CALL_FLAGS: u32 = XCALL_CALL_RELOCATABLE;

/// The work of a call: enqueue it on `stream` (NULL on Host, where the work
/// runs directly) and return an `xcall_status` (0 = success; any other
/// value is reported as `XCALL_STATUS_CALLBACK_FAILED`). On CUDA it may be
/// called under stream capture: enqueue work only, do not synchronise or
/// allocate.
pub type xcall_record_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, stream: *mut c_void) -> u32>;

assert_eq_size!(xcall_graph_cache_config, [u64; 4]);
assert_eq_align!(xcall_graph_cache_config, u64);
assert_eq_size!(xcall_buffer, [u64; 3]);
assert_eq_align!(xcall_buffer, u64);
assert_eq_size!(xcall_call, [u64; 7]);
assert_eq_align!(xcall_call, u64);
assert_eq_size!(Stats, [u64; 16]);
assert_eq_align!(Stats, u64);
assert_eq_size!(Outcome, u32);
assert_eq_size!(Policy, u32);
assert_eq_size!(BufferRole, u32);

#[derive(Debug)]
struct CallbackStatus(u32);

impl std::fmt::Display for CallbackStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = Status::from_code(self.0).map_or("not an xcall status", Status::name);
        write!(f, "record_fn returned {} ({name})", self.0)
    }
}

impl std::error::Error for CallbackStatus {}

impl From<GraphError> for FfiError {
    fn from(e: GraphError) -> Self {
        FfiError::new(e.status(), e.to_string())
    }
}

fn cache_ref<'a>(cache: *const xcall_graph_cache) -> Result<&'a xcall_graph_cache, FfiError> {
    handle::get(cache, "cache")
}

/// The device of `target` (see [`xcall_target::device`]): clear,
/// invalidate and stats of a CUDA device the cache never saw find nothing
/// and load no driver.
fn device_arg(target: *const xcall_target) -> Result<Device, FfiError> {
    xcall_target::read(target, "target")?.device()
}

fn config_arg(c: &xcall_graph_cache_config) -> Result<CacheConfig, FfiError> {
    let policy = c.policy.get()?;
    let config = CacheConfig {
        capacity: c.capacity,
        max_nodes: (c.max_nodes > 0).then_some(c.max_nodes),
        policy,
        retry_after: c.retry_after,
        variants_per_topology: c.variants_per_topology,
        ..CacheConfig::default()
    };
    config.validate()?;
    Ok(config)
}

/// Writes the default configuration (capacity 64, no node limit,
/// `XCALL_GRAPH_POLICY_EXEC_UPDATE`, retry after 16, 1 variant per topology)
/// to `*out_config`.
///
/// Bad input: NULL `out_config`: `XCALL_STATUS_NULL_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_graph_cache_config_default(
    out_config: *mut xcall_graph_cache_config,
) -> Status {
    ffi_call!({
        let out = out_ptr(out_config, "out_config")?;
        let d = CacheConfig::default();
        *out = xcall_graph_cache_config {
            capacity: d.capacity,
            max_nodes: d.max_nodes.unwrap_or(0),
            policy: PolicyCode(d.policy as u32),
            retry_after: d.retry_after,
            variants_per_topology: d.variants_per_topology,
        };
        Ok(())
    })
}

/// Creates a graph cache with `config` (NULL for the defaults) in
/// `*out_cache`. Creating it loads nothing; CUDA is loaded by the first CUDA
/// call. Free it with `xcall_graph_cache_free`.
///
/// Errors: `XCALL_STATUS_NULL_ARGUMENT`, `XCALL_STATUS_INVALID_ARGUMENT` (a
/// limit of 0, unknown policy).
///
/// Bad input: as listed under Errors; `*out_cache` is written only on
/// success.
#[no_mangle]
pub extern "C" fn xcall_graph_cache_new(
    config: *const xcall_graph_cache_config,
    out_cache: *mut *mut xcall_graph_cache,
) -> Status {
    ffi_call!({
        let out = out_ptr(out_cache, "out_cache")?;
        // SAFETY: NULL or a valid config, per the documentation.
        let config = match unsafe { config.as_ref() } {
            Some(c) => config_arg(c)?,
            None => CacheConfig::default(),
        };
        let inner = GraphCache::new(CudaGraphs, config)?;
        *out = handle::publish(xcall_graph_cache { inner })?;
        Ok(())
    })
}

/// Frees a cache and destroys its executable graphs. NULL and the XLA
/// handlers' cache (`xcall_xla_graph_cache()`, owned by the library) are
/// no-ops. No other call on the cache may be in flight. A handle that is
/// not live (freed already, not made by xcall) is left alone and
/// `xcall_last_error_message()` says so.
///
/// Bad input: NULL, a freed or foreign handle and the XLA handlers' cache
/// are left alone (the function returns no status; a handle that is not
/// live is named in the last error message).
#[no_mangle]
pub extern "C" fn xcall_graph_cache_free(cache: *mut xcall_graph_cache) {
    let _ = ffi_call!({
        drop(handle::release(cache, "cache")?);
        Ok(())
    });
}

/// Runs one call through the cache. On Host, `record(user_data, NULL)` runs
/// directly. On CUDA, the cached graph for the call's exact key is replayed
/// on `call->target.stream`, or `record(user_data, stream)` is captured into a
/// graph and launched (or updates a cached graph that differs only in buffer
/// addresses; with `XCALL_CALL_RELOCATABLE` such a graph may instead be
/// patched without calling `record`), or runs directly when capture is not possible (policy
/// disabled, the stream is already being captured by the caller, another
/// thread is capturing the same key, or capture failed). `*out_outcome`
/// receives an `xcall_graph_outcome` value.
///
/// Errors: `XCALL_STATUS_NULL_ARGUMENT`, `XCALL_STATUS_INVALID_ARGUMENT` (no
/// buffers, unknown platform or role, a stream of another device, the NULL
/// stream on CUDA), `XCALL_STATUS_NO_SUCH_DEVICE`,
/// `XCALL_STATUS_CUDA_UNAVAILABLE`, `XCALL_STATUS_CUDA_DRIVER`,
/// `XCALL_STATUS_CALLBACK_FAILED` (`record` returned non-zero when it ran
/// directly; if it fails under capture it runs once more directly and that
/// result counts). Thread-safe.
///
/// Bad input: NULL cache, call or record: `XCALL_STATUS_NULL_ARGUMENT`; a
/// freed or foreign cache: `XCALL_STATUS_INVALID_HANDLE`; an unknown
/// platform, buffer role or flag bit, no buffers, a buffer past the end of
/// the address space: `XCALL_STATUS_INVALID_ARGUMENT`; a Host ordinal other
/// than 0, a CUDA device that does not exist:
/// `XCALL_STATUS_NO_SUCH_DEVICE`; all before `record` runs.
#[no_mangle]
pub extern "C" fn xcall_graph_cache_execute(
    cache: *const xcall_graph_cache,
    call: *const xcall_call,
    record: xcall_record_fn,
    user_data: *mut c_void,
    out_outcome: *mut u32,
) -> Status {
    ffi_call!({
        let cache = cache_ref(cache)?;
        // SAFETY: NULL or a valid call, per the documentation.
        let call = unsafe { call.as_ref() }
            .ok_or_else(|| FfiError::new(Status::NullArgument, "call is NULL"))?;
        let record = record.ok_or_else(|| FfiError::new(Status::NullArgument, "record is NULL"))?;
        let out = out_ptr(out_outcome, "out_outcome")?;
        if call.flags & !CALL_FLAGS != 0 {
            return Err(FfiError::new(
                Status::InvalidArgument,
                format!(
                    "call->flags {:#x} has bits xcall does not define ({:#x})",
                    call.flags,
                    call.flags & !CALL_FLAGS
                ),
            ));
        }
        let device = call.target.device()?;
        let raw: &[xcall_buffer] = match (call.buffers.is_null(), call.num_buffers) {
            (_, 0) => &[],
            (true, _) => return Err(FfiError::new(Status::NullArgument, "call->buffers is NULL")),
            // SAFETY: the caller promises num_buffers readable entries.
            (false, n) => unsafe { std::slice::from_raw_parts(call.buffers, n) },
        };
        let buffers = raw
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let role = b.role.get().map_err(|e| {
                    FfiError::new(e.status, format!("buffer {i} has {}", e.message))
                })?;
                Ok(Buffer::new(b.address, b.bytes, role))
            })
            .collect::<Result<Vec<_>, FfiError>>()?;
        let key = CallKey {
            device,
            target: call.target_id,
            attributes: Attributes::word(call.attributes),
            buffers,
        };
        let stream = call
            .target
            .cuda_stream(device)
            .map(|s| CudaStreamHandle(s.cast()));
        let mut graph_call = Call::new(key, stream);
        graph_call.relocatable = call.flags & XCALL_CALL_RELOCATABLE != 0;
        let outcome = cache.inner.execute(&graph_call, |stream| {
            let stream = stream.map_or(std::ptr::null_mut(), |s| s.0.cast());
            // SAFETY: the caller's callback with the caller's user_data.
            match unsafe { record(user_data, stream) } {
                0 => Ok(()),
                code => Err(CallbackStatus(code)),
            }
        })?;
        *out = outcome as u32;
        Ok(())
    })
}

/// Evicts every graph of `target`'s device (its stream is ignored) whose
/// buffers overlap `[address, address + bytes)`; call it before freeing
/// that memory. The number evicted goes to `*out_evicted`. Thread-safe.
///
/// Bad input: NULL cache, target or `out_evicted`:
/// `XCALL_STATUS_NULL_ARGUMENT`; a freed or foreign cache:
/// `XCALL_STATUS_INVALID_HANDLE`; bytes 0, a range past the end of the
/// address space, an unknown platform: `XCALL_STATUS_INVALID_ARGUMENT`; a
/// Host ordinal other than 0: `XCALL_STATUS_NO_SUCH_DEVICE`; nothing is
/// evicted on an error.
#[no_mangle]
pub extern "C" fn xcall_graph_cache_invalidate_range(
    cache: *const xcall_graph_cache,
    target: *const xcall_target,
    address: u64,
    bytes: u64,
    out_evicted: *mut usize,
) -> Status {
    ffi_call!({
        let cache = cache_ref(cache)?;
        let out = out_ptr(out_evicted, "out_evicted")?;
        let n = cache
            .inner
            .invalidate_range(device_arg(target)?, address, bytes)?;
        *out = n;
        Ok(())
    })
}

/// Evicts every graph of `target`'s device (its stream is ignored); the
/// number evicted goes to `*out_evicted`. Thread-safe.
///
/// Bad input: NULL cache, target or `out_evicted`:
/// `XCALL_STATUS_NULL_ARGUMENT`; a freed or foreign cache:
/// `XCALL_STATUS_INVALID_HANDLE`; an unknown platform:
/// `XCALL_STATUS_INVALID_ARGUMENT`; a Host ordinal other than 0:
/// `XCALL_STATUS_NO_SUCH_DEVICE`; nothing is evicted on an error.
#[no_mangle]
pub extern "C" fn xcall_graph_cache_clear(
    cache: *const xcall_graph_cache,
    target: *const xcall_target,
    out_evicted: *mut usize,
) -> Status {
    ffi_call!({
        let cache = cache_ref(cache)?;
        let out = out_ptr(out_evicted, "out_evicted")?;
        *out = cache.inner.clear(device_arg(target)?);
        Ok(())
    })
}

/// Evicts every graph of every device, one device at a time; the number
/// evicted goes to `*out_evicted`. Thread-safe.
///
/// Bad input: NULL cache or `out_evicted`: `XCALL_STATUS_NULL_ARGUMENT`; a
/// freed or foreign cache: `XCALL_STATUS_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn xcall_graph_cache_clear_all(
    cache: *const xcall_graph_cache,
    out_evicted: *mut usize,
) -> Status {
    ffi_call!({
        let cache = cache_ref(cache)?;
        let out = out_ptr(out_evicted, "out_evicted")?;
        *out = cache.inner.clear_all();
        Ok(())
    })
}

/// Counters of `target`'s device (its stream is ignored; all zero for a
/// device the cache never saw) in `*out_stats`. Thread-safe.
///
/// Bad input: NULL cache, target or `out_stats`:
/// `XCALL_STATUS_NULL_ARGUMENT`; a freed or foreign cache:
/// `XCALL_STATUS_INVALID_HANDLE`; an unknown platform:
/// `XCALL_STATUS_INVALID_ARGUMENT`; a Host ordinal other than 0:
/// `XCALL_STATUS_NO_SUCH_DEVICE`; `*out_stats` is written only on success.
#[no_mangle]
pub extern "C" fn xcall_graph_cache_stats(
    cache: *const xcall_graph_cache,
    target: *const xcall_target,
    out_stats: *mut Stats,
) -> Status {
    ffi_call!({
        let cache = cache_ref(cache)?;
        let out = out_ptr(out_stats, "out_stats")?;
        *out = cache.inner.stats(device_arg(target)?);
        Ok(())
    })
}

c_code!(
    /// An `xcall_graph_policy` as passed.
    PolicyCode => Policy
);
c_code!(
    /// An `xcall_buffer_role` as passed.
    BufferRoleCode => BufferRole
);
