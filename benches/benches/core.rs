//! Per-device lookup cost: `DeviceMap` against a mutex-guarded `HashMap`
//! (the shape of a global registry), measured in the same run; and, on a
//! GPU machine, the kernel cache's hit path.

mod common;

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::{Arc, Mutex};

use common::parallel;

use criterion::{criterion_group, criterion_main, Criterion};
use xcall_core::{Device, DeviceMap, KernelCache, KernelSource, Platform};

const DEVICES: u32 = 64;

fn device(o: u32) -> Device {
    Device::new(Platform::Host, o)
}

fn single_thread(c: &mut Criterion) {
    let map: DeviceMap<u64> = DeviceMap::with_capacity(8);
    let reference: Mutex<HashMap<Device, u64>> = Mutex::new(HashMap::new());
    for o in 0..DEVICES {
        map.get_or_init(device(o), || o as u64);
        reference.lock().unwrap().insert(device(o), o as u64);
    }
    let mut g = c.benchmark_group("lookup_1_thread_64_devices");
    g.bench_function("device_map", |b| {
        let mut o = 0;
        b.iter(|| {
            o = (o + 1) % DEVICES;
            *map.get(black_box(device(o))).unwrap()
        })
    });
    g.bench_function("mutex_hashmap_reference", |b| {
        let mut o = 0;
        b.iter(|| {
            o = (o + 1) % DEVICES;
            *reference
                .lock()
                .unwrap()
                .get(&black_box(device(o)))
                .unwrap()
        })
    });
    g.finish();
}

/// One thread per device, each looking up its own slot: the SPMT pattern.
fn contended(c: &mut Criterion) {
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 16) as u32;
    let map: Arc<DeviceMap<u64>> = Arc::new(DeviceMap::with_capacity(threads as usize));
    let reference: Arc<Mutex<HashMap<Device, u64>>> = Arc::new(Mutex::new(HashMap::new()));
    for o in 0..threads {
        map.get_or_init(device(o), || o as u64);
        reference.lock().unwrap().insert(device(o), o as u64);
    }
    let run = |lookup: Arc<dyn Fn(Device) -> u64 + Send + Sync>, iters: u64| {
        parallel(threads, iters, move |o, iters| {
            let mut sum = 0;
            for _ in 0..iters {
                sum += lookup(black_box(device(o)));
            }
            black_box(sum);
        })
    };
    let mut g = c.benchmark_group(format!("lookup_{threads}_threads_own_device"));
    let by_map: Arc<dyn Fn(Device) -> u64 + Send + Sync> = Arc::new(move |d| *map.get(d).unwrap());
    let by_reference: Arc<dyn Fn(Device) -> u64 + Send + Sync> =
        Arc::new(move |d| *reference.lock().unwrap().get(&d).unwrap());
    g.bench_function("device_map", |b| {
        b.iter_custom(|iters| run(by_map.clone(), iters))
    });
    g.bench_function("mutex_hashmap_reference", |b| {
        b.iter_custom(|iters| run(by_reference.clone(), iters))
    });
    g.finish();
}

fn kernel_cache_hit(c: &mut Criterion) {
    if xcall_core::testing::cuda_devices_or_skip("bench kernel_cache_hit").is_none() {
        return;
    }
    let cache = KernelCache::new();
    let src = KernelSource {
        name: "bench.cu",
        code: "extern \"C\" __global__ void noop(int *p) { if (p) *p = 1; }",
        options: &[],
    };
    let dev = Device::cuda(0);
    cache.module(dev, &src).expect("compile bench kernel");
    c.bench_function("kernel_cache_hit_cuda0", |b| {
        b.iter(|| cache.module(black_box(dev), &src).unwrap())
    });
}

criterion_group!(benches, single_thread, contended, kernel_cache_hit);
criterion_main!(benches);
