//! Two GPUs, one process (SPMT): put bandwidth from GPU 0's heap into GPU
//! 1's heap for 4 KiB .. 1 GiB, side by side in one run with
//! cuMemcpyPeerAsync of the same bytes between the same addresses; and
//! barrier_on_stream latency for 2 PEs. CUDA-event medians of interleaved
//! rounds after warm-up.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::{sys, CudaContext};
use xcall_core::testing::{cuda_devices_or_skip, interleaved_medians, skip};
use xcall_core::{cuda, Device};
use xcall_shmem::{Config, World};

const MAX: usize = 1 << 30;
const BARRIERS: usize = 100;
const BARRIER_ROUNDS: usize = 30;

fn main() {
    match cuda_devices_or_skip("bench cuda_shmem") {
        Some(n) if n >= 2 => {}
        Some(n) => return skip("bench cuda_shmem", &format!("needs 2 GPUs, found {n}")),
        None => return,
    }
    let names: Vec<String> = (0..2)
        .map(|d| cuda::device_info(Device::cuda(d)).unwrap().name)
        .collect();
    println!("devices: {} -> {}; put = World::put_nbi (cuMemcpyAsync on the peer pointer), ref = cuMemcpyPeerAsync, same addresses, same stream", names[0], names[1]);
    let go = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2usize)
        .map(|rank| {
            let go = go.clone();
            std::thread::spawn(move || run(rank, &go))
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

fn run(rank: usize, go: &Barrier) {
    let device = Device::cuda(rank as u32);
    let mut c = Config::in_process("bench", rank, 2, device);
    c.heap_bytes = Some(2 * MAX + (16 << 20));
    c.timeout = Duration::from_secs(120);
    let mut w = World::new();
    w.init(&c).unwrap();
    let src = w.malloc(MAX).unwrap();
    let dst = w.malloc(MAX).unwrap();
    // Random-ish, nonzero source bytes.
    let fill: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8 | 1)
        .collect();
    for off in (0..MAX).step_by(fill.len()) {
        // SAFETY: `fill` lives across the blocking put into this PE's heap.
        unsafe { w.put(src + off as u64, fill.as_ptr() as u64, fill.len(), rank) }.unwrap();
    }
    let ctx = CudaContext::new(rank).unwrap();
    // SAFETY: this bench orders its own work on one stream per GPU.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let raw = stream.cu_stream();
    w.barrier_all().unwrap();
    if rank == 0 {
        let peer_dst = w.ptr(1, dst).unwrap();
        let ctx1 = cuda::with_context(Device::cuda(1), |c| Ok(c.cu_ctx())).unwrap();
        let ctx0 = ctx.cu_ctx();
        println!("| bytes | put us | put GB/s | cuMemcpyPeerAsync us | GB/s | put / ref |");
        println!("|---|---|---|---|---|---|");
        let mut bytes = 4096usize;
        while bytes <= MAX {
            let rounds = if bytes >= 256 << 20 { 10 } else { 30 };
            let wp: *mut World = &mut w;
            let t = interleaved_medians(
                &ctx,
                &stream,
                rounds,
                &mut [
                    Box::new(|| {
                        // SAFETY: `w` outlives the closure; only this
                        // closure uses it while timing; src/dst live.
                        unsafe { (*wp).put_nbi(dst, src, bytes, 1, raw.cast()) }.unwrap()
                    }),
                    Box::new(|| {
                        // SAFETY: both ranges are live heap objects of `bytes`.
                        unsafe { sys::cuMemcpyPeerAsync(peer_dst, ctx1, src, ctx0, bytes, raw) }
                            .result()
                            .unwrap()
                    }),
                ],
            );
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
            bytes *= 4;
        }
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

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}
