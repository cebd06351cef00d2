//! One call of 10 small kernels on a GPU, side by side in one run: eager
//! launches, graph replay, exec-update (buffers alternate every call) and
//! recapture + instantiate (the cache cleared before every call). Times are
//! CUDA-event medians per call (the start event is recorded before any CPU
//! work of the call) and CPU wall-clock medians, after warm-up.

#[path = "../tests/common/gpu.rs"]
mod gpu;

use std::time::Instant;

use cudarc::driver::CudaStream;
use gpu::{random, Gpu};
use xcall_core::KernelCache;
use xcall_graph::cuda::CudaGraphs;
use xcall_graph::{Buffer, BufferRole, Call, CallKey, Config, GraphCache, Outcome};

const N: u64 = 4096;
const KERNELS: usize = 10;
const WARMUP: usize = 30;
const ITERS: usize = 300;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// (event median us, wall median us) of `ITERS` calls of `f` after warm-up.
fn time(stream: &CudaStream, gpu: &Gpu, mut f: impl FnMut(usize)) -> (f64, f64) {
    for i in 0..WARMUP {
        f(i);
    }
    stream.synchronize().unwrap();
    let (mut events, mut walls) = (Vec::new(), Vec::new());
    for i in 0..ITERS {
        let start = gpu
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        let end = gpu
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        start.record(stream).unwrap();
        let t0 = Instant::now();
        f(i);
        walls.push(t0.elapsed().as_secs_f64() * 1e6);
        end.record(stream).unwrap();
        end.synchronize().unwrap();
        events.push(start.elapsed_ms(&end).unwrap() as f64 * 1e3);
    }
    (median(events), median(walls))
}

fn main() {
    if xcall_core::testing::cuda_devices_or_skip("bench cuda_graph").is_none() {
        return;
    }
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let info = xcall_core::cuda::device_info(gpu.device).unwrap();
    let (x, y) = (
        gpu.upload(&random(N as usize, 1)),
        gpu.upload(&random(N as usize, 2)),
    );
    let ptrs = [gpu.ptr(&x), gpu.ptr(&y)];
    let stream = gpu.stream.clone();
    let key = |p: u64| CallKey {
        device: gpu.device,
        target: 1,
        attributes: 2,
        buffers: vec![Buffer::new(p, N * 4, BufferRole::InOut)],
    };
    let exec = |cache: &GraphCache<CudaGraphs>, p: u64, want: Outcome| {
        let call = Call::new(key(p), Some(gpu.handle()));
        let got = cache
            .execute(&call, |s| gpu.work(s.unwrap().0, p, N, KERNELS))
            .unwrap();
        assert_eq!(got, want);
    };

    let eager = time(&stream, &gpu, |_| {
        gpu.work(stream.cu_stream(), ptrs[0], N, KERNELS).unwrap()
    });
    let cache = GraphCache::new(CudaGraphs, Config::default()).unwrap();
    exec(&cache, ptrs[0], Outcome::Captured);
    let replay = time(&stream, &gpu, |_| exec(&cache, ptrs[0], Outcome::Replayed));
    let update = time(&stream, &gpu, |i| {
        exec(&cache, ptrs[(i + 1) % 2], Outcome::Updated)
    });
    let recapture = time(&stream, &gpu, |_| {
        cache.clear(gpu.device);
        exec(&cache, ptrs[0], Outcome::Captured)
    });

    println!("device: {} ({}), {KERNELS} kernels of {N} floats per call, medians of {ITERS} after {WARMUP} warm-up", info.name, info.arch());
    println!("{:<28} {:>12} {:>12}", "mode", "event us", "wall us");
    for (name, (ev, wall)) in [
        ("eager launches", eager),
        ("graph replay", replay),
        ("exec-update + launch", update),
        ("recapture + instantiate", recapture),
    ] {
        println!("{name:<28} {ev:>12.2} {wall:>12.2}");
    }
    println!("replay / eager (event): {:.3}", replay.0 / eager.0);
    println!(
        "recapture / exec-update (event): {:.2}x",
        recapture.0 / update.0
    );
}
