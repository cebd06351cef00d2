//! The graph cache's hit path on the Host (simulated backend, so only the
//! cache's own work is timed: key build + lookup + an empty launch), and
//! its throughput with 1/2/4/8 threads on distinct devices, next to a
//! reference workload of the same shape that shares nothing (the machine's
//! own scaling, measured in the same run).

mod common;

use std::hint::black_box;
use std::sync::{Arc, Mutex};

use common::parallel;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use xcall_graph::sim::{SimBackend, SimStream};
use xcall_graph::{Buffer, BufferRole, CacheConfig, Call, CallKey, Device, GraphCache, Outcome};

fn key(ordinal: u32, buffers: usize) -> CallKey {
    CallKey {
        device: Device::cuda(ordinal),
        target: 0xfeed,
        attributes: 0xbeef.into(),
        buffers: (0..buffers as u64)
            .map(|i| Buffer::new(0x7f00_0000_0000 + i * 4096, 4096, BufferRole::InOut))
            .collect(),
    }
}

fn stream(ordinal: u32) -> SimStream {
    SimStream {
        device: Device::cuda(ordinal),
        context: 1,
        id: ordinal as u64,
    }
}

/// One hit, including building the key from the call's buffers.
fn hit(cache: &GraphCache<SimBackend>, ordinal: u32, buffers: usize) -> Outcome {
    let call = Call::new(key(ordinal, buffers), Some(stream(ordinal)));
    cache
        .execute(&call, |_| Ok::<(), std::io::Error>(()))
        .unwrap()
}

fn hit_path(c: &mut Criterion) {
    let cache = GraphCache::new(SimBackend::new(), CacheConfig::default()).unwrap();
    let mut g = c.benchmark_group("graph_cache_hit");
    for buffers in [1, 8, 64] {
        assert_eq!(hit(&cache, 0, buffers), Outcome::Captured);
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{buffers}_buffers")),
            &buffers,
            |b, &n| b.iter(|| black_box(hit(&cache, 0, n))),
        );
    }
    g.finish();
}

/// Hits per thread with `threads` threads, each on its own device.
fn scaling(c: &mut Criterion) {
    let cache = Arc::new(GraphCache::new(SimBackend::new(), CacheConfig::default()).unwrap());
    for d in 0..8 {
        assert_eq!(hit(&cache, d, 8), Outcome::Captured);
    }
    let mut g = c.benchmark_group("graph_cache_hit_8_buffers_threads_on_distinct_devices");
    for threads in [1u32, 2, 4, 8] {
        g.bench_with_input(
            BenchmarkId::from_parameter(threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| {
                    let cache = cache.clone();
                    parallel(threads, iters, move |d, iters| {
                        for _ in 0..iters {
                            black_box(hit(&cache, d, 8));
                        }
                    })
                })
            },
        );
    }
    g.finish();
}

/// The reference: per-thread work of the same shape as a hit (build an
/// 8-buffer key, hash it, look it up, lock and unlock a mutex) with nothing
/// shared between threads.
fn reference(c: &mut Criterion) {
    let mut g = c.benchmark_group("reference_private_work_threads");
    for threads in [1u32, 2, 4, 8] {
        g.bench_with_input(
            BenchmarkId::from_parameter(threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| {
                    parallel(threads, iters, |t, iters| {
                        let map: std::collections::HashMap<CallKey, u64> =
                            [(key(t, 8), 1)].into_iter().collect();
                        let lock = Mutex::new(0u64);
                        for _ in 0..iters {
                            let probe = key(black_box(t), 8);
                            *lock.lock().unwrap() += map[&probe];
                        }
                        black_box(lock.into_inner().unwrap());
                    })
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, hit_path, scaling, reference);
criterion_main!(benches);
