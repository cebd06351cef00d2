//! The NVRTC kernel cache on real GPUs: compile once per device, modules
//! bound to their device, results equal to a Host reference on random data,
//! compile errors carrying NVRTC's log. Skips without a GPU unless
//! XCALL_REQUIRE_CUDA=1.

use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use xcall_core::testing::{cuda_devices_or_skip, random_f32 as random};
use xcall_core::{cuda, Device, Error, KernelCache, KernelSource, Status};

const SAXPY: KernelSource<'static> = KernelSource {
    name: "saxpy.cu",
    code: r#"
extern "C" __global__ void saxpy(float *out, const float *x, const float *y, float a, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + y[i];
}
"#,
    options: &[],
};

fn run_saxpy(cache: &KernelCache, device: Device, seed: u64) -> Result<(), Error> {
    let n = 1 << 20;
    let (x, y, a) = (random(n, seed), random(n, seed + 1), 1.5f32);
    let module = cache.module(device, &SAXPY)?;
    assert_eq!(module.device(), device);
    let f = module.function("saxpy")?;
    let got = cuda::with_context(device, |ctx| {
        let fail = |e| cuda::driver_error("saxpy test", device, e);
        let stream = ctx.default_stream();
        let dx = stream.clone_htod(&x).map_err(fail)?;
        let dy = stream.clone_htod(&y).map_err(fail)?;
        // Poison the output so an unwritten element cannot pass.
        let mut out = stream.clone_htod(&vec![f32::NAN; n]).map_err(fail)?;
        let n64 = n as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut out).arg(&dx).arg(&dy).arg(&a).arg(&n64);
        // SAFETY: the argument list matches saxpy's signature and every
        // buffer holds n elements.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.map_err(fail)?;
        stream.clone_dtoh(&out).map_err(fail)
    })?;
    for i in 0..n {
        let want = (a as f64 * x[i] as f64 + y[i] as f64) as f32;
        assert!(
            (got[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "{device} element {i}: {} vs {want}",
            got[i]
        );
    }
    Ok(())
}

#[test]
fn compiles_once_per_device_and_matches_the_host() {
    let Some(count) = cuda_devices_or_skip("compiles_once_per_device_and_matches_the_host") else {
        return;
    };
    let cache = KernelCache::new();
    let mut modules = Vec::new();
    for ordinal in 0..count as u32 {
        let device = Device::cuda(ordinal);
        run_saxpy(&cache, device, 10 + ordinal as u64).unwrap();
        run_saxpy(&cache, device, 20 + ordinal as u64).unwrap();
        let stats = cache.stats(device);
        assert_eq!((stats.compiles, stats.hits), (1, 1), "{device}: {stats:?}");
        modules.push(cache.module(device, &SAXPY).unwrap());
    }
    for (i, a) in modules.iter().enumerate() {
        for b in &modules[i + 1..] {
            assert!(!Arc::ptr_eq(a, b), "two devices share a module");
            assert_ne!(a.device(), b.device());
        }
    }
}

#[test]
fn compile_errors_carry_the_nvrtc_log() {
    if cuda_devices_or_skip("compile_errors_carry_the_nvrtc_log").is_none() {
        return;
    }
    let cache = KernelCache::new();
    let bad = KernelSource {
        name: "broken.cu",
        code: "extern \"C\" __global__ void k(float *p) { p[0] = undeclared_name; }",
        options: &[],
    };
    let err = cache.module(Device::cuda(0), &bad).unwrap_err();
    assert_eq!(err.status(), Status::CompileFailed);
    let text = err.to_string();
    // NVRTC's own log names the program by the source's name.
    assert!(
        text.contains("broken.cu(1)") && text.contains("undeclared_name"),
        "{text}"
    );
    assert_eq!(cache.len(Device::cuda(0)), 0);
    // The caller's options reach NVRTC: the macro is defined only by them.
    let with_define = KernelSource {
        name: "define.cu",
        code: "extern \"C\" __global__ void k(float *p) { p[0] = XCALL_TEST_VALUE; }",
        options: &["-DXCALL_TEST_VALUE=7.0f"],
    };
    cache.module(Device::cuda(0), &with_define).unwrap();
    let without = KernelSource {
        options: &[],
        ..with_define
    };
    assert!(cache.module(Device::cuda(0), &without).is_err());
}

#[test]
fn hopper_arch_specific_target_compiles() {
    let Some(_) = cuda_devices_or_skip("hopper_arch_specific_target_compiles") else {
        return;
    };
    let info = cuda::device_info(Device::cuda(0)).unwrap();
    if info.compute_capability != (9, 0) {
        let reason = format!("{} is {}, not sm_90", info.name, info.arch());
        xcall_core::testing::skip("hopper_arch_specific_target_compiles", &reason);
        return;
    }
    let cache = KernelCache::new();
    let src = KernelSource {
        options: &["--gpu-architecture=sm_90a"],
        ..SAXPY
    };
    let module = cache.module(Device::cuda(0), &src).unwrap();
    assert_eq!(module.arch(), "sm_90a");
    module.function("saxpy").unwrap();
}

#[test]
fn unknown_device_and_missing_kernel_are_clear_errors() {
    let Some(count) = cuda_devices_or_skip("unknown_device_and_missing_kernel_are_clear_errors")
    else {
        return;
    };
    let cache = KernelCache::new();
    let err = cache
        .module(Device::cuda(count as u32), &SAXPY)
        .unwrap_err();
    assert_eq!(err.status(), Status::NoSuchDevice, "{err}");
    let module = cache.module(Device::cuda(0), &SAXPY).unwrap();
    let err = module.function("no_such_kernel").unwrap_err();
    assert_eq!(err.status(), Status::CudaDriver);
    assert!(err.to_string().contains("CUDA_ERROR_NOT_FOUND"), "{err}");
}

#[test]
fn the_callers_current_context_is_restored() {
    if cuda_devices_or_skip("the_callers_current_context_is_restored").is_none() {
        return;
    }
    use cudarc::driver::sys;
    let current = || {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid pointer.
        unsafe { sys::cuCtxGetCurrent(&mut c) }.result().unwrap();
        c
    };
    // SAFETY: clearing the current context is always valid.
    unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) }
        .result()
        .unwrap();
    let cache = KernelCache::new();
    cache.module(Device::cuda(0), &SAXPY).unwrap();
    assert!(
        current().is_null(),
        "the kernel cache left a context current"
    );
}
