//! NCCL, opened at run time: the transport of the pairs of a CUDA world
//! that are not directly addressable (peers on other hosts, or every pair
//! when `XCALL_SHMEM_TRANSPORT=nccl` forces it).
//!
//! Nothing links against NCCL: the library builds and runs without it, and
//! a world that needs it and cannot load it fails at init with the places
//! searched. The library is found, in this order:
//! 1. `XCALL_NCCL_LIB`: a file, or a folder holding `libnccl.so.2`
//!    (nothing else is tried when it is set);
//! 2. the dynamic loader's own search: `libnccl.so.2`, then `libnccl.so`
//!    (`LD_LIBRARY_PATH`, the ld.so cache);
//! 3. the NVIDIA Python wheels' `nvidia/nccl/lib/libnccl.so.2` (the NCCL
//!    that PyTorch and JAX install) under: the site-packages folder of
//!    xcall's own library when it was loaded from an installed `xcall`
//!    package, each `PYTHONPATH` entry, `$VIRTUAL_ENV` and
//!    `$CONDA_PREFIX`, `~/.local`, `/usr/local` and `/usr` (every
//!    `python3.*` folder of each).
//!
//! xcall needs NCCL 2.14 or newer: its communicators are non-blocking
//! (`blocking = 0`), so every wait on NCCL polls with the world's timeout
//! and a failed or silent peer aborts the communicator instead of hanging
//! the process. Data moves with two-sided `ncclSend`/`ncclRecv` groups on
//! every version (see `World::exchange`).
//!
//! NCCL 2.29 added host-initiated one-sided operations: memory windows
//! (`ncclCommWindowRegister` over memory from `ncclMemAlloc`) and
//! `ncclPutSignal`, whose writes to one peer land in the order they were
//! issued. When the loaded NCCL has them ([`Library::one_sided`]) and can
//! run them on a world's communicator, the world's heap is NCCL's memory,
//! registered as one window, and `World::put` and `World::put_signal` reach
//! a PE through NCCL with no call on its side (see `World::init`).
//!
//! NVLink SHARP stays off: before its first communicator xcall sets
//! `NCCL_NVLS_ENABLE=0` unless the caller set it (a multicast object can
//! take a shared host's GPUs out of service).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use xcall_core::cuda::ContextGuard;
use xcall_core::Device;

use crate::error::{Result, ShmemError};

/// Environment variable naming the NCCL library (a file, or a folder that
/// holds `libnccl.so.2`).
pub const LIB_ENV: &str = "XCALL_NCCL_LIB";
/// The oldest NCCL xcall uses: 2.14 (non-blocking communicators).
pub const MIN_VERSION: Version = Version {
    major: 2,
    minor: 14,
    patch: 0,
};
/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const UNIQUE_ID_BYTES: usize = 128;

type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
const REMOTE_ERROR: NcclResult = 6;
const IN_PROGRESS: NcclResult = 7;
/// `ncclUint8`.
const UINT8: c_int = 1;
/// `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: c_int = c_int::MIN;

type RawComm = *mut c_void;
/// `ncclWindow_t`.
type RawWindow = *mut c_void;

/// `ncclUniqueId`: passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [u8; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.14 laid it out; NCCL reads `size` bytes and
/// takes the fields of later versions from their defaults (`version`).
#[repr(C)]
struct CommConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

/// An NCCL version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl Version {
    /// The version `ncclGetVersion` encodes: `major*10000 + minor*100 +
    /// patch` since 2.9, `major*1000 + minor*100 + patch` before.
    pub fn from_code(code: u32) -> Version {
        let (major, rest) = if code >= 10000 {
            (code / 10000, code % 10000)
        } else {
            (code / 1000, code % 1000)
        };
        Version {
            major,
            minor: rest / 100,
            patch: rest % 100,
        }
    }

    fn code(self) -> u32 {
        self.major * 10000 + self.minor * 100 + self.patch
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type InitRankConfig =
    unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut CommConfig) -> NcclResult;
type AsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
type CommCall = unsafe extern "C" fn(RawComm) -> NcclResult;
type ErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type LastError = unsafe extern "C" fn(RawComm) -> *const c_char;
type Group = unsafe extern "C" fn() -> NcclResult;
type Send =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;
type Recv =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;
type MemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult;
type MemFree = unsafe extern "C" fn(*mut c_void) -> NcclResult;
type WindowRegister =
    unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut RawWindow, c_int) -> NcclResult;
type WindowDeregister = unsafe extern "C" fn(RawComm, RawWindow) -> NcclResult;
type PutSignal = unsafe extern "C" fn(
    *const c_void,
    usize,
    c_int,
    c_int,
    RawWindow,
    usize,
    c_int,
    c_int,
    u32,
    RawComm,
    *mut c_void,
) -> NcclResult;
type Signal = unsafe extern "C" fn(c_int, c_int, c_int, u32, RawComm, *mut c_void) -> NcclResult;

/// The entry points of NCCL's host-initiated one-sided operations (NCCL
/// 2.29 and newer), present together or not at all.
#[derive(Clone, Copy)]
struct OneSided {
    mem_alloc: MemAlloc,
    mem_free: MemFree,
    register: WindowRegister,
    deregister: WindowDeregister,
    put_signal: PutSignal,
    signal: Signal,
}

/// A loaded NCCL: where it was found, its version, and the entry points
/// xcall calls.
pub struct Library {
    path: PathBuf,
    version: Version,
    one_sided: Option<OneSided>,
    get_unique_id: GetUniqueId,
    init_rank_config: InitRankConfig,
    async_error: AsyncError,
    finalize: CommCall,
    destroy: CommCall,
    abort: CommCall,
    error_string: ErrorString,
    last_error: LastError,
    group_start: Group,
    group_end: Group,
    send: Send,
    recv: Recv,
    // Last: the entry points above point into it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("one_sided", &self.one_sided.is_some())
            .finish()
    }
}

/// The file behind a loaded symbol (`dladdr`), when the loader says.
fn file_of(symbol: *const c_void) -> Option<PathBuf> {
    // SAFETY: `Dl_info` is plain C data; zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    let found = unsafe { libc::dladdr(symbol, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string the loader owns for as long as the
    // object stays loaded; copied at once.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(name.to_string_lossy().into_owned()))
}

impl Library {
    /// Opens the NCCL at `path` (a path, or a bare file name for the
    /// loader's search) and checks it: an NCCL of at least
    /// [`MIN_VERSION`] with every entry point xcall calls.
    pub fn open(path: &Path) -> std::result::Result<Library, String> {
        // SAFETY: loading runs the library's initialisers; NCCL's set up
        // its own state only (it loads CUDA lazily, on first use).
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| {
            let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
            format!("cannot load {}: {why}", path.display())
        })?;
        fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> std::result::Result<T, String> {
            // SAFETY: every `T` used below is the C signature that nccl.h
            // declares for `name`.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|_| format!("it has no {name}: not an NCCL library, or older than 2.14"))
        }
        let get_version: GetVersion = sym(&lib, "ncclGetVersion")?;
        let mut code: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { get_version(&mut code) };
        let version = usable_version(r, code)?;
        let one_sided = (|| {
            Some(OneSided {
                mem_alloc: sym(&lib, "ncclMemAlloc").ok()?,
                mem_free: sym(&lib, "ncclMemFree").ok()?,
                register: sym(&lib, "ncclCommWindowRegister").ok()?,
                deregister: sym(&lib, "ncclCommWindowDeregister").ok()?,
                put_signal: sym(&lib, "ncclPutSignal").ok()?,
                signal: sym(&lib, "ncclSignal").ok()?,
            })
        })();
        let path = file_of(get_version as *const c_void).unwrap_or_else(|| path.to_path_buf());
        Ok(Library {
            path,
            version,
            one_sided,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            init_rank_config: sym(&lib, "ncclCommInitRankConfig")?,
            async_error: sym(&lib, "ncclCommGetAsyncError")?,
            finalize: sym(&lib, "ncclCommFinalize")?,
            destroy: sym(&lib, "ncclCommDestroy")?,
            abort: sym(&lib, "ncclCommAbort")?,
            error_string: sym(&lib, "ncclGetErrorString")?,
            last_error: sym(&lib, "ncclGetLastError")?,
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            send: sym(&lib, "ncclSend")?,
            recv: sym(&lib, "ncclRecv")?,
            _lib: lib,
        })
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Whether it has NCCL's host-initiated one-sided operations
    /// (`ncclMemAlloc`, `ncclCommWindowRegister`, `ncclPutSignal`,
    /// `ncclSignal`: NCCL 2.29 and newer).
    pub fn one_sided(&self) -> bool {
        self.one_sided.is_some()
    }

    fn one_sided_calls(&self) -> Result<OneSided> {
        self.one_sided.ok_or_else(|| {
            ShmemError::Unsupported(format!(
                "NCCL {} at {} has no one-sided operations (NCCL 2.29 and newer have them)",
                self.version,
                self.path.display()
            ))
        })
    }

    fn describe(&self, r: NcclResult, comm: RawComm) -> String {
        // SAFETY: NCCL returns static strings for any result code.
        let name = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy();
        let last = if comm.is_null() {
            String::new()
        } else {
            // SAFETY: a live communicator; NCCL owns the returned string
            // until its next call on this thread, copied at once.
            let p = unsafe { (self.last_error)(comm) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        if last.is_empty() {
            format!("{name} ({r})")
        } else {
            format!("{name} ({r}): {last}")
        }
    }

    fn error(&self, call: &str, r: NcclResult, comm: RawComm) -> ShmemError {
        let msg = format!("NCCL {call}: {}", self.describe(r, comm));
        if r == REMOTE_ERROR {
            ShmemError::PeerFailed(msg)
        } else {
            ShmemError::System(msg)
        }
    }
}

/// The version `ncclGetVersion` returned (`r`, `code`), when xcall can use
/// it.
fn usable_version(r: NcclResult, code: c_int) -> std::result::Result<Version, String> {
    if r != SUCCESS || code <= 0 {
        return Err(format!("ncclGetVersion failed ({r}, version {code})"));
    }
    let version = Version::from_code(code as u32);
    if version < MIN_VERSION {
        return Err(format!(
            "it is NCCL {version}; xcall needs {MIN_VERSION} or newer (non-blocking communicators)"
        ));
    }
    Ok(version)
}

/// The places searched after [`LIB_ENV`], in order: the loader's names,
/// then every wheel folder that exists on this machine.
pub fn candidates() -> Vec<PathBuf> {
    let own = file_of(candidates as *const c_void);
    search(&|name| std::env::var_os(name), own.as_deref())
}

/// [`candidates`] with the environment read through `env` and xcall's own
/// library at `own`.
fn search(env: &dyn Fn(&str) -> Option<std::ffi::OsString>, own: Option<&Path>) -> Vec<PathBuf> {
    let mut out = vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")];
    let mut roots: Vec<PathBuf> = Vec::new();
    // An installed `xcall` package: site-packages/xcall/libxcall.so.
    if let Some(site) = own.and_then(Path::parent).and_then(Path::parent) {
        roots.push(site.to_path_buf());
    }
    if let Some(pp) = env("PYTHONPATH") {
        roots.extend(std::env::split_paths(&pp));
    }
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| env(v))
        .map(PathBuf::from)
        .collect();
    if let Some(home) = env("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.push("/usr/local".into());
    prefixes.push("/usr".into());
    for prefix in prefixes {
        roots.push(prefix.join("lib/python3/dist-packages"));
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            roots.push(py.join("site-packages"));
            roots.push(py.join("dist-packages"));
        }
    }
    for root in roots {
        let file = root.join("nvidia/nccl/lib/libnccl.so.2");
        if file.is_file() && !out.contains(&file) {
            out.push(file);
        }
    }
    out
}

/// Finds NCCL: `over` (the value of [`LIB_ENV`]) alone when given, else
/// the [`candidates`] in order; the error names every place tried.
pub fn find(over: Option<&str>) -> std::result::Result<Library, String> {
    if let Some(v) = over {
        let p = Path::new(v);
        let file = if p.is_dir() {
            p.join("libnccl.so.2")
        } else {
            p.to_path_buf()
        };
        return Library::open(&file).map_err(|e| format!("{LIB_ENV}={v:?}: {e}"));
    }
    let mut tried = Vec::new();
    for c in candidates() {
        match Library::open(&c) {
            Ok(lib) => return Ok(lib),
            Err(e) if c.is_absolute() => tried.push(format!("{}: {e}", c.display())),
            Err(_) => tried.push(format!("{} (not on the loader's path)", c.display())),
        }
    }
    Err(format!(
        "NCCL was not found (install it, or set {LIB_ENV} to its libnccl.so.2); tried {}",
        tried.join("; ")
    ))
}

/// The process's NCCL, found once ([`find`] with [`LIB_ENV`]).
pub fn library() -> Result<&'static Library> {
    static LIB: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let over = std::env::var(LIB_ENV).ok().filter(|v| !v.is_empty());
        find(over.as_deref())
    })
    .as_ref()
    .map_err(|e| ShmemError::Unsupported(e.clone()))
}

/// Sets `NCCL_NVLS_ENABLE=0` once, before the first communicator, unless
/// the caller set it.
fn nvls_off() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
}

/// A new NCCL unique id (rank 0 makes it; the bootstrap spreads it).
pub fn unique_id(device: Device) -> Result<Vec<u8>> {
    let lib = library()?;
    nvls_off();
    let _ctx = ContextGuard::primary(device)?;
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: writes one ncclUniqueId.
    let r = unsafe { (lib.get_unique_id)(&mut id) };
    if r != SUCCESS {
        return Err(lib.error("ncclGetUniqueId", r, std::ptr::null_mut()));
    }
    Ok(id.internal.to_vec())
}

/// `ncclWindow_t` flags of a world's window: `NCCL_WIN_COLL_SYMMETRIC`
/// (every rank's heap has the same size and layout) and
/// `NCCL_WIN_STRICT_ORDERING` (over InfiniBand too, writes to a window land
/// in the order issued: a signal word after its data).
const WINDOW_FLAGS: c_int = 0x01 | 0x02;

/// `len` bytes of device memory on `device` from `ncclMemAlloc`: memory NCCL
/// can register as a window (and every GPU with peer access to `device`
/// may access). Freed with [`free`].
pub(crate) fn alloc(device: Device, len: usize) -> Result<u64> {
    let lib = library()?;
    let calls = lib.one_sided_calls()?;
    let _ctx = ContextGuard::primary(device)?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer; NCCL allocates on the current device,
    // which the guard made `device`.
    let r = unsafe { (calls.mem_alloc)(&mut p, len) };
    if r != SUCCESS || p.is_null() {
        return Err(lib
            .error("ncclMemAlloc", r, std::ptr::null_mut())
            .context(format!("symmetric heap of {len} bytes")));
    }
    Ok(p as u64)
}

/// Frees memory from [`alloc`].
pub(crate) fn free(device: Device, base: u64) {
    let Ok(lib) = library() else { return };
    let Ok(calls) = lib.one_sided_calls() else {
        return;
    };
    let ctx = ContextGuard::primary(device);
    // SAFETY: memory from `alloc`, freed once (its owner is dropped).
    let r = unsafe { (calls.mem_free)(base as *mut c_void) };
    drop(ctx);
    if r != SUCCESS {
        tracing::warn!(device = %device, result = r, "ncclMemFree failed");
    }
}

/// Bytes of the window of [`Comm::one_sided_works`].
const PROBE_BYTES: usize = 2 << 20;

/// One segment of a grouped transfer: `bytes` at `address` (device
/// memory of the communicator's device), to or from `peer`.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    /// The peer's rank in the communicator.
    pub peer: usize,
    /// Source (send) or destination (receive) address.
    pub address: u64,
    /// Bytes.
    pub bytes: usize,
}

/// One PE's NCCL communicator (non-blocking). Aborted when dropped
/// without [`Comm::finalize`]: at once, or, while CUDA graphs that captured
/// its work are alive, on a thread of its own that NCCL keeps until those
/// graphs are destroyed (the abort ends their running kernels first).
pub struct Comm {
    lib: &'static Library,
    raw: RawComm,
    device: Device,
    rank: usize,
    /// CUDA graphs alive that captured this communicator's work (see
    /// [`Comm::graphs`]).
    graphs: Arc<AtomicUsize>,
    /// The window over the world's heap ([`Comm::register_window`]), or
    /// null.
    window: RawWindow,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time; the world that owns it serialises its use (&mut self).
unsafe impl std::marker::Send for Comm {}

impl Comm {
    /// Joins the communicator of `id` as `rank` of `size` on `device`;
    /// waits at most `timeout`, and gives up early when `healthy` fails
    /// (a peer left).
    pub fn init(
        device: Device,
        id: &[u8],
        rank: usize,
        size: usize,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<Comm> {
        let lib = library()?;
        let id: [u8; UNIQUE_ID_BYTES] = id.try_into().map_err(|_| {
            ShmemError::Mismatch(format!(
                "an NCCL id of {} bytes; NCCL's are {UNIQUE_ID_BYTES}",
                id.len()
            ))
        })?;
        let (nranks, r) = match (c_int::try_from(size), c_int::try_from(rank)) {
            (Ok(n), Ok(r)) if r < n => (n, r),
            _ => {
                return Err(ShmemError::InvalidArgument(format!(
                    "rank {rank} of {size} does not fit an NCCL communicator"
                )))
            }
        };
        nvls_off();
        let ctx = ContextGuard::primary(device)?;
        let mut config = CommConfig {
            size: std::mem::size_of::<CommConfig>(),
            magic: 0xcafe_beef,
            version: MIN_VERSION.code(),
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
        };
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; `config` is NCCL 2.14's
        // layout with its `size`, `magic` and `version` set as
        // NCCL_CONFIG_INITIALIZER sets them.
        let res = unsafe {
            (lib.init_rank_config)(&mut raw, nranks, UniqueId { internal: id }, r, &mut config)
        };
        if raw.is_null() {
            return Err(lib.error("ncclCommInitRankConfig", res, raw));
        }
        let comm = Comm {
            lib,
            raw,
            device,
            rank,
            graphs: Arc::default(),
            window: std::ptr::null_mut(),
        };
        if res != SUCCESS && res != IN_PROGRESS {
            return Err(lib.error("ncclCommInitRankConfig", res, raw));
        }
        drop(ctx);
        comm.wait("ncclCommInitRankConfig", timeout, healthy)?;
        Ok(comm)
    }

    /// The count of CUDA graphs alive that captured this communicator's
    /// work, for whoever captures it to keep: NCCL neither finishes nor
    /// aborts a communicator before every such graph is destroyed.
    pub fn graphs(&self) -> &Arc<AtomicUsize> {
        &self.graphs
    }

    /// How many such graphs are alive, after waiting up to `grace` (at
    /// most 2 s) for it to reach 0: a destroyed graph releases its count
    /// on a driver thread, a moment later.
    pub fn graphs_alive(&self, grace: Duration) -> usize {
        settled_count(&self.graphs, grace)
    }

    /// Whether the communicator's pending work (init, a group, finalize)
    /// is done; its asynchronous error (a failed `call`, a peer that
    /// failed or left, a network error) if it has one. Never waits.
    pub fn progress(&self, call: &str) -> Result<bool> {
        let mut state: NcclResult = IN_PROGRESS;
        // SAFETY: a live communicator; writes one result.
        let r = unsafe { (self.lib.async_error)(self.raw, &mut state) };
        if r != SUCCESS {
            return Err(self.lib.error("ncclCommGetAsyncError", r, self.raw));
        }
        match state {
            SUCCESS => Ok(true),
            IN_PROGRESS => Ok(false),
            e => Err(self.lib.error(call, e, self.raw)),
        }
    }

    /// Polls the communicator until its pending work (init, a group) is
    /// enqueued: its error if it failed, a timeout after `timeout`, the
    /// error of `healthy` if it fails first.
    fn wait(&self, call: &str, timeout: Duration, healthy: &dyn Fn() -> Result<()>) -> Result<()> {
        let done = crate::error::poll(timeout, || {
            if self.progress(call)? {
                return Ok(true);
            }
            healthy().map(|_| false)
        })?;
        if done {
            return Ok(());
        }
        Err(ShmemError::Timeout(format!(
            "rank {}: NCCL {call} did not complete within {timeout:?} (a peer did not join or stopped)",
            self.rank
        )))
    }

    /// Makes the NCCL call `call` (named `name`) with the communicator's
    /// device current, then waits up to `timeout` for it to complete (see
    /// [`Comm::wait`]).
    fn call_and_wait(
        &self,
        name: &str,
        call: impl FnOnce() -> NcclResult,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let ctx = ContextGuard::primary(self.device)?;
        let r = call();
        drop(ctx);
        if r != SUCCESS && r != IN_PROGRESS {
            return Err(self.lib.error(name, r, self.raw));
        }
        self.wait(name, timeout, healthy)
    }

    /// Enqueues every send and receive on `stream` as one NCCL group
    /// (segments with one peer are matched in order, as NCCL matches
    /// them); returns once NCCL has enqueued them.
    ///
    /// # Safety
    /// Every segment's range must be device memory valid for the whole
    /// transfer (readable for sends, writable for receives), and `stream`
    /// a live stream of the communicator's device.
    pub unsafe fn group(
        &self,
        sends: &[Segment],
        recvs: &[Segment],
        stream: *mut c_void,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let lib = self.lib;
        let posts = sends
            .iter()
            .map(|s| (true, s))
            .chain(recvs.iter().map(|s| (false, s)));
        let issue = || {
            let mut first = None;
            for (send, s) in posts {
                let (address, peer) = (s.address as *mut c_void, s.peer as c_int);
                // SAFETY: the caller's contract; `peer` is below the size
                // (checked by the world).
                let r = unsafe {
                    match send {
                        true => (lib.send)(address, s.bytes, UINT8, peer, self.raw, stream),
                        false => (lib.recv)(address, s.bytes, UINT8, peer, self.raw, stream),
                    }
                };
                if r != SUCCESS && r != IN_PROGRESS {
                    let call = if send { "ncclSend" } else { "ncclRecv" };
                    first.get_or_insert_with(|| lib.error(call, r, self.raw));
                }
            }
            first
        };
        self.in_group("ncclGroupEnd", issue, timeout, healthy)
    }

    /// Runs `issue` (NCCL calls on this communicator, returning the first
    /// that failed) inside one NCCL group, with the communicator's device
    /// current, then waits up to `timeout` for NCCL to enqueue the group
    /// (`what` names it in a timeout).
    fn in_group(
        &self,
        what: &str,
        issue: impl FnOnce() -> Option<ShmemError>,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let lib = self.lib;
        let ctx = ContextGuard::primary(self.device)?;
        // SAFETY: no arguments.
        let r = unsafe { (lib.group_start)() };
        if r != SUCCESS {
            return Err(lib.error("ncclGroupStart", r, self.raw));
        }
        let first = issue();
        // A group started is always ended, also after a failed call in it.
        // SAFETY: no arguments.
        let r = unsafe { (lib.group_end)() };
        drop(ctx);
        if let Some(e) = first {
            return Err(e);
        }
        if r != SUCCESS && r != IN_PROGRESS {
            return Err(lib.error("ncclGroupEnd", r, self.raw));
        }
        self.wait(what, timeout, healthy)
    }

    /// Registers `[base, base + len)` (memory from `ncclMemAlloc`) as the
    /// communicator's window, collectively: every rank registers its heap.
    /// Returns whether NCCL made one (it makes none, successfully, where
    /// the communicator has no symmetric-memory support).
    pub fn register_window(
        &mut self,
        base: u64,
        len: usize,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let calls = self.lib.one_sided_calls()?;
        // NCCL writes the handle when the registration completes, which on
        // a non-blocking communicator may be after the call returns: into
        // memory that outlives a wait that gives up (then leaked).
        let out: *mut RawWindow = Box::into_raw(Box::new(std::ptr::null_mut()));
        let register = || {
            // SAFETY: a live communicator; `base` is `len` bytes of NCCL's
            // memory; `out` stays valid until reclaimed below, once the
            // registration completed.
            unsafe { (calls.register)(self.raw, base as *mut c_void, len, out, WINDOW_FLAGS) }
        };
        self.call_and_wait("ncclCommWindowRegister", register, timeout, healthy)?;
        // SAFETY: from Box::into_raw above; the registration completed, so
        // NCCL no longer writes it.
        self.window = *unsafe { Box::from_raw(out) };
        Ok(!self.window.is_null())
    }

    /// Writes, one-sided, each `(src, offset, bytes)` of `puts` at `offset`
    /// of `peer`'s window, as one NCCL group on `stream`: the writes land
    /// in the order given (NCCL orders operations to one peer); returns
    /// once NCCL has enqueued them.
    ///
    /// # Safety
    /// Every `src` readable for its bytes until the stream has run the
    /// puts; every `[offset, offset + bytes)` inside the window; `stream` a
    /// live stream of the communicator's device.
    pub unsafe fn put(
        &self,
        peer: usize,
        puts: &[(u64, usize, usize)],
        stream: *mut c_void,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let lib = self.lib;
        let calls = lib.one_sided_calls()?;
        if self.window.is_null() {
            return Err(ShmemError::State(format!(
                "rank {}: this communicator has no window to put into",
                self.rank
            )));
        }
        let issue = || {
            let mut first = None;
            for &(src, offset, bytes) in puts {
                // SAFETY: the caller's contract; `peer` is below the size
                // (checked by the world); signal index, context and flags
                // 0.
                let r = unsafe {
                    (calls.put_signal)(
                        src as *const c_void,
                        bytes,
                        UINT8,
                        peer as c_int,
                        self.window,
                        offset,
                        0,
                        0,
                        0,
                        self.raw,
                        stream,
                    )
                };
                if r != SUCCESS && r != IN_PROGRESS {
                    first.get_or_insert_with(|| lib.error("ncclPutSignal", r, self.raw));
                }
            }
            first
        };
        self.in_group("ncclPutSignal", issue, timeout, healthy)
    }

    /// Whether NCCL runs host-initiated one-sided operations among this
    /// communicator's ranks: a window of its own (NCCL sets one-sided
    /// operations up with a communicator's first window), then a signal to
    /// itself, run to completion. NCCL refuses them among ranks it cannot
    /// reach that way and then fails the communicator: call it on a
    /// communicator made for the question, which it aborts. Collective.
    pub fn one_sided_works(
        self,
        timeout: Duration,
        healthy: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let stream = crate::cuda::Stream::new(self.device)?;
        let buffer = crate::cuda::DeviceHeap::through_nccl(self.device, PROBE_BYTES)?;
        // Declared after the window's memory: dropped (aborted) before it.
        let mut comm = self;
        if comm.register_window(buffer.base, PROBE_BYTES, timeout, healthy)? {
            comm.signals_itself(&stream, timeout)
        } else {
            Ok(false)
        }
    }

    /// A signal to itself, run to completion on `stream` (see
    /// [`Comm::one_sided_works`]).
    fn signals_itself(self, stream: &crate::cuda::Stream, timeout: Duration) -> Result<bool> {
        let calls = self.lib.one_sided_calls()?;
        let ctx = ContextGuard::primary(self.device)?;
        // SAFETY: a live communicator and stream of its device; signal
        // index, context and flags 0.
        let r = unsafe { (calls.signal)(self.rank as c_int, 0, 0, 0, self.raw, stream.raw.cast()) };
        drop(ctx);
        if r != SUCCESS && r != IN_PROGRESS {
            tracing::debug!(
                rank = self.rank,
                error = %self.lib.describe(r, self.raw),
                "NCCL runs no one-sided operations on this world's communicator"
            );
            return Ok(false);
        }
        let ran = self
            .wait("ncclSignal", timeout, &|| Ok(()))
            .and_then(|_| stream.sync());
        Ok(ran.is_ok())
    }

    /// Finalizes and destroys the communicator (collective: NCCL flushes
    /// what is in flight); aborts it instead when that fails.
    pub fn finalize(self, timeout: Duration, healthy: &dyn Fn() -> Result<()>) -> Result<()> {
        if !self.window.is_null() {
            let calls = self.lib.one_sided_calls()?;
            // SAFETY: the window this communicator registered, released
            // once (finalize consumes the communicator); nothing is in
            // flight (the world's quiet came first).
            let deregister = || unsafe { (calls.deregister)(self.raw, self.window) };
            self.call_and_wait("ncclCommWindowDeregister", deregister, timeout, healthy)?;
        }
        // SAFETY: a live communicator.
        let finalize = || unsafe { (self.lib.finalize)(self.raw) };
        self.call_and_wait("ncclCommFinalize", finalize, timeout, healthy)?;
        let ctx = ContextGuard::primary(self.device)?;
        // SAFETY: a finalized communicator, destroyed once (`self` is
        // forgotten below so Drop does not abort it).
        let r = unsafe { (self.lib.destroy)(self.raw) };
        drop(ctx);
        let lib = self.lib;
        std::mem::forget(self);
        if r != SUCCESS {
            return Err(lib.error("ncclCommDestroy", r, std::ptr::null_mut()));
        }
        Ok(())
    }
}

/// `count` once it is 0, or after `timeout` has passed.
fn settled(count: &AtomicUsize, timeout: Duration) -> usize {
    // The poll ends at 0 or after the timeout; the count is read either way.
    let _ = crate::error::poll(timeout, || Ok(count.load(Ordering::Acquire) == 0));
    count.load(Ordering::Acquire)
}

/// `count` once it is 0, or after `grace` (at most 2 s) has passed.
fn settled_count(count: &AtomicUsize, grace: Duration) -> usize {
    settled(count, grace.min(Duration::from_secs(2)))
}

/// Communicators being aborted on threads of their own (see [`Comm`]'s
/// drop), not yet freed by NCCL.
static ABORTS: AtomicUsize = AtomicUsize::new(0);

/// How many dropped communicators are still being aborted on threads of
/// their own: NCCL frees each once the CUDA graphs that captured its work
/// are destroyed.
pub fn aborts_in_flight() -> usize {
    ABORTS.load(Ordering::Acquire)
}

/// Waits up to `timeout` for [`aborts_in_flight`] to reach 0 and returns
/// what remains. A process that dropped a world while graphs held its
/// NCCL transfers calls it, once those graphs are destroyed, before it
/// exits: NCCL must not be torn down under an abort in progress.
pub fn settle_aborts(timeout: Duration) -> usize {
    settled(&ABORTS, timeout)
}

/// A raw communicator handed to the thread that aborts it.
struct Aborted(RawComm);

// SAFETY: the communicator is no longer used by anyone but the thread that
// aborts it (its `Comm` is gone).
unsafe impl std::marker::Send for Aborted {}

impl Drop for Comm {
    fn drop(&mut self) {
        let alive = self.graphs_alive(Duration::from_secs(2));
        let (lib, device, raw) = (self.lib, self.device, Aborted(self.raw));
        let abort = move || {
            let raw = raw;
            let ctx = ContextGuard::primary(device);
            // SAFETY: a live communicator, released once (its `Comm` is
            // being dropped); abort first raises NCCL's abort flag, which
            // ends the kernels of its pending work (a peer that never
            // comes), then frees the communicator.
            let _ = unsafe { (lib.abort)(raw.0) };
            drop(ctx);
        };
        if alive == 0 {
            abort();
            return;
        }
        // NCCL frees an aborted communicator only once every graph that
        // captured its work is destroyed, and waits for that inside its
        // abort. Such a graph may be running, its kernels waiting for a
        // peer that left, and they end only when the abort flag is up: so
        // the abort runs on a thread of its own (the flag goes up at once;
        // the thread finishes when the graphs are gone), never on the
        // thread that drops the world, which would wait forever.
        let (done, finished) = std::sync::mpsc::channel();
        ABORTS.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name("xcall-nccl-abort".into())
            .spawn(move || {
                abort();
                ABORTS.fetch_sub(1, Ordering::AcqRel);
                let _ = done.send(());
            });
        match spawned {
            Ok(_) => {
                // The graphs' kernels end once the flag is up; give the
                // abort the grace to finish when the graphs go meanwhile.
                let finished = finished.recv_timeout(Duration::from_secs(2)).is_ok();
                tracing::warn!(
                    rank = self.rank,
                    graphs = alive,
                    finished,
                    "an NCCL communicator dropped while CUDA graphs that captured its work are alive is aborted; NCCL frees it once those graphs are destroyed (their replays no longer move data)"
                );
            }
            Err(e) => {
                ABORTS.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(
                    rank = self.rank,
                    graphs = alive,
                    error = %e,
                    "an NCCL communicator dropped while CUDA graphs that captured its work are alive is left to them: no thread could be started to abort it"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settling_waits_for_aborts_in_flight_within_its_timeout() {
        // No NCCL on this machine: the count is this test's alone.
        assert_eq!(aborts_in_flight(), 0);
        let started = std::time::Instant::now();
        assert_eq!(settle_aborts(Duration::from_secs(5)), 0);
        assert!(started.elapsed() < Duration::from_secs(1));
        // Two aborts finish on another thread within the timeout: 0.
        ABORTS.fetch_add(2, Ordering::AcqRel);
        let finisher = std::thread::spawn(|| {
            for _ in 0..2 {
                std::thread::sleep(Duration::from_millis(50));
                ABORTS.fetch_sub(1, Ordering::AcqRel);
            }
        });
        assert_eq!(settle_aborts(Duration::from_secs(5)), 0);
        finisher.join().unwrap();
        // One that does not: what remains, after the timeout.
        ABORTS.fetch_add(1, Ordering::AcqRel);
        assert_eq!(aborts_in_flight(), 1);
        let started = std::time::Instant::now();
        assert_eq!(settle_aborts(Duration::from_millis(100)), 1);
        assert!(started.elapsed() >= Duration::from_millis(100));
        ABORTS.fetch_sub(1, Ordering::AcqRel);
    }

    #[test]
    fn a_graph_count_is_awaited_for_its_grace_and_no_longer() {
        let count = Arc::new(AtomicUsize::new(0));
        assert_eq!(settled_count(&count, Duration::from_secs(5)), 0);
        // Released on another thread within the grace: 0.
        count.store(2, Ordering::Release);
        let c = count.clone();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            c.fetch_sub(1, Ordering::AcqRel);
            std::thread::sleep(Duration::from_millis(50));
            c.fetch_sub(1, Ordering::AcqRel);
        });
        assert_eq!(settled_count(&count, Duration::from_secs(2)), 0);
        releaser.join().unwrap();
        // Held: the count after the grace, which is capped at 2 s.
        count.store(3, Ordering::Release);
        let started = std::time::Instant::now();
        assert_eq!(settled_count(&count, Duration::from_millis(100)), 3);
        assert!(started.elapsed() >= Duration::from_millis(100));
        let started = std::time::Instant::now();
        assert_eq!(settled_count(&count, Duration::from_secs(3600)), 3);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(2) && waited < Duration::from_secs(10),
            "{waited:?}"
        );
    }

    #[test]
    fn versions_decode_both_encodings() {
        let v = Version::from_code(22803);
        assert_eq!((v.major, v.minor, v.patch), (2, 28, 3));
        assert_eq!(v.to_string(), "2.28.3");
        assert_eq!(v.code(), 22803);
        // Before 2.9: major*1000 + minor*100 + patch.
        let old = Version::from_code(2804);
        assert_eq!((old.major, old.minor, old.patch), (2, 8, 4));
        assert!(old < MIN_VERSION);
        assert!(Version::from_code(21400) >= MIN_VERSION);
        assert!(Version::from_code(21399) < MIN_VERSION);
        assert_eq!(MIN_VERSION.code(), 21400);
    }

    #[test]
    fn only_a_working_nccl_of_2_14_or_newer_is_used() {
        assert_eq!(usable_version(SUCCESS, 21400), Ok(MIN_VERSION));
        assert_eq!(
            usable_version(SUCCESS, 22803).unwrap().to_string(),
            "2.28.3"
        );
        let old = usable_version(SUCCESS, 21309).unwrap_err();
        assert!(
            old.contains("NCCL 2.13.9") && old.contains("2.14.0 or newer"),
            "{old}"
        );
        assert!(usable_version(SUCCESS, 2804)
            .unwrap_err()
            .contains("NCCL 2.8.4"));
        for (r, code) in [
            (3, 22803),
            (SUCCESS, 0),
            (SUCCESS, -1),
            (IN_PROGRESS, 22803),
        ] {
            let e = usable_version(r, code).unwrap_err();
            assert!(e.starts_with("ncclGetVersion failed"), "{r} {code}: {e}");
        }
    }

    #[test]
    fn the_config_has_nccl_2_14s_layout() {
        // size_t, two u32, four ints, one pointer: 40 bytes on 64-bit.
        assert_eq!(std::mem::size_of::<CommConfig>(), 40);
        assert_eq!(std::mem::offset_of!(CommConfig, blocking), 16);
        assert_eq!(std::mem::offset_of!(CommConfig, net_name), 32);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

    #[test]
    fn an_override_that_is_missing_is_named_and_nothing_else_is_tried() {
        let e = find(Some("/nonexistent/xcall-test/libnccl.so.2")).unwrap_err();
        assert!(e.starts_with(&format!("{LIB_ENV}=")), "{e}");
        assert!(e.contains("/nonexistent/xcall-test/libnccl.so.2"), "{e}");
        // A folder override looks for libnccl.so.2 in it.
        let dir = std::env::temp_dir();
        let e = find(Some(dir.to_str().unwrap())).unwrap_err();
        assert!(e.contains("libnccl.so.2"), "{e}");
    }

    #[test]
    fn a_library_that_is_not_nccl_is_refused_by_name() {
        // libc is loaded in every process: loadable, but not NCCL.
        let e = Library::open(Path::new("libc.so.6")).unwrap_err();
        assert!(e.contains("ncclGetVersion"), "{e}");
    }

    #[test]
    fn wheel_folders_are_found_in_order() {
        let root = std::env::temp_dir().join(format!("xcall-nccl-search-{}", std::process::id()));
        let wheel = |base: &Path| {
            let dir = base.join("nvidia/nccl/lib");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("libnccl.so.2"), b"not a library").unwrap();
            dir.join("libnccl.so.2")
        };
        let own_site = root.join("own/site-packages");
        let in_own = wheel(&own_site);
        let in_path = wheel(&root.join("pythonpath"));
        let in_venv = wheel(&root.join("venv/lib/python3.12/site-packages"));
        // A folder without the wheel adds nothing.
        std::fs::create_dir_all(root.join("venv/lib/python3.11/site-packages")).unwrap();
        let env = |name: &str| match name {
            "PYTHONPATH" => Some(root.join("pythonpath").into_os_string()),
            "VIRTUAL_ENV" => Some(root.join("venv").into_os_string()),
            _ => None,
        };
        let own = own_site.join("xcall/libxcall.so");
        let found = search(&env, Some(&own));
        let ours: Vec<&PathBuf> = found.iter().filter(|p| p.starts_with(&root)).collect();
        assert_eq!(ours, vec![&in_own, &in_path, &in_venv]);
        // Found but not loadable: the error names the file and why.
        let e = Library::open(&in_venv).unwrap_err();
        assert!(!e.is_empty());
        let e = find(Some(in_venv.parent().unwrap().to_str().unwrap())).unwrap_err();
        assert!(e.contains(&in_venv.display().to_string()), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_loader_names_come_first() {
        let c = candidates();
        assert_eq!(c[0], PathBuf::from("libnccl.so.2"));
        assert_eq!(c[1], PathBuf::from("libnccl.so"));
        for extra in &c[2..] {
            assert!(extra.ends_with("nvidia/nccl/lib/libnccl.so.2"), "{extra:?}");
            assert!(extra.is_file(), "{extra:?}");
        }
    }
}
