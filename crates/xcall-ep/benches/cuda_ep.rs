//! Expert-parallel dispatch and combine on every GPU of this machine (one
//! thread per GPU, one process), at the DeepSeek-V3-like shape (T = 4096
//! tokens per GPU, H = 7168, E = 256, top-8; bf16 and FP8 dispatch; all
//! SMs and a 24-SM budget), the decode shape (T = 128) and the default
//! shape of `xcall moe` (T = 8192, H = 4096, E = 8, top-2), uniform random
//! routing, fresh random data. The decode cases run the low-latency
//! kernels (the default at T <= 256) and, beside them, the steps; the
//! DeepSeek-V3-like ones the pulled steps (the default above) and, beside
//! them, the pushed ones.
//!
//! Per case: eager dispatch and combine, each timed with CUDA events on
//! every GPU (median of 100 after 20 warm-up rounds; bf16 tokens are
//! written into the group's send rows, FP8 ones quantized from the
//! caller's buffer), and the step
//! (dispatch then combine, the experts' outputs being the dispatched rows)
//! captured once and replayed (median of 100). The figure of a case is the
//! slowest GPU's median. Received bandwidth counts the tokens a GPU
//! receives (its own included) times the row's bytes, over dispatch's
//! time. One JSON line per case on stdout (`"bench": "cuda_ep"`).
//! `XCALL_EP_BENCH_GPUS` caps the GPUs used, `XCALL_EP_BENCH_ONLY=P` runs P
//! GPUs alone; `XCALL_EP_BENCH_CASE` keeps
//! the cases whose name contains it.

use std::ffi::c_void;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use xcall_core::cuda::{Event, RawStream, Stream};
use xcall_core::testing::{capture_graph, cuda_devices_or_skip, run_threads, XorShift};
use xcall_core::Device;
use xcall_ep::{Buf, EpConfig, EpGroup, EpKernels, ExpertMajor, Precision};
use xcall_shmem::{World, WorldConfig};

const WARMUP: usize = 20;
const ROUNDS: usize = 100;

struct Case {
    name: &'static str,
    config: EpConfig,
}

fn cases() -> Vec<Case> {
    let dsv3 = EpConfig::new(4096, 7168, 8, 256);
    vec![
        Case {
            name: "dsv3 bf16",
            config: dsv3,
        },
        Case {
            name: "dsv3 bf16 pushed",
            config: EpConfig {
                kernels: EpKernels::Steps,
                ..dsv3
            },
        },
        Case {
            name: "dsv3 bf16 24 SMs",
            config: EpConfig {
                num_sms: 24,
                ..dsv3
            },
        },
        Case {
            name: "dsv3 fp8",
            config: EpConfig {
                precision: Precision::Fp8Dispatch,
                ..dsv3
            },
        },
        Case {
            name: "dsv3 fp8 pushed",
            config: EpConfig {
                precision: Precision::Fp8Dispatch,
                kernels: EpKernels::Steps,
                ..dsv3
            },
        },
        Case {
            name: "dsv3 fp8 24 SMs",
            config: EpConfig {
                precision: Precision::Fp8Dispatch,
                num_sms: 24,
                ..dsv3
            },
        },
        Case {
            name: "decode T=128 bf16",
            config: EpConfig::new(128, 7168, 8, 256),
        },
        Case {
            name: "decode T=128 bf16 steps",
            config: EpConfig {
                kernels: EpKernels::Steps,
                ..EpConfig::new(128, 7168, 8, 256)
            },
        },
        Case {
            name: "decode T=128 fp8",
            config: EpConfig {
                precision: Precision::Fp8Dispatch,
                ..EpConfig::new(128, 7168, 8, 256)
            },
        },
        Case {
            name: "decode T=16 bf16",
            config: EpConfig::new(16, 7168, 8, 256),
        },
        Case {
            name: "decode T=16 bf16 steps",
            config: EpConfig {
                kernels: EpKernels::Steps,
                ..EpConfig::new(16, 7168, 8, 256)
            },
        },
        Case {
            name: "default shape bf16",
            config: EpConfig::new(8192, 4096, 2, 8),
        },
    ]
}

fn alloc(device: Device, bytes: usize, held: &mut Vec<u64>) -> Buf {
    let a = xcall_core::cuda::mem_alloc(device, bytes.max(16)).unwrap();
    held.push(a);
    Buf::new(a, bytes)
}

fn upload(device: Device, b: Buf, data: &[u8]) {
    // SAFETY: `b` is device memory of `device` of at least data.len() bytes.
    unsafe { xcall_core::cuda::copy_htod_sync(device, b.addr, data) }.unwrap();
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// What one PE measured.
struct PeTimes {
    dispatch: f64,
    combine: f64,
    step: f64,
    received: usize,
    sms: usize,
    /// Each kernel of an eager step (in order): its name and median ms.
    kernels: Vec<(&'static str, f64)>,
}

/// One PE's figures.
fn pe(case: &EpConfig, name: &str, rank: usize, pes: usize, start: &Barrier) -> PeTimes {
    let device = Device::cuda(rank as u32);
    let layout = case.layout(pes).unwrap();
    let mut wc = WorldConfig::in_process(&format!("ep-bench-{name}"), rank, pes, device);
    wc.heap_bytes = Some(layout.heap_bytes + (4 << 20));
    wc.timeout = Duration::from_secs(60);
    let mut w = World::new();
    w.init(&wc).unwrap();
    let mut g = EpGroup::new(&mut w, *case).unwrap();
    let ctx = CudaContext::new(rank).unwrap();
    let stream: Arc<CudaStream> = xcall_core::testing::new_stream(&ctx);
    let s = stream.cu_stream() as *mut c_void;
    let (t, h, k, e) = (case.tokens, case.hidden, case.topk, case.experts);
    let mut held = Vec::new();
    // bf16 tokens go straight into the group's send rows (no copy); FP8
    // quantizes from a buffer of the caller's.
    let fp8 = case.precision == Precision::Fp8Dispatch;
    let x = if fp8 {
        alloc(device, t * h * 2, &mut held)
    } else {
        g.send_rows()
    };
    let ids = alloc(device, t * k * 4, &mut held);
    let probs = alloc(device, t * k * 4, &mut held);
    let y = alloc(device, t * h * 2, &mut held);
    let rows = layout.expert_rows;
    let l = layout.local_experts;
    let out = ExpertMajor {
        rows: alloc(device, g.expert_rows_bytes(), &mut held),
        scales: if fp8 {
            alloc(device, rows * h / 128 * 4, &mut held)
        } else {
            Buf::NONE
        },
        rows_bf16: if fp8 {
            alloc(device, rows * h * 2, &mut held)
        } else {
            Buf::NONE
        },
        tokens_per_expert: alloc(device, l * 8, &mut held),
        ..ExpertMajor::default()
    };
    let expert_out = if fp8 { out.rows_bf16 } else { out.rows };
    let mut rng = XorShift::new(rank as u64 * 7919 + 1);
    let xs: Vec<u8> = (0..t * h)
        .flat_map(|_| half::bf16::from_f32(rng.next_f32()).to_le_bytes())
        .collect();
    upload(device, x, &xs);
    let mut idv = Vec::with_capacity(t * k);
    let mut received = vec![false; pes * t];
    for _ in 0..t {
        let mut chosen: Vec<i32> = Vec::new();
        while chosen.len() < k {
            let v = (rng.next_u64() % e as u64) as i32;
            if !chosen.contains(&v) {
                chosen.push(v);
            }
        }
        idv.extend(chosen);
    }
    upload(
        device,
        ids,
        &idv.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
    );
    upload(
        device,
        probs,
        &(0..t * k)
            .flat_map(|_| (rng.next_f32().abs() * 0.5).to_le_bytes())
            .collect::<Vec<_>>(),
    );
    // Tokens this PE receives: every PE draws its routing from its rank's
    // seed, so replay the others' draws here.
    for s in 0..pes {
        let mut r = XorShift::new(s as u64 * 7919 + 1);
        for _ in 0..t * h {
            r.next_f32();
        }
        for tok in 0..t {
            let mut chosen: Vec<u64> = Vec::new();
            while chosen.len() < k {
                let v = r.next_u64() % e as u64;
                if !chosen.contains(&v) {
                    chosen.push(v);
                }
            }
            if chosen.iter().any(|&v| v as usize / l == rank) {
                received[s * t + tok] = true;
            }
        }
    }
    let got = received.iter().filter(|b| **b).count();
    // SAFETY: (every call below) the buffers above, alive until the end,
    // on this PE's stream.
    let step = |g: &mut EpGroup, ev: Option<(&Event, &Event, &Event)>| unsafe {
        if let Some((a, _, _)) = ev {
            a.record(s as RawStream).unwrap();
        }
        g.dispatch(x, ids, probs, t, &out, s).unwrap();
        if let Some((_, b, _)) = ev {
            b.record(s as RawStream).unwrap();
        }
        g.combine(expert_out, y, s).unwrap();
        if let Some((_, _, c)) = ev {
            c.record(s as RawStream).unwrap();
        }
    };
    for _ in 0..WARMUP {
        step(&mut g, None);
    }
    stream.synchronize().unwrap();
    start.wait();
    let events: Vec<[Event; 3]> = (0..ROUNDS)
        .map(|_| {
            [
                Event::new(device).unwrap(),
                Event::new(device).unwrap(),
                Event::new(device).unwrap(),
            ]
        })
        .collect();
    for ev in &events {
        step(&mut g, Some((&ev[0], &ev[1], &ev[2])));
    }
    stream.synchronize().unwrap();
    g.check().unwrap();
    let mut d: Vec<f64> = events
        .iter()
        .map(|e| e[1].elapsed_ms_since(&e[0]).unwrap() as f64)
        .collect();
    let mut c: Vec<f64> = events
        .iter()
        .map(|e| e[2].elapsed_ms_since(&e[1]).unwrap() as f64)
        .collect();
    let exec = capture_graph(device, &stream, &mut || step(&mut g, None));
    // SAFETY: this PE's live stream.
    let st = unsafe { Stream::from_raw(device, s as RawStream) };
    for _ in 0..WARMUP {
        st.launch_graph(&exec).unwrap();
    }
    stream.synchronize().unwrap();
    start.wait();
    let marks: Vec<Event> = (0..=ROUNDS).map(|_| Event::new(device).unwrap()).collect();
    // SAFETY: a live stream of this device.
    unsafe { marks[0].record(s as RawStream) }.unwrap();
    for m in &marks[1..] {
        st.launch_graph(&exec).unwrap();
        // SAFETY: as above.
        unsafe { m.record(s as RawStream) }.unwrap();
    }
    stream.synchronize().unwrap();
    g.check().unwrap();
    let mut steps: Vec<f64> = marks
        .windows(2)
        .map(|m| m[1].elapsed_ms_since(&m[0]).unwrap() as f64)
        .collect();
    drop(exec);
    // Where an eager step's time goes: an event after every kernel.
    g.profile(true);
    let mut per: Vec<(&'static str, Vec<f64>)> = Vec::new();
    start.wait();
    for _ in 0..20 {
        step(&mut g, None);
        stream.synchronize().unwrap();
        for (i, (what, ms)) in g.take_profile().unwrap().into_iter().enumerate() {
            if per.len() <= i {
                per.push((what, Vec::new()));
            }
            per[i].1.push(ms as f64);
        }
    }
    g.profile(false);
    let kernels = per
        .into_iter()
        .map(|(w, mut v)| (w, median(&mut v)))
        .collect();
    let sms = g.sms_used();
    g.destroy(&mut w).unwrap();
    for a in held {
        // SAFETY: allocated above; the stream is idle.
        unsafe { xcall_core::cuda::mem_free(device, a) }.unwrap();
    }
    w.finalize().unwrap();
    PeTimes {
        dispatch: median(&mut d),
        combine: median(&mut c),
        step: median(&mut steps),
        received: got,
        sms,
        kernels,
    }
}

fn main() {
    let Some(n) = cuda_devices_or_skip("bench cuda_ep") else {
        return;
    };
    let cap = std::env::var("XCALL_EP_BENCH_GPUS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let info = xcall_core::cuda::device_info(Device::cuda(0)).unwrap();
    let mut counts = vec![1usize];
    for p in [2, 4, 8] {
        if p <= n.min(cap) {
            counts.push(p);
        }
    }
    if let Some(only) = std::env::var("XCALL_EP_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        counts.retain(|&p| p == only);
    }
    for pes in counts {
        let only = std::env::var("XCALL_EP_BENCH_CASE").unwrap_or_default();
        for case in cases() {
            if case.config.experts % pes != 0 || !case.name.contains(only.as_str()) {
                continue;
            }
            let start = Arc::new(Barrier::new(pes));
            let config = case.config;
            let name = format!("{}-{pes}", case.name);
            let r = run_threads(&name.clone(), pes, Duration::from_secs(600), move |rank| {
                pe(&config, &name, rank, pes, &start)
            });
            let worst = |f: fn(&PeTimes) -> f64| r.iter().map(f).fold(0.0, f64::max);
            let (d, c, st) = (
                worst(|v| v.dispatch),
                worst(|v| v.combine),
                worst(|v| v.step),
            );
            let wire = config.hidden * config.precision.wire_bytes()
                + if config.precision == Precision::Fp8Dispatch {
                    config.hidden / 128 * 4
                } else {
                    0
                };
            let min_recv = r.iter().map(|v| v.received).min().unwrap_or(0);
            let gbs = r
                .iter()
                .map(|v| v.received as f64 * wire as f64 / (v.dispatch * 1e-3) / 1e9)
                .fold(f64::MAX, f64::min);
            println!(
                "{:>22} on {pes} x {}: dispatch {d:.3} ms ({gbs:.0} GB/s received per GPU, >= {min_recv} tokens), combine {c:.3} ms, step (graph) {st:.3} ms, {} SMs",
                case.name, info.name, r[0].sms
            );
            let kernels: Vec<String> = r[0]
                .kernels
                .iter()
                .enumerate()
                .map(|(i, (w, _))| {
                    let slowest = r
                        .iter()
                        .map(|v| v.kernels.get(i).map_or(0.0, |k| k.1))
                        .fold(0.0, f64::max);
                    format!("{w} {slowest:.3}")
                })
                .collect();
            println!(
                "{:>22}   eager step by kernel (ms, slowest GPU): {}",
                "",
                kernels.join(", ")
            );
            println!(
                "{{\"bench\": \"cuda_ep\", \"case\": \"{}\", \"gpus\": {pes}, \"device\": \"{}\", \"dispatch_ms\": {d:.4}, \"combine_ms\": {c:.4}, \"step_ms\": {st:.4}, \"received_gbs\": {gbs:.1}, \"sms\": {}}}",
                case.name, info.name, r[0].sms
            );
        }
    }
}
