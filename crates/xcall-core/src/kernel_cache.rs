//! Kernels compiled at run time with NVRTC, cached per device.
//!
//! A module is compiled and loaded once per (device, architecture, source,
//! options). The cache is sharded per device: each device has its own table
//! and lock, so compiling for one device never blocks another, and a module
//! loaded into one device's context is never handed to another device.
//! Keys are compared in full (source text and options); a hash only picks
//! the bucket.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use crate::cuda::{self, CudaFunction, CudaModule};
use crate::{Device, DeviceMap, Error, Result};

/// A kernel source to compile: a program name (used in NVRTC's messages), the
/// CUDA C++ code and extra NVRTC options. An option
/// `--gpu-architecture=sm_XXa` (or `-arch=`) overrides the device's own
/// architecture, for example to enable Hopper's arch-specific instructions.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource<'a> {
    /// Program name, for example `permute.cu`.
    pub name: &'a str,
    /// CUDA C++ source text.
    pub code: &'a str,
    /// Extra NVRTC options.
    pub options: &'a [&'a str],
}

/// What a [`ModuleLoader`] is asked to build.
#[derive(Clone, Copy, Debug)]
pub struct CompileRequest<'a> {
    /// Program name.
    pub name: &'a str,
    /// CUDA C++ source text.
    pub code: &'a str,
    /// Target architecture, for example `sm_90` or `sm_90a`.
    pub arch: &'a str,
    /// NVRTC options other than the architecture.
    pub options: &'a [String],
}

/// Compiles and loads modules for one backend. The CUDA backend is
/// [`NvrtcLoader`]; tests use simulated loaders.
pub trait ModuleLoader: Send + Sync {
    /// A module loaded into one device's context.
    type Module: Send + Sync;
    /// The architecture `device` compiles for by default, for example `sm_90`.
    fn architecture(&self, device: Device) -> Result<String>;
    /// Compiles `request` and loads the result for `device`.
    fn compile_and_load(
        &self,
        device: Device,
        request: &CompileRequest<'_>,
    ) -> Result<Self::Module>;
}

struct Entry<M> {
    arch: String,
    code: String,
    options: Vec<String>,
    module: Arc<M>,
}

struct Shard<M> {
    default_arch: Option<String>,
    buckets: HashMap<u64, Vec<Entry<M>>>,
    stats: KernelCacheStats,
}

/// Counters of one device's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCacheStats {
    /// Modules compiled and loaded (cache misses that succeeded).
    pub compiles: u64,
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Compilations or loads that failed.
    pub failures: u64,
}

/// Per-device cache of compiled kernel modules. Thread-safe; lookups for
/// different devices never share a lock.
pub struct KernelCache<L: ModuleLoader = NvrtcLoader> {
    loader: L,
    shards: DeviceMap<Mutex<Shard<L::Module>>>,
    /// Bits of the hash that pick a bucket: all of them, except in tests
    /// that force every source into one bucket.
    bucket_mask: u64,
}

impl KernelCache<NvrtcLoader> {
    /// A cache that compiles with NVRTC and loads with the CUDA driver.
    /// Creating it loads nothing.
    pub fn new() -> Self {
        Self::with_loader(NvrtcLoader)
    }
}

impl Default for KernelCache<NvrtcLoader> {
    fn default() -> Self {
        Self::new()
    }
}

fn split_arch(options: &[&str]) -> Result<(Option<String>, Vec<String>)> {
    let mut arch = None;
    let mut rest = Vec::with_capacity(options.len());
    for option in options {
        let value = option
            .strip_prefix("--gpu-architecture=")
            .or_else(|| option.strip_prefix("-arch="));
        match value {
            Some(v) if arch.is_some() => {
                return Err(Error::InvalidArgument(format!(
                    "kernel options name the architecture twice (second: {v})"
                )))
            }
            Some(v) => arch = Some(v.to_string()),
            None => rest.push(option.to_string()),
        }
    }
    Ok((arch, rest))
}

fn bucket_of(arch: &str, code: &str, options: &[String]) -> u64 {
    let mut h = DefaultHasher::new();
    (arch, code, options).hash(&mut h);
    h.finish()
}

impl<L: ModuleLoader> KernelCache<L> {
    /// A cache over `loader`.
    pub fn with_loader(loader: L) -> Self {
        KernelCache {
            loader,
            shards: DeviceMap::new(),
            bucket_mask: u64::MAX,
        }
    }

    /// The module for `source` on `device`, compiled and loaded on first use.
    ///
    /// Concurrent first calls for the same device and source compile once;
    /// calls for other devices proceed in parallel. A failed compile is not
    /// cached: the error (with NVRTC's log) is returned and a later call
    /// tries again.
    pub fn module(&self, device: Device, source: &KernelSource<'_>) -> Result<Arc<L::Module>> {
        if source.code.contains('\0') || source.name.contains('\0') {
            return Err(Error::InvalidArgument(format!(
                "kernel source {:?} contains a NUL byte",
                source.name
            )));
        }
        let (arch_override, options) = split_arch(source.options)?;
        let shard = self.shards.get_or_init(device, || {
            Mutex::new(Shard {
                default_arch: None,
                buckets: HashMap::new(),
                stats: KernelCacheStats::default(),
            })
        });
        // The lock is this device's alone; holding it across the compile is
        // what makes "compile once" hold for racing callers of one device.
        let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
        let arch = match arch_override {
            Some(arch) => arch,
            None => match &shard.default_arch {
                Some(arch) => arch.clone(),
                None => {
                    let arch = self.loader.architecture(device)?;
                    shard.default_arch = Some(arch.clone());
                    arch
                }
            },
        };
        let bucket = bucket_of(&arch, source.code, &options) & self.bucket_mask;
        let found = shard.buckets.get(&bucket).and_then(|entries| {
            entries
                .iter()
                .find(|e| e.arch == arch && e.code == source.code && e.options == options)
                .map(|e| e.module.clone())
        });
        if let Some(module) = found {
            shard.stats.hits += 1;
            return Ok(module);
        }
        let request = CompileRequest {
            name: source.name,
            code: source.code,
            arch: &arch,
            options: &options,
        };
        let started = std::time::Instant::now();
        let module = match self.loader.compile_and_load(device, &request) {
            Ok(module) => Arc::new(module),
            Err(e) => {
                shard.stats.failures += 1;
                return Err(e);
            }
        };
        let took = started.elapsed();
        shard.stats.compiles += 1;
        shard.buckets.entry(bucket).or_default().push(Entry {
            arch: arch.clone(),
            code: source.code.to_string(),
            options,
            module: module.clone(),
        });
        // Logged after the device's lock is released.
        drop(shard);
        tracing::debug!(
            %device,
            name = source.name,
            arch,
            ms = %format_args!("{:.1}", took.as_secs_f64() * 1e3),
            "kernel module compiled and loaded"
        );
        Ok(module)
    }

    /// Counters of `device`'s cache (zero when the device was never used).
    pub fn stats(&self, device: Device) -> KernelCacheStats {
        self.shards
            .get(device)
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).stats)
            .unwrap_or_default()
    }

    /// Number of modules cached for `device`.
    pub fn len(&self, device: Device) -> usize {
        self.shards
            .get(device)
            .map(|s| {
                s.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .buckets
                    .values()
                    .map(Vec::len)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Drops `device`'s cached modules. Modules still held elsewhere (an
    /// `Arc` kept by a caller, a captured graph) stay loaded until released.
    pub fn clear(&self, device: Device) {
        if let Some(shard) = self.shards.get(device) {
            shard
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .buckets
                .clear();
        }
    }
}

/// A module loaded into one CUDA device's primary context.
#[derive(Debug)]
pub struct LoadedModule {
    device: Device,
    arch: String,
    module: Arc<CudaModule>,
}

impl LoadedModule {
    /// The device whose context holds the module.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The architecture the module was compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The underlying cudarc module.
    pub fn cuda_module(&self) -> &Arc<CudaModule> {
        &self.module
    }

    /// A kernel of the module by its (`extern "C"`) name.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        if name.contains('\0') {
            return Err(Error::InvalidArgument(format!(
                "kernel name {name:?} contains a NUL byte"
            )));
        }
        self.module
            .load_function(name)
            .map_err(|e| cuda::driver_error("cuModuleGetFunction", self.device, e))
    }
}

/// Compiles with NVRTC to PTX for the virtual architecture matching the
/// target (`sm_90a` -> `compute_90a`) and loads it with the driver, which
/// finishes the compile for the device.
#[derive(Clone, Copy, Debug, Default)]
pub struct NvrtcLoader;

/// NVRTC's log of a failed compile (or the error itself when there is no
/// log).
pub(crate) fn compile_log(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

impl ModuleLoader for NvrtcLoader {
    type Module = LoadedModule;

    fn architecture(&self, device: Device) -> Result<String> {
        cuda::device_info(device).map(|info| info.arch())
    }

    fn compile_and_load(
        &self,
        device: Device,
        request: &CompileRequest<'_>,
    ) -> Result<LoadedModule> {
        cuda::check_device(device)?;
        cuda::nvrtc_present()?;
        let virtual_arch = match request.arch.strip_prefix("sm_") {
            Some(rest) => format!("compute_{rest}"),
            None => request.arch.to_string(),
        };
        let mut options = vec![format!("--gpu-architecture={virtual_arch}")];
        options.extend(request.options.iter().cloned());
        let opts = cudarc::nvrtc::CompileOptions {
            options,
            name: Some(request.name.to_string()),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(request.code, opts).map_err(|e| {
            Error::CompileFailed {
                name: request.name.to_string(),
                arch: request.arch.to_string(),
                options: request.options.to_vec(),
                log: compile_log(&e),
            }
        })?;
        let module = cuda::with_context(device, |ctx| {
            ctx.load_module(ptx)
                .map_err(|e| cuda::driver_error("cuModuleLoadData", device, e))
        })?;
        Ok(LoadedModule {
            device,
            arch: request.arch.to_string(),
            module,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Platform;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    /// A module of the simulated backend: remembers where and how it was built.
    #[derive(Debug, PartialEq)]
    struct FakeModule {
        device: Device,
        arch: String,
        code: String,
        options: Vec<String>,
        serial: usize,
    }

    /// Simulated multi-device backend: device `d` has arch `sm_9{d % 2}`;
    /// sources containing `#error` fail with a log.
    #[derive(Default)]
    struct FakeLoader {
        builds: AtomicUsize,
    }

    impl ModuleLoader for FakeLoader {
        type Module = FakeModule;
        fn architecture(&self, device: Device) -> Result<String> {
            Ok(format!("sm_9{}", device.ordinal % 2))
        }
        fn compile_and_load(&self, device: Device, r: &CompileRequest<'_>) -> Result<FakeModule> {
            if r.code.contains("#error") {
                return Err(Error::CompileFailed {
                    name: r.name.into(),
                    arch: r.arch.into(),
                    options: r.options.to_vec(),
                    log: format!("{}(1): error: #error directive", r.name),
                });
            }
            Ok(FakeModule {
                device,
                arch: r.arch.into(),
                code: r.code.into(),
                options: r.options.to_vec(),
                serial: self.builds.fetch_add(1, Ordering::SeqCst),
            })
        }
    }

    const SRC: KernelSource<'static> = KernelSource {
        name: "k.cu",
        code: "extern \"C\" __global__ void k() {}",
        options: &[],
    };

    #[test]
    fn compiles_once_per_device_and_never_shares_modules_across_devices() {
        let cache = KernelCache::with_loader(FakeLoader::default());
        let mut first = Vec::new();
        for ordinal in 0..64 {
            let d = Device::new(Platform::Cuda, ordinal);
            let m = cache.module(d, &SRC).unwrap();
            assert_eq!(m.device, d);
            assert_eq!(m.arch, format!("sm_9{}", ordinal % 2));
            first.push(m);
        }
        for (ordinal, m) in first.iter().enumerate() {
            let d = Device::new(Platform::Cuda, ordinal as u32);
            let again = cache.module(d, &SRC).unwrap();
            assert!(
                Arc::ptr_eq(m, &again),
                "device {ordinal} got another module"
            );
            assert_eq!(
                cache.stats(d),
                KernelCacheStats {
                    compiles: 1,
                    hits: 1,
                    failures: 0
                }
            );
        }
        assert_eq!(cache.loader.builds.load(Ordering::SeqCst), 64);
    }

    #[test]
    fn key_compares_source_options_and_arch_in_full() {
        let cache = KernelCache::with_loader(FakeLoader::default());
        let d = Device::cuda(0);
        let a = cache.module(d, &SRC).unwrap();
        let other_code = KernelSource {
            code: "extern \"C\" __global__ void k2() {}",
            ..SRC
        };
        let b = cache.module(d, &other_code).unwrap();
        let with_opt = KernelSource {
            options: &["-DN=4"],
            ..SRC
        };
        let c = cache.module(d, &with_opt).unwrap();
        let sm90a = KernelSource {
            options: &["--gpu-architecture=sm_90a"],
            ..SRC
        };
        let e = cache.module(d, &sm90a).unwrap();
        let serials: Vec<usize> = [&a, &b, &c, &e].iter().map(|m| m.serial).collect();
        assert_eq!(serials, vec![0, 1, 2, 3]);
        assert_eq!(c.options, vec!["-DN=4".to_string()]);
        assert_eq!(e.arch, "sm_90a");
        assert!(
            e.options.is_empty(),
            "the arch option is carried as the arch"
        );
        assert_eq!(cache.len(d), 4);
        // Same arch spelled as -arch= is the same key.
        let e2 = cache
            .module(
                d,
                &KernelSource {
                    options: &["-arch=sm_90a"],
                    ..SRC
                },
            )
            .unwrap();
        assert!(Arc::ptr_eq(&e, &e2));
    }

    #[test]
    fn sources_sharing_a_bucket_are_told_apart_in_full() {
        // Every key hashes to bucket 0: only the full compare of arch, code
        // and options keeps one source from getting another's module.
        let mut cache = KernelCache::with_loader(FakeLoader::default());
        cache.bucket_mask = 0;
        let d = Device::cuda(0);
        let sources = [
            SRC,
            KernelSource {
                code: "extern \"C\" __global__ void k2() {}",
                ..SRC
            },
            KernelSource {
                options: &["-DN=4"],
                ..SRC
            },
            KernelSource {
                options: &["--gpu-architecture=sm_90a"],
                ..SRC
            },
            KernelSource {
                code: "extern \"C\" __global__ void k2() {}",
                options: &["-DN=4"],
                ..SRC
            },
        ];
        let first: Vec<_> = sources
            .iter()
            .map(|s| cache.module(d, s).unwrap())
            .collect();
        let serials: Vec<usize> = first.iter().map(|m| m.serial).collect();
        assert_eq!(serials, vec![0, 1, 2, 3, 4]);
        for (source, module) in sources.iter().zip(&first) {
            let again = cache.module(d, source).unwrap();
            assert!(Arc::ptr_eq(module, &again), "{source:?}");
            assert_eq!(again.code, source.code);
        }
        assert_eq!(cache.len(d), 5);
        assert_eq!(cache.stats(d).hits, 5);
    }

    #[test]
    fn racing_callers_compile_once() {
        let cache = Arc::new(KernelCache::with_loader(FakeLoader::default()));
        let start = Arc::new(Barrier::new(16));
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let (cache, start) = (cache.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    cache.module(Device::cuda(t % 4), &SRC).unwrap().serial
                })
            })
            .collect();
        let serials: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(cache.loader.builds.load(Ordering::SeqCst), 4);
        for t in 0..16 {
            assert_eq!(serials[t], serials[t % 4]);
        }
    }

    #[test]
    fn failures_carry_the_log_and_are_not_cached() {
        let cache = KernelCache::with_loader(FakeLoader::default());
        let bad = KernelSource {
            name: "bad.cu",
            code: "#error nope",
            options: &[],
        };
        let err = cache.module(Device::cuda(1), &bad).unwrap_err();
        assert_eq!(err.status(), crate::Status::CompileFailed);
        assert!(
            err.to_string()
                .contains("bad.cu(1): error: #error directive"),
            "{err}"
        );
        assert_eq!(cache.len(Device::cuda(1)), 0);
        assert_eq!(cache.stats(Device::cuda(1)).failures, 1);
    }

    #[test]
    fn bad_input_is_refused_before_any_build() {
        let cache = KernelCache::with_loader(FakeLoader::default());
        let nul = KernelSource {
            code: "a\0b",
            ..SRC
        };
        assert_eq!(
            cache.module(Device::cuda(0), &nul).unwrap_err().status(),
            crate::Status::InvalidArgument
        );
        let twice = KernelSource {
            options: &["-arch=sm_90", "--gpu-architecture=sm_80"],
            ..SRC
        };
        assert_eq!(
            cache.module(Device::cuda(0), &twice).unwrap_err().status(),
            crate::Status::InvalidArgument
        );
        assert_eq!(cache.loader.builds.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn clear_drops_one_device_only() {
        let cache = KernelCache::with_loader(FakeLoader::default());
        cache.module(Device::cuda(0), &SRC).unwrap();
        cache.module(Device::cuda(1), &SRC).unwrap();
        cache.clear(Device::cuda(0));
        assert_eq!(cache.len(Device::cuda(0)), 0);
        assert_eq!(cache.len(Device::cuda(1)), 1);
        assert_eq!(cache.module(Device::cuda(0), &SRC).unwrap().serial, 2);
    }
}
