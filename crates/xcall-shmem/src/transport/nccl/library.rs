//! Finding and opening NCCL at run time: the search, the version check,
//! and the entry points xcall calls.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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

pub(super) type NcclResult = c_int;
pub(super) const SUCCESS: NcclResult = 0;
pub(super) const REMOTE_ERROR: NcclResult = 6;
pub(super) const IN_PROGRESS: NcclResult = 7;
/// `ncclUint8`.
pub(super) const UINT8: c_int = 1;
/// `NCCL_CONFIG_UNDEF_INT`.
pub(super) const UNDEF_INT: c_int = c_int::MIN;

pub(super) type RawComm = *mut c_void;
/// `ncclWindow_t`.
pub(super) type RawWindow = *mut c_void;

/// `ncclUniqueId`: passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UniqueId {
    pub(super) internal: [u8; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.14 laid it out; NCCL reads `size` bytes and
/// takes the fields of later versions from their defaults (`version`).
#[repr(C)]
pub(super) struct CommConfig {
    pub(super) size: usize,
    pub(super) magic: u32,
    pub(super) version: u32,
    pub(super) blocking: c_int,
    pub(super) cga_cluster_size: c_int,
    pub(super) min_ctas: c_int,
    pub(super) max_ctas: c_int,
    pub(super) net_name: *const c_char,
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

    pub(super) fn code(self) -> u32 {
        self.major * 10000 + self.minor * 100 + self.patch
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

pub(super) type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
pub(super) type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
pub(super) type InitRankConfig =
    unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut CommConfig) -> NcclResult;
pub(super) type AsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
pub(super) type CommCall = unsafe extern "C" fn(RawComm) -> NcclResult;
pub(super) type ErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
pub(super) type LastError = unsafe extern "C" fn(RawComm) -> *const c_char;
pub(super) type Group = unsafe extern "C" fn() -> NcclResult;
pub(super) type Send =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;
pub(super) type Recv =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;
pub(super) type MemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult;
pub(super) type MemFree = unsafe extern "C" fn(*mut c_void) -> NcclResult;
pub(super) type WindowRegister =
    unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut RawWindow, c_int) -> NcclResult;
pub(super) type WindowDeregister = unsafe extern "C" fn(RawComm, RawWindow) -> NcclResult;
pub(super) type PutSignal = unsafe extern "C" fn(
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
pub(super) type Signal =
    unsafe extern "C" fn(c_int, c_int, c_int, u32, RawComm, *mut c_void) -> NcclResult;

/// The entry points of NCCL's host-initiated one-sided operations (NCCL
/// 2.29 and newer), present together or not at all.
#[derive(Clone, Copy)]
pub(super) struct OneSided {
    pub(super) mem_alloc: MemAlloc,
    pub(super) mem_free: MemFree,
    pub(super) register: WindowRegister,
    pub(super) deregister: WindowDeregister,
    pub(super) put_signal: PutSignal,
    pub(super) signal: Signal,
}

/// A loaded NCCL: where it was found, its version, and the entry points
/// xcall calls.
pub struct Library {
    pub(super) path: PathBuf,
    pub(super) version: Version,
    pub(super) one_sided: Option<OneSided>,
    pub(super) get_unique_id: GetUniqueId,
    pub(super) init_rank_config: InitRankConfig,
    pub(super) async_error: AsyncError,
    pub(super) finalize: CommCall,
    pub(super) destroy: CommCall,
    pub(super) abort: CommCall,
    pub(super) error_string: ErrorString,
    pub(super) last_error: LastError,
    pub(super) group_start: Group,
    pub(super) group_end: Group,
    pub(super) send: Send,
    pub(super) recv: Recv,
    // Last: the entry points above point into it.
    pub(super) _lib: libloading::Library,
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
pub(super) fn file_of(symbol: *const c_void) -> Option<PathBuf> {
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

    pub(super) fn one_sided_calls(&self) -> Result<OneSided> {
        self.one_sided.ok_or_else(|| {
            ShmemError::Unsupported(format!(
                "NCCL {} at {} has no one-sided operations (NCCL 2.29 and newer have them)",
                self.version,
                self.path.display()
            ))
        })
    }

    pub(super) fn describe(&self, r: NcclResult, comm: RawComm) -> String {
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

    pub(super) fn error(&self, call: &str, r: NcclResult, comm: RawComm) -> ShmemError {
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
pub(super) fn usable_version(r: NcclResult, code: c_int) -> std::result::Result<Version, String> {
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
pub(super) fn search(
    env: &dyn Fn(&str) -> Option<std::ffi::OsString>,
    own: Option<&Path>,
) -> Vec<PathBuf> {
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
pub(super) fn nvls_off() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
}
