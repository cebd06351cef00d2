//! Host-only work never loads the CUDA driver (a Host-only
//! program must run on machines without a GPU and never pay for, or fail
//! in, the driver). This file is its own test process, so nothing else
//! can have loaded the driver first.

use xcall_core::{cuda, DType, Device, DeviceMap, KernelCache, Platform};

fn libcuda_mapped() -> bool {
    std::fs::read_to_string("/proc/self/maps").is_ok_and(|maps| maps.contains("libcuda.so"))
}

#[test]
fn host_calls_do_not_load_the_cuda_driver() {
    // Everything a Host user of the core touches.
    assert_eq!(Platform::Host.device_count().unwrap(), 1);
    Device::HOST.validate().unwrap();
    let map: DeviceMap<u32> = DeviceMap::new();
    for ordinal in 0..64 {
        map.get_or_init(Device::new(Platform::Host, ordinal), || ordinal);
    }
    assert_eq!(map.len(), 64);
    let _cache = KernelCache::new(); // constructing it loads nothing
    assert_eq!("bf16".parse::<DType>().unwrap().size_bytes(), 2);

    assert!(
        !cuda::driver_load_attempted(),
        "Host work tried to load the CUDA driver"
    );
    assert!(!libcuda_mapped(), "libcuda is mapped after Host-only work");

    // The flag is live: the first CUDA question does attempt the load
    // (unless CUDA is disabled, which short-circuits before loading).
    let _ = cuda::available();
    // Unset or false: loads; true or malformed: refused before loading.
    let loads = matches!(
        xcall_core::env::flag(cuda::DISABLE_ENV),
        Ok(None | Some(false))
    );
    assert_eq!(cuda::driver_load_attempted(), loads);
}
