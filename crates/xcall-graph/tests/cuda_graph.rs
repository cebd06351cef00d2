//! The graph cache on real GPUs. Skips without a GPU unless
//! XCALL_REQUIRE_CUDA=1; the two-GPU tests skip on one GPU.

mod common;

use common::gpu::{assert_close, random, reference, Gpu};
use xcall_core::cuda::{CaptureMode, RawStream, Stream};
use xcall_core::testing::{cuda_devices_or_skip, skip};
use xcall_core::{KernelCache, Status};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{
    Buffer, BufferRole, CacheConfig, Call, CallKey, Device, GraphCache, GraphError, Outcome,
};

const N: usize = 1 << 16;
const KERNELS: usize = 10;

fn key(device: Device, address: u64) -> CallKey {
    CallKey {
        device,
        target: 0x5ca1e,
        attributes: (KERNELS as u64).into(),
        buffers: vec![Buffer::new(address, (N * 4) as u64, BufferRole::InOut)],
    }
}

/// Runs the scale-add call on `ptr` through the cache (declaring `declared`
/// as the buffer address in the key).
fn run(
    cache: &GraphCache<CudaGraphs>,
    gpu: &Gpu,
    declared: u64,
    ptr: u64,
) -> Result<Outcome, GraphError> {
    let call = Call::new(key(gpu.device, declared), Some(gpu.handle()));
    cache.execute(&call, |s| gpu.work(s.unwrap().0, ptr, N as u64, KERNELS))
}

fn capturing(device: Device, stream: RawStream) -> bool {
    // SAFETY: a live stream of the test's device, only queried.
    unsafe { Stream::from_raw(device, stream) }
        .is_capturing()
        .unwrap()
}

#[test]
fn capture_and_replay_compute_what_eager_launches_compute() {
    if cuda_devices_or_skip("capture_and_replay_compute_what_eager_launches_compute").is_none() {
        return;
    }
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let data = random(N, 1);
    let (x, y) = (gpu.upload(&data), gpu.upload(&data));
    let (px, py) = (gpu.ptr(&x), gpu.ptr(&y));
    let outcomes: Vec<Outcome> = (0..3).map(|_| run(&cache, &gpu, px, px).unwrap()).collect();
    assert_eq!(
        outcomes,
        vec![Outcome::Captured, Outcome::Replayed, Outcome::Replayed]
    );
    for _ in 0..3 {
        gpu.work(gpu.stream.cu_stream(), py, N as u64, KERNELS)
            .unwrap();
    }
    let (gx, gy) = (gpu.download(&x), gpu.download(&y));
    assert_eq!(gx, gy, "graph and eager launches differ");
    assert_close(
        &gx,
        &reference(&data, KERNELS, 3),
        "graph vs Host reference",
    );
    let s = cache.stats(gpu.device);
    assert_eq!(
        (s.captures, s.hits, s.entries, s.nodes),
        (1, 2, 1, KERNELS as u64)
    );
}

#[test]
fn exec_update_writes_the_new_buffers_and_not_the_old_ones() {
    if cuda_devices_or_skip("exec_update_writes_the_new_buffers_and_not_the_old_ones").is_none() {
        return;
    }
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let (dx, dy) = (random(N, 2), random(N, 3));
    let (x, y) = (gpu.upload(&dx), gpu.upload(&dy));
    let (px, py) = (gpu.ptr(&x), gpu.ptr(&y));
    assert_eq!(run(&cache, &gpu, px, px).unwrap(), Outcome::Captured);
    let x_after_one = gpu.download(&x);
    assert_eq!(run(&cache, &gpu, py, py).unwrap(), Outcome::Updated);
    assert_eq!(
        gpu.download(&x),
        x_after_one,
        "the updated graph still wrote the old buffer"
    );
    assert_close(
        &gpu.download(&y),
        &reference(&dy, KERNELS, 1),
        "updated graph on the new buffer",
    );
    assert_eq!(run(&cache, &gpu, px, px).unwrap(), Outcome::Updated);
    assert_close(
        &gpu.download(&x),
        &reference(&dx, KERNELS, 2),
        "updated back",
    );
    assert_close(&gpu.download(&y), &reference(&dy, KERNELS, 1), "untouched");
    let s = cache.stats(gpu.device);
    assert_eq!((s.instantiations, s.updates, s.entries), (1, 2, 1));
}

/// Runs the call on `ptr` through the cache as a relocatable call of
/// kernels launched through xcall's launcher (`with_raw`: plus one foreign
/// kernel launched raw at the end), counting record-function runs.
fn run_p(
    cache: &GraphCache<CudaGraphs>,
    gpu: &Gpu,
    ptr: u64,
    with_raw: bool,
    records: &mut u32,
) -> Outcome {
    let call = Call::new(key(gpu.device, ptr), Some(gpu.handle())).relocatable();
    cache
        .execute(&call, |s| {
            *records += 1;
            let s = s.unwrap().0;
            gpu.work_p(s, ptr, N as u64, KERNELS)?;
            if with_raw {
                gpu.work(s, ptr, N as u64, 1)?;
            }
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        })
        .unwrap()
}

#[test]
fn patched_graphs_write_the_new_buffers_and_not_the_old_ones() {
    if cuda_devices_or_skip("patched_graphs_write_the_new_buffers_and_not_the_old_ones").is_none() {
        return;
    }
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let (dx, dy) = (random(N, 12), random(N, 13));
    let (x, y) = (gpu.upload(&dx), gpu.upload(&dy));
    let (px, py) = (gpu.ptr(&x), gpu.ptr(&y));
    let mut records = 0;
    assert_eq!(
        run_p(&cache, &gpu, px, false, &mut records),
        Outcome::Captured
    );
    assert_close(&gpu.download(&x), &reference(&dx, KERNELS, 1), "captured");
    // Poison the old buffer: a patched graph that still touched it would
    // change the NaN bits.
    let poison = vec![f32::from_bits(0x7fc0_dead); N];
    let mut x = x;
    gpu.ctx.bind_to_thread().unwrap();
    gpu.stream.memcpy_htod(&poison, &mut x).unwrap();
    assert_eq!(
        run_p(&cache, &gpu, py, false, &mut records),
        Outcome::Patched
    );
    assert_eq!(records, 1, "a patch runs no record function and no capture");
    assert_close(
        &gpu.download(&y),
        &reference(&dy, KERNELS, 1),
        "patched graph on the new buffer",
    );
    let untouched: Vec<u32> = gpu.download(&x).iter().map(|v| v.to_bits()).collect();
    assert!(
        untouched.iter().all(|&b| b == 0x7fc0_dead),
        "the patched graph wrote the old buffer"
    );
    assert_eq!(
        run_p(&cache, &gpu, py, false, &mut records),
        Outcome::Replayed
    );
    assert_close(&gpu.download(&y), &reference(&dy, KERNELS, 2), "replayed");
    let s = cache.stats(gpu.device);
    assert_eq!(
        (
            s.captures,
            s.instantiations,
            s.patches,
            s.updates,
            s.entries
        ),
        (1, 1, 1, 0, 1)
    );
    // One foreign kernel in the graph: the cache captures again and updates.
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let (dz, dw) = (random(N, 14), random(N, 15));
    let (z, w) = (gpu.upload(&dz), gpu.upload(&dw));
    assert_eq!(
        run_p(&cache, &gpu, gpu.ptr(&z), true, &mut records),
        Outcome::Captured
    );
    assert_eq!(
        run_p(&cache, &gpu, gpu.ptr(&w), true, &mut records),
        Outcome::Updated
    );
    assert_close(
        &gpu.download(&w),
        &reference(&dw, KERNELS, 1)
            .iter()
            .map(|v| {
                let (a, b) = common::gpu::coefficients(0);
                v * a + b
            })
            .collect::<Vec<f32>>(),
        "updated graph with a foreign kernel",
    );
    assert_eq!(cache.stats(gpu.device).patches, 0);
}

#[test]
fn a_failing_record_function_leaves_the_stream_usable() {
    if cuda_devices_or_skip("a_failing_record_function_leaves_the_stream_usable").is_none() {
        return;
    }
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let data = random(N, 4);
    let x = gpu.upload(&data);
    let px = gpu.ptr(&x);
    let call = Call::new(key(gpu.device, px), Some(gpu.handle()));
    let err = cache
        .execute(&call, |s| {
            gpu.work(s.unwrap().0, px, N as u64, 1).unwrap();
            Err(std::io::Error::other("framework refused the call"))
        })
        .unwrap_err();
    assert_eq!(err.status(), Status::CallbackFailed);
    assert!(!capturing(gpu.device, gpu.stream.cu_stream()));
    // The captured attempt was discarded; the eager run's kernel ran once.
    assert_close(
        &gpu.download(&x),
        &reference(&data, 1, 1),
        "one eager kernel",
    );
    let y = gpu.upload(&data);
    let py = gpu.ptr(&y);
    assert_eq!(run(&cache, &gpu, py, py).unwrap(), Outcome::Captured);
    assert_close(
        &gpu.download(&y),
        &reference(&data, KERNELS, 1),
        "after the failure",
    );
}

#[test]
fn work_that_cannot_be_captured_runs_eagerly_once() {
    if cuda_devices_or_skip("work_that_cannot_be_captured_runs_eagerly_once").is_none() {
        return;
    }
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let cache = GraphCache::new(
        CudaGraphs,
        CacheConfig {
            retry_after: 1,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let data = random(N, 5);
    let x = gpu.upload(&data);
    let px = gpu.ptr(&x);
    let call = Call::new(key(gpu.device, px), Some(gpu.handle()));
    let record = |s: Option<CudaStreamHandle>| {
        let s = s.unwrap().0;
        gpu.work(s, px, N as u64, KERNELS)?;
        // A synchronisation is illegal under capture: it invalidates it (a
        // library that ignores the error, as many do).
        // SAFETY: a live stream of the test's device.
        let _ = unsafe { Stream::from_raw(gpu.device, s) }.sync();
        Ok::<(), cudarc::driver::DriverError>(())
    };
    assert_eq!(
        cache.execute(&call, record).unwrap(),
        Outcome::EagerFallback
    );
    assert_eq!(
        cache.execute(&call, record).unwrap(),
        Outcome::EagerFallback
    );
    assert!(!capturing(gpu.device, gpu.stream.cu_stream()));
    assert_close(
        &gpu.download(&x),
        &reference(&data, KERNELS, 2),
        "each call's work ran exactly once",
    );
    let s = cache.stats(gpu.device);
    assert_eq!(
        (s.eager_capture_failed, s.eager_not_capturable, s.entries),
        (1, 1, 0)
    );
}

#[test]
fn a_stream_the_caller_captures_gets_the_work_recorded() {
    if cuda_devices_or_skip("a_stream_the_caller_captures_gets_the_work_recorded").is_none() {
        return;
    }
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let data = random(N, 6);
    let x = gpu.upload(&data);
    let px = gpu.ptr(&x);
    gpu.stream.synchronize().unwrap();
    // SAFETY: the test's live stream.
    let s = unsafe { Stream::from_raw(gpu.device, gpu.stream.cu_stream()) };
    // The runtime's own capture of a live stream.
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let outcome = run(&cache, &gpu, px, px);
    // Ends the capture begun above and inspects the graph.
    let graph = s.end_capture().unwrap();
    let nodes = graph.node_count(gpu.device).unwrap();
    assert_eq!(outcome.unwrap(), Outcome::EagerFallback);
    assert_eq!(nodes, KERNELS, "the work went into the caller's graph");
    assert_eq!(gpu.download(&x), data, "recorded, not run");
    // Instantiates and launches the caller's graph.
    let exec = graph.instantiate(gpu.device).unwrap();
    s.launch_graph(&exec).unwrap();
    assert_close(
        &gpu.download(&x),
        &reference(&data, KERNELS, 1),
        "the caller's graph ran the work",
    );
    // Destroys the objects created above.
    drop(exec);
    drop(graph);
    assert_eq!(cache.stats(gpu.device).eager_caller_capturing, 1);
}

#[test]
fn bad_streams_are_refused_and_the_callers_context_is_restored() {
    let Some(count) =
        cuda_devices_or_skip("bad_streams_are_refused_and_the_callers_context_is_restored")
    else {
        return;
    };
    let kernels = KernelCache::new();
    let gpu = Gpu::new(&kernels, 0);
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let x = gpu.upload(&random(N, 7));
    let px = gpu.ptr(&x);
    let null = Call::new(
        key(gpu.device, px),
        Some(CudaStreamHandle(std::ptr::null_mut())),
    );
    let err = cache
        .execute(&null, |_| Ok::<(), std::io::Error>(()))
        .unwrap_err();
    assert!(err.to_string().contains("legacy default stream"), "{err}");
    // Clear the current context: the cache must leave it cleared.
    xcall_core::cuda::clear_current_context(gpu.device).unwrap();
    run(&cache, &gpu, px, px).unwrap();
    let current = xcall_core::cuda::current_context(gpu.device).unwrap();
    assert!(current.is_null(), "the cache left its context current");
    if count < 2 {
        skip("stream_of_another_device_is_refused", "needs 2 GPUs");
        return;
    }
    let other = Gpu::new(&kernels, 1);
    let wrong = Call::new(key(Device::cuda(0), px), Some(other.handle()));
    let err = cache
        .execute(&wrong, |_| Ok::<(), std::io::Error>(()))
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArgument, "{err}");
}

#[test]
fn two_gpus_with_identical_keys_each_replay_their_own_graph() {
    let Some(count) =
        cuda_devices_or_skip("two_gpus_with_identical_keys_each_replay_their_own_graph")
    else {
        return;
    };
    if count < 2 {
        skip(
            "two_gpus_with_identical_keys_each_replay_their_own_graph",
            "needs 2 GPUs",
        );
        return;
    }
    let kernels = KernelCache::new();
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let gpus = [Gpu::new(&kernels, 0), Gpu::new(&kernels, 1)];
    let data = [random(N, 8), random(N, 9)];
    let bufs = [gpus[0].upload(&data[0]), gpus[1].upload(&data[1])];
    // Both devices' calls declare the same buffer address: the key's device
    // must keep their graphs apart.
    const SAME: u64 = 0x7f00_0000_0000;
    for round in 0..3 {
        for d in 0..2 {
            let outcome = run(&cache, &gpus[d], SAME, gpus[d].ptr(&bufs[d])).unwrap();
            let want = if round == 0 {
                Outcome::Captured
            } else {
                Outcome::Replayed
            };
            assert_eq!(outcome, want, "cuda:{d} round {round}");
        }
    }
    for d in 0..2 {
        assert_close(
            &gpus[d].download(&bufs[d]),
            &reference(&data[d], KERNELS, 3),
            &format!("cuda:{d}"),
        );
        let s = cache.stats(Device::cuda(d as u32));
        assert_eq!((s.captures, s.hits, s.entries), (1, 2, 1), "cuda:{d}");
    }
}
