//! What xcall-core logs, captured per thread. Its own test binary: no
//! other test reaches these event sites while a capture is set up (see
//! `xcall_core::log::capture`).

use xcall_core::kernel_cache::{CompileRequest, KernelCache, ModuleLoader};
use xcall_core::log::capture;
use xcall_core::{Device, KernelSource, LogLevel, Result};

/// Compiles nothing: device `d` has arch `sm_9{d % 2}`.
struct Loader;

impl ModuleLoader for Loader {
    type Module = String;
    fn architecture(&self, device: Device) -> Result<String> {
        Ok(format!("sm_9{}", device.ordinal % 2))
    }
    fn compile_and_load(&self, device: Device, r: &CompileRequest<'_>) -> Result<String> {
        Ok(format!("{}@{device}", r.name))
    }
}

#[test]
fn a_compile_is_logged_once_with_its_time_and_a_hit_is_not() {
    let cache = KernelCache::with_loader(Loader);
    let source = KernelSource {
        name: "k.cu",
        code: "extern \"C\" __global__ void k() {}",
        options: &[],
    };
    let d = Device::cuda(3);
    let ((), lines) = capture("xcall_core=debug", || {
        cache.module(d, &source).unwrap();
        cache.module(d, &source).unwrap();
    });
    let texts: Vec<&str> = lines.iter().map(|l| l.text.as_str()).collect();
    assert_eq!(texts.len(), 1, "{texts:?}");
    let prefix = "kernel module compiled and loaded device=cuda:3 name=k.cu arch=sm_91 ms=";
    assert!(texts[0].starts_with(prefix), "{}", texts[0]);
    let ms: f64 = texts[0][prefix.len()..].parse().unwrap();
    assert!(ms >= 0.0);
    assert_eq!(lines[0].level, LogLevel::Debug);
    assert_eq!(lines[0].target, "xcall_core::kernel_cache");
}
