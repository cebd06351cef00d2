//! One call of 10 small kernels on a GPU, side by side in one run: eager
//! launches, graph replay, exec-update (buffers alternate every call) and
//! recapture + instantiate (the cache cleared before every call); then the
//! same kernels launched through xcall's launcher in a relocatable call,
//! whose new buffers are patched into the cached graph (no capture), next
//! to replay, exec-update and recapture of those kernels. Times are
//! CUDA-event medians per call (the start event is recorded before any CPU
//! work of the call) and CPU wall-clock medians, after warm-up. Both
//! exec-update and recapture run the record function under stream capture,
//! so the driver steps that differ are also timed alone: stream capture,
//! cuGraphExecUpdate and cuGraphInstantiate.

#[path = "../tests/common/gpu.rs"]
mod gpu;

use std::time::Instant;

use cudarc::driver::CudaStream;
use gpu::{random, Gpu};
use xcall_core::cuda::{CaptureMode, Graph, Stream};
use xcall_core::KernelCache;
use xcall_graph::cuda::CudaGraphs;
use xcall_graph::{Buffer, BufferRole, CacheConfig, Call, CallKey, GraphCache, Outcome};

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
        let start = gpu.ctx.new_event(xcall_core::cuda::TIMED_EVENT).unwrap();
        let end = gpu.ctx.new_event(xcall_core::cuda::TIMED_EVENT).unwrap();
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

/// Wall-clock median (us) of `f` over `ITERS` runs after warm-up.
fn wall(mut f: impl FnMut(usize)) -> f64 {
    for i in 0..WARMUP {
        f(i);
    }
    median(
        (0..ITERS)
            .map(|i| {
                let t0 = Instant::now();
                f(i);
                t0.elapsed().as_secs_f64() * 1e6
            })
            .collect(),
    )
}

/// Captures the call's kernels on `gpu`'s stream into a new graph.
fn capture(gpu: &Gpu, ptr: u64) -> Graph {
    // SAFETY: the bench's own live stream.
    let s = unsafe { Stream::from_raw(gpu.device, gpu.stream.cu_stream()) };
    // A capture of the bench's own stream, ended below.
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    gpu.work(s.raw(), ptr, N, KERNELS).unwrap();
    s.end_capture().unwrap()
}

/// Driver steps alone: (capture, exec-update, instantiate) wall medians in us.
fn driver_steps(gpu: &Gpu, ptrs: [u64; 2]) -> (f64, f64, f64) {
    gpu.ctx.bind_to_thread().unwrap();
    let graphs = [capture(gpu, ptrs[0]), capture(gpu, ptrs[1])];
    // Instantiates a captured graph; destroyed at the end.
    let mut exec = graphs[0].instantiate(gpu.device).unwrap();
    // The graph returned by capture is destroyed right away.
    let capture_us = wall(|i| drop(capture(gpu, ptrs[i % 2])));
    let update_us = wall(|i| {
        // Both graphs have the same topology as the executable.
        assert!(exec.update(gpu.device, &graphs[i % 2]).unwrap());
    });
    let instantiate_us = wall(|i| {
        // Instantiates and destroys a fresh executable.
        drop(graphs[i % 2].instantiate(gpu.device).unwrap());
    });
    // Destroys the objects created above.
    drop(exec);
    drop(graphs);
    (capture_us, update_us, instantiate_us)
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
        attributes: 2.into(),
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
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
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
    // The same kernels through xcall's launcher.
    let exec_p = |cache: &GraphCache<CudaGraphs>, p: u64, relocatable: bool, want: Outcome| {
        let call = Call::new(key(p), Some(gpu.handle()));
        let call = if relocatable {
            call.relocatable()
        } else {
            call
        };
        let got = cache
            .execute(&call, |s| gpu.work_p(s.unwrap().0, p, N, KERNELS))
            .unwrap();
        assert_eq!(got, want);
    };
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    exec_p(&cache, ptrs[0], true, Outcome::Captured);
    let replay_p = time(&stream, &gpu, |_| {
        exec_p(&cache, ptrs[0], true, Outcome::Replayed)
    });
    let patch_p = time(&stream, &gpu, |i| {
        exec_p(&cache, ptrs[(i + 1) % 2], true, Outcome::Patched)
    });
    let update_p = time(&stream, &gpu, |i| {
        exec_p(&cache, ptrs[(i + 1) % 2], false, Outcome::Updated)
    });
    let recapture_p = time(&stream, &gpu, |_| {
        cache.clear(gpu.device);
        exec_p(&cache, ptrs[0], true, Outcome::Captured)
    });
    println!("\nthe same kernels launched through xcall's launcher, in a relocatable call:");
    println!("{:<28} {:>12} {:>12}", "mode", "event us", "wall us");
    for (name, (ev, wall)) in [
        ("graph replay", replay_p),
        ("patch + launch", patch_p),
        ("exec-update + launch", update_p),
        ("recapture + instantiate", recapture_p),
    ] {
        println!("{name:<28} {ev:>12.2} {wall:>12.2}");
    }
    println!(
        "recapture / patch (event): {:.2}x; exec-update / patch (event): {:.2}x; patch / replay (event): {:.2}x",
        recapture_p.0 / patch_p.0,
        update_p.0 / patch_p.0,
        patch_p.0 / replay_p.0
    );
    let (capture_us, update_us, instantiate_us) = driver_steps(&gpu, ptrs);
    println!(
        "driver steps alone (wall us): stream capture {capture_us:.2}, cuGraphExecUpdate {update_us:.2}, cuGraphInstantiate+destroy {instantiate_us:.2}"
    );
    println!(
        "instantiate / exec-update (driver steps alone): {:.1}x",
        instantiate_us / update_us
    );
}
