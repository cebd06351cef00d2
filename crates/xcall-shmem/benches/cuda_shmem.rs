//! One GPU: the cost of a wait on the stream (`wait_until_on_stream`, a
//! kernel that can time out) on a word that already holds, eager and
//! replayed from a graph, beside a driver stream wait
//! (`cuStreamWaitValue64`, which cannot) in the same run.
//!
//! Two GPUs, one process (SPMT): put bandwidth from GPU 0's heap into GPU
//! 1's heap for 4 KiB .. 1 GiB, side by side in one run with
//! cuMemcpyPeerAsync of the same bytes between the same addresses; and
//! barrier_on_stream latency for 2 PEs. Then `World::exchange_on_stream`
//! of the same sizes from GPU 0 to GPU 1, through a world of direct pairs
//! (a peer copy and a signal; GPU 1 waits for it) and through a world whose
//! pairs all take NCCL (a grouped send and receive), each beside
//! cuMemcpyPeerAsync of the same bytes between the same GPUs in the same
//! rounds (GPU 0's stream is timed); where the loaded NCCL runs one-sided
//! puts (2.29 and newer), also `World::put_nbi` through them beside the
//! same reference. `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` in the
//! environment puts NCCL on its network path.
//! CUDA-event medians of interleaved rounds after warm-up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use xcall_core::cuda::Stream;
use xcall_core::testing::{capture_graph, cuda_devices_or_skip, interleaved_medians, skip};
use xcall_core::{cuda, Device};
use xcall_shmem::{Cmp, Incoming, Outgoing, Pairs, Transport, World, WorldConfig};

const MAX: usize = 1 << 30;
const BARRIERS: usize = 100;
const BARRIER_ROUNDS: usize = 30;
const WAITS: usize = 100;

fn main() {
    let Some(n) = cuda_devices_or_skip("bench cuda_shmem") else {
        return;
    };
    waits();
    if n < 2 {
        return skip("bench cuda_shmem puts", &format!("needs 2 GPUs, found {n}"));
    }
    puts_and_barriers();
}

/// Batches of WAITS waits on a word that holds: the kernel wait and the
/// driver wait, eager and as graphs of WAITS waits.
fn waits() {
    let device = Device::cuda(0);
    let mut c = WorldConfig::in_process("bench-waits", 0, 1, device);
    c.heap_bytes = Some(16 << 20);
    c.timeout = Duration::from_secs(10);
    let mut w = World::new();
    w.init(&c).unwrap();
    let sig = w.malloc(8).unwrap();
    let one = 1u64;
    // SAFETY: 8 bytes of a live local into this PE's heap.
    unsafe { w.put(sig, &one as *const u64 as u64, 8, 0) }.unwrap();
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: this bench orders its own work on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let raw = stream.cu_stream();
    // SAFETY: the bench's live stream of `device`, outliving its uses here.
    let on_stream = unsafe { Stream::from_raw(device, raw) };
    let wp: *mut World = &mut w;
    let kernel_waits = move || {
        for _ in 0..WAITS {
            // SAFETY: `w` outlives every use; only one closure runs at a
            // time.
            unsafe { (*wp).wait_until_on_stream(sig, Cmp::Ge, 1, raw.cast()) }.unwrap();
        }
    };
    let driver_waits = move || {
        for _ in 0..WAITS {
            // SAFETY: `sig` is an aligned word of this PE's device heap.
            unsafe { on_stream.wait_value_geq(sig, 1) }.unwrap();
        }
    };
    // Load the kernels before the capture.
    kernel_waits();
    stream.synchronize().unwrap();
    let kernel_graph = capture_graph(device, &stream, &mut || kernel_waits());
    let driver_graph = capture_graph(device, &stream, &mut || driver_waits());
    let t = interleaved_medians(
        &ctx,
        &stream,
        30,
        &mut [
            Box::new(kernel_waits),
            Box::new(driver_waits),
            Box::new(|| {
                // An instantiated graph of this context.
                on_stream.launch_graph(&kernel_graph).unwrap()
            }),
            Box::new(|| {
                // As above.
                on_stream.launch_graph(&driver_graph).unwrap()
            }),
        ],
    );
    let us = |ms: f64| ms * 1e3 / WAITS as f64;
    println!(
        "{}: a wait on the stream on a word that holds, us per wait (median of 30 batches of {WAITS}):",
        cuda::device_info(device).unwrap().name
    );
    println!("| path | wait_until_on_stream (kernel, times out) | cuStreamWaitValue64 (driver, cannot) | kernel / driver |");
    println!("|---|---|---|---|");
    println!(
        "| eager | {:.2} | {:.2} | {:.2} |",
        us(t[0]),
        us(t[1]),
        t[0] / t[1]
    );
    println!(
        "| graph | {:.2} | {:.2} | {:.2} |",
        us(t[2]),
        us(t[3]),
        t[2] / t[3]
    );
    stream.synchronize().unwrap();
    w.quiet().unwrap();
    w.free(sig).unwrap();
    w.finalize().unwrap();
}

fn puts_and_barriers() {
    let names: Vec<String> = (0..2)
        .map(|d| cuda::device_info(Device::cuda(d)).unwrap().name)
        .collect();
    println!("devices: {} -> {}; put = World::put_nbi (cuMemcpyAsync on the peer pointer), ref = cuMemcpyPeerAsync, same addresses, same stream", names[0], names[1]);
    let go = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2usize)
        .map(|rank| {
            let go = go.clone();
            std::thread::spawn(move || {
                run(rank, &go);
                exchanges(rank, None);
                exchanges(rank, Some(Pairs::Nccl));
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

fn run(rank: usize, go: &Barrier) {
    let (mut w, src, dst) = filled_world(rank, "bench", None).unwrap();
    let ctx = CudaContext::new(rank).unwrap();
    // SAFETY: this bench orders its own work on one stream per GPU.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let raw = stream.cu_stream();
    w.barrier_all().unwrap();
    if rank == 0 {
        let peer_dst = w.ptr(1, dst).unwrap();
        put_rows(&mut w, (src, dst, peer_dst), &ctx, &stream);
    }
    w.barrier_all().unwrap();
    // barrier_on_stream latency: both PEs enqueue the same number of
    // barriers; rank 0 times batches of BARRIERS.
    go.wait();
    if rank == 0 {
        let wp: *mut World = &mut w;
        let t = interleaved_medians(
            &ctx,
            &stream,
            BARRIER_ROUNDS,
            &mut [Box::new(|| {
                for _ in 0..BARRIERS {
                    // SAFETY: as above.
                    unsafe { (*wp).barrier_on_stream(raw.cast()) }.unwrap();
                }
            })],
        );
        println!(
            "barrier_on_stream, 2 PEs: {:.2} us per barrier (median of {BARRIER_ROUNDS} batches of {BARRIERS})",
            t[0] * 1e3 / BARRIERS as f64
        );
    } else {
        for _ in 0..(30 + BARRIER_ROUNDS) * BARRIERS {
            w.barrier_on_stream(raw.cast()).unwrap();
        }
    }
    stream.synchronize().unwrap();
    w.quiet().unwrap();
    w.barrier_all().unwrap();
    w.free(dst).unwrap();
    w.free(src).unwrap();
    w.finalize().unwrap();
}

/// PE `rank` of a 2-PE world `name` of `pairs`, with a source object of
/// MAX random-ish nonzero bytes and a destination object of MAX; the init's
/// error when the world cannot start.
fn filled_world(
    rank: usize,
    name: &str,
    pairs: Option<Pairs>,
) -> xcall_shmem::Result<(World, u64, u64)> {
    let mut c = WorldConfig::in_process(name, rank, 2, Device::cuda(rank as u32));
    c.heap_bytes = Some(2 * MAX + (16 << 20));
    c.timeout = Duration::from_secs(120);
    c.pairs = pairs;
    let mut w = World::new();
    w.init(&c)?;
    let src = w.malloc(MAX).unwrap();
    let dst = w.malloc(MAX).unwrap();
    let fill: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8 | 1)
        .collect();
    for off in (0..MAX).step_by(fill.len()) {
        // SAFETY: `fill` lives across the blocking put into this PE's heap.
        unsafe { w.put(src + off as u64, fill.as_ptr() as u64, fill.len(), rank) }.unwrap();
    }
    Ok((w, src, dst))
}

/// One table row: the bytes, the two variants' times and rates, and the
/// first's rate over the second's (the reference).
fn print_row(bytes: usize, t: &[f64]) {
    let gbs = |ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
    println!(
        "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} |",
        human(bytes),
        t[0] * 1e3,
        gbs(t[0]),
        t[1] * 1e3,
        gbs(t[1]),
        t[1] / t[0]
    );
}

/// Rank 1's receive buffer, for rank 0's cuMemcpyPeerAsync reference.
static PEER_DST: AtomicU64 = AtomicU64::new(0);

/// `World::exchange_on_stream` of 4 KiB .. 1 GiB from PE 0 to PE 1 in a
/// world of `pairs`, beside cuMemcpyPeerAsync of the same bytes; rank 1
/// makes the matching calls (its receives, or its waits for the signal).
fn exchanges(rank: usize, pairs: Option<Pairs>) {
    let name = if pairs.is_some() {
        "bench-nccl"
    } else {
        "bench-direct"
    };
    let (mut w, src, dst) = match filled_world(rank, name, pairs) {
        Ok(x) => x,
        Err(e) => {
            if rank == 0 {
                skip("bench cuda_shmem exchanges", &format!("{name}: {e}"));
            }
            return;
        }
    };
    let ctx = CudaContext::new(rank).unwrap();
    // SAFETY: this bench orders its own work on one stream per GPU.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let raw = stream.cu_stream();
    if rank == 1 {
        PEER_DST.store(dst, Ordering::Release);
    }
    w.barrier_all().unwrap();
    let transport = w.transport(1 - rank).unwrap().name();
    let mut bytes = 4096usize;
    if rank == 0 {
        println!("exchange from GPU 0 to GPU 1 through {transport} pairs; ref = cuMemcpyPeerAsync of the same bytes, same stream, same rounds");
        println!("| bytes | exchange us | GB/s | cuMemcpyPeerAsync us | GB/s | exchange / ref |");
        println!("|---|---|---|---|---|---|");
    }
    let peer_dst = PEER_DST.load(Ordering::Acquire);
    let ctx1 = cuda::with_context(Device::cuda(1), |c| Ok(c.clone())).unwrap();
    while bytes <= MAX {
        let rounds = if bytes >= 256 << 20 { 10 } else { 30 };
        let out = [Outgoing {
            pe: 1,
            src,
            dest: dst,
            bytes,
        }];
        let inc = [Incoming {
            pe: 0,
            dest: dst,
            bytes,
        }];
        if rank == 0 {
            let wp: *mut World = &mut w;
            // SAFETY: rank 0's live stream on GPU 0, outliving its uses here.
            let on_stream = unsafe { Stream::from_raw(Device::cuda(0), raw) };
            let t = interleaved_medians(
                &ctx,
                &stream,
                rounds,
                &mut [
                    Box::new(|| {
                        // SAFETY: `w` outlives the closure and only it uses
                        // `w` while timing; `src` and `dst` are live.
                        unsafe { (*wp).exchange_on_stream(&out, &[], raw.cast()) }.unwrap()
                    }),
                    Box::new(|| {
                        // SAFETY: live device ranges of `bytes` on GPU 0
                        // and GPU 1 (rank 1's heap, mapped in this process).
                        unsafe { on_stream.copy_peer(peer_dst, &ctx1, src, &ctx, bytes) }.unwrap()
                    }),
                ],
            );
            print_row(bytes, &t);
        } else {
            // One matching call per exchange rank 0 makes (30 warm-up
            // rounds, then the timed ones).
            for _ in 0..30 + rounds {
                // SAFETY: `dst` is this PE's live object.
                unsafe { w.exchange_on_stream(&[], &inc, raw.cast()) }.unwrap();
            }
            stream.synchronize().unwrap();
        }
        w.barrier_all().unwrap();
        bytes *= 4;
    }
    if w.transport(1 - rank).unwrap() == Transport::NcclOneSided {
        one_sided_puts(rank, &mut w, (src, dst), &ctx, &stream);
    }
    stream.synchronize().unwrap();
    w.quiet().unwrap();
    w.barrier_all().unwrap();
    w.free(dst).unwrap();
    w.free(src).unwrap();
    w.finalize().unwrap();
}

/// `World::put_nbi` through NCCL's one-sided puts from PE 0 to PE 1, 4 KiB
/// .. 1 GiB, beside cuMemcpyPeerAsync of the same bytes (rank 1 makes no
/// call but the barriers).
fn one_sided_puts(
    rank: usize,
    w: &mut World,
    (src, dst): (u64, u64),
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
) {
    if rank == 0 {
        println!("put_nbi from GPU 0 to GPU 1 through NCCL's one-sided puts; ref = cuMemcpyPeerAsync of the same bytes, same stream, same rounds");
        let peer_dst = PEER_DST.load(Ordering::Acquire);
        put_rows(w, (src, dst, peer_dst), ctx, stream);
        stream.synchronize().unwrap();
    }
    // PE 1 keeps its heap until PE 0 is done putting into it.
    w.barrier_all().unwrap();
}

/// Rank 0's table of `World::put_nbi` to PE 1 (`src` to `dst`, whose
/// address on GPU 1 is `peer_dst`) for 4 KiB .. 1 GiB, each size beside
/// cuMemcpyPeerAsync of the same bytes in the same rounds.
fn put_rows(
    w: &mut World,
    (src, dst, peer_dst): (u64, u64, u64),
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
) {
    let raw = stream.cu_stream();
    let ctx1 = cuda::with_context(Device::cuda(1), |c| Ok(c.clone())).unwrap();
    // SAFETY: the caller's live stream on GPU 0, outliving its uses here.
    let on_stream = unsafe { Stream::from_raw(Device::cuda(0), raw) };
    println!("| bytes | put us | put GB/s | cuMemcpyPeerAsync us | GB/s | put / ref |");
    println!("|---|---|---|---|---|---|");
    let mut bytes = 4096usize;
    while bytes <= MAX {
        let rounds = if bytes >= 256 << 20 { 10 } else { 30 };
        let wp: *mut World = w;
        let t = interleaved_medians(
            ctx,
            stream,
            rounds,
            &mut [
                Box::new(|| {
                    // SAFETY: `w` outlives the closure and only it uses `w`
                    // while timing; `src` and `dst` are live objects.
                    unsafe { (*wp).put_nbi(dst, src, bytes, 1, raw.cast()) }.unwrap()
                }),
                Box::new(|| {
                    // SAFETY: live device ranges of `bytes` on GPU 0 and
                    // GPU 1 (PE 1's heap, mapped in this process).
                    unsafe { on_stream.copy_peer(peer_dst, &ctx1, src, ctx, bytes) }.unwrap()
                }),
            ],
        );
        print_row(bytes, &t);
        bytes *= 4;
    }
}

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}
