//! Expert-parallel dispatch and combine on GPUs (one thread per GPU in
//! this process): every output poisoned first, checked against the
//! plain-loop reference of `common`, and equal bit for bit to a Host run
//! of the same case (the probs' gradient within rounding); captured in a
//! CUDA graph and replayed on new data; a peer that never calls makes the
//! others' waits time out. Skips without a GPU unless
//! XCALL_REQUIRE_CUDA=1; cases needing more GPUs than the machine has
//! skip with a SKIP line.

use std::time::Duration;

use xcall_core::testing::{capture_graph, cuda_devices_or_skip, run_threads, watchdog};
use xcall_core::{Device, Status};
use xcall_ep::{Buf, EpConfig, EpGroup, EpKernels, Precision};

mod common;
use common::cuda::{gpus, CudaMem};
use common::run::{expert_major, round, Mem};
use common::threads::{host_equal_cases, run, same_outputs, world};
use common::*;

/// The PE counts of `counts` this machine's GPUs can run (none without
/// CUDA: a skip line); a count past them is left out with a note, not a
/// skip, since the counts below it ran.
fn pe_counts(test: &str, counts: &[usize]) -> Vec<usize> {
    let Some(n) = cuda_devices_or_skip(test) else {
        return Vec::new();
    };
    let (run, left): (Vec<usize>, Vec<usize>) = counts.iter().partition(|&&p| p <= n);
    if !left.is_empty() {
        eprintln!("note: {test}: {left:?} PEs need more than this machine's {n} GPU(s)");
    }
    run
}

/// `case` on GPUs with each kernel choice (the steps, and the low-latency
/// kernels where the size allows them), each equal to the Host run.
fn same_as_host(name: &str, case: Case) {
    let host = run(name, &case, false);
    for kernels in [EpKernels::Steps, EpKernels::LowLatency, EpKernels::Pull] {
        let mut on = case.clone();
        on.config.kernels = kernels;
        if on.config.layout(on.pes).is_err() {
            continue;
        }
        let name = format!("{name}-{}", kernels.name());
        let gpu = run(&name, &on, true);
        for (rank, (g, h)) in gpu.iter().zip(&host).enumerate() {
            same_outputs(&name, &case, rank, g, h);
        }
    }
}

/// Above decode sizes a CUDA group of several PEs pulls by default, and a
/// pulled dispatch stores nothing into any PE's receive rows; with every
/// PE in this process, peers read a bf16 `x` (a plain allocation of its
/// PE's device) in place, so nothing is copied into the send rows either.
/// They are poisoned first, stay poisoned, and every output still matches
/// the reference (a copy that read them would not).
#[test]
fn a_pulled_dispatch_copies_into_neither_receive_rows_nor_send_rows() {
    let _s = serial();
    for pes in pe_counts("cuda ep pulled", &[2, 4]) {
        for precision in [Precision::Bf16, Precision::Fp8Dispatch] {
            let case = Case::new(
                cfg(300, 256, 4, 8 * pes, precision),
                pes,
                Routing::Random,
                61,
            );
            assert_eq!(case.config.kernels, EpKernels::Auto);
            let heap = case.config.layout(pes).unwrap().heap_bytes;
            let group = format!("ep-pulled-{}-{}", precision.name(), std::process::id());
            run_threads("cuda pulled", pes, watchdog(), move |rank| {
                let device = Device::cuda(rank as u32);
                let mut w = world(&group, rank, pes, device, heap, Duration::from_secs(30));
                let mut g = EpGroup::new(&mut w, case.config).unwrap();
                assert!(g.pulls() && !g.low_latency(), "PE {rank}");
                let (c, at) = (case.config, g.layout().at);
                let base = g.send_rows().addr - at.send as u64;
                let (rows, h) = (pes * c.tokens, c.hidden);
                let mut parts = vec![Buf::new(
                    base + at.recv as u64,
                    rows * h * c.precision.wire_bytes(),
                )];
                if precision == Precision::Fp8Dispatch {
                    parts.push(Buf::new(base + at.recv_scales as u64, rows * (h / 128) * 4));
                } else {
                    parts.push(Buf::new(base + at.send as u64, c.tokens * h * 2));
                }
                let mut m = CudaMem::new(device);
                for &b in &parts {
                    m.write(b, &vec![0x5a; b.bytes]);
                }
                w.barrier_all().unwrap();
                round(&case, rank, &mut g, &mut m, false);
                w.barrier_all().unwrap();
                for (i, &b) in parts.iter().enumerate() {
                    assert!(
                        m.read(b).iter().all(|&v| v == 0x5a),
                        "PE {rank}: part {i} (receive rows, then FP8 scales or send rows) was written ({})",
                        precision.name()
                    );
                }
                drop(m);
                g.destroy(&mut w).unwrap();
            });
        }
    }
}

#[test]
fn one_to_four_gpus_match_the_reference_and_the_host_bit_for_bit() {
    let _s = serial();
    for pes in pe_counts("cuda ep", &[1, 2, 4]) {
        for (name, case) in host_equal_cases(pes) {
            same_as_host(&format!("cuda-{name}"), case);
        }
    }
}

/// One PE's graph test: dispatch (from the group's send rows) and combine
/// captured once, replayed on new inputs written into the same buffers,
/// each replay checked.
fn graph_pe(case: &Case, rank: usize, replays: u64) {
    let device = Device::cuda(rank as u32);
    let c = case.config;
    let heap = c.layout(case.pes).unwrap().heap_bytes;
    let mut w = world(
        &format!("ep-graph-{}", std::process::id()),
        rank,
        case.pes,
        device,
        heap,
        Duration::from_secs(30),
    );
    let mut g = EpGroup::new(&mut w, c).unwrap();
    let mut m = CudaMem::new(device);
    let (h, k, n) = (c.hidden, c.topk, c.tokens);
    // Tokens written straight into the group's send rows (no copy).
    let x = g.send_rows();
    let ids = m.alloc(n * k * 4);
    let probs = m.alloc(n * k * 4);
    let out = expert_major(&mut m, &g, false);
    let y = m.alloc(n * h * 2);
    let s = m.stream();
    // One eager call profiled: an event after every kernel, in order.
    g.profile(true);
    let none = Buf::new(m.alloc(n * k * 4).addr, n * k * 4);
    m.write(none, &vec![0xff; n * k * 4]);
    // SAFETY: the buffers above (every id -1: nothing routed).
    unsafe { g.dispatch(x, none, probs, n, &out, s) }.unwrap();
    m.sync();
    let names: Vec<&str> = g
        .take_profile()
        .unwrap()
        .iter()
        .map(|(w, ms)| {
            assert!(*ms >= 0.0, "{w}: {ms}");
            *w
        })
        .collect();
    // One kernel where asked to.
    assert_eq!(g.low_latency(), c.kernels == EpKernels::LowLatency);
    assert_eq!(g.pulls(), c.kernels == EpKernels::Pull && case.pes > 1);
    assert_eq!(
        g.kernels_run(),
        match (c.kernels, case.pes) {
            (EpKernels::Pull, 1) => EpKernels::Steps,
            (k, _) => k,
        }
    );
    let want: &[&str] = match (case.pes, g.low_latency(), g.pulls()) {
        (_, true, _) => &["ep_ll_dispatch"],
        (1, ..) => &["ep_publish", "ep_count", "ep_scan", "ep_assign", "ep_copy"],
        // Pulled: the routing announced with the rows, no push, and a
        // last phase before any PE may publish again.
        (_, _, true) => &[
            "ep_publish",
            "ep_signal",
            "ep_count",
            "ep_scan",
            "ep_assign",
            "ep_copy",
            "ep_signal",
            "ep_wait",
        ],
        _ => &[
            "ep_publish",
            "ep_push",
            "ep_signal",
            "ep_count",
            "ep_scan",
            "ep_assign",
            "ep_copy",
        ],
    };
    assert_eq!(names, want, "PE {rank}");
    g.profile(false);
    // SAFETY: the buffers above.
    unsafe { g.combine(out.rows, y, s) }.unwrap();
    m.sync();
    let exec = capture_graph(device, &m.stream.clone(), &mut || {
        // SAFETY: the buffers above, alive for the test; the combine reads
        // the dispatched rows as the experts' output (scale 1).
        unsafe {
            g.dispatch(x, ids, probs, n, &out, s).unwrap();
            g.combine(out.rows, y, s).unwrap();
        }
    });
    for r in 0..replays {
        let case = Case {
            seed: case.seed + r,
            ..case.clone()
        };
        let all: Vec<PeData> = (0..case.pes).map(|q| data(&case, q)).collect();
        m.write(x, &all[rank].x);
        m.write(
            ids,
            &all[rank]
                .ids
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        m.write(
            probs,
            &all[rank]
                .probs
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        m.write(y, &vec![0xff; n * h * 2]);
        // SAFETY: this PE's live stream, borrowed for the launch.
        let st =
            unsafe { xcall_core::cuda::Stream::from_raw(device, s as xcall_core::cuda::RawStream) };
        st.launch_graph(&exec).unwrap();
        m.sync();
        g.check().unwrap();
        // The reference with the identity expert: y = sum of probs times x.
        let got = to_f32(Precision::Bf16, &m.read(y));
        let mut want = vec![0f64; n * h];
        let mut mag = vec![0f64; n * h];
        for q in 0..case.pes {
            for kept in received(&case, &all, q).kept.iter().filter(|r| r.s == rank) {
                let p = all[rank].probs[kept.t * k + kept.j] as f64;
                let row = expert_row(&case, &all, kept);
                for i in 0..h {
                    want[kept.t * h + i] += p * row[i] as f64;
                    mag[kept.t * h + i] += (p * row[i] as f64).abs();
                }
            }
        }
        close(
            &format!("graph replay {r}, PE {rank}"),
            &got,
            &want,
            &mag,
            Precision::Bf16,
            3.0,
        );
    }
    drop(exec);
    g.destroy(&mut w).unwrap();
}

#[test]
fn a_captured_step_replays_on_new_routing() {
    let _s = serial();
    for pes in pe_counts("cuda ep graph", &[1, 2, 4]) {
        for kernels in [EpKernels::Steps, EpKernels::LowLatency, EpKernels::Pull] {
            let case = Case::new(
                EpConfig {
                    kernels,
                    ..cfg(256, 128, 4, 8 * pes, Precision::Bf16)
                },
                pes,
                Routing::Random,
                90,
            );
            run_threads("graph", pes, watchdog(), move |rank| {
                graph_pe(&case, rank, 4)
            });
        }
    }
}

#[test]
fn a_peer_that_never_calls_times_out_on_the_stream_and_check_says_so() {
    let _s = serial();
    if !gpus("cuda ep timeout", 2) {
        return;
    }
    for kernels in [EpKernels::Steps, EpKernels::LowLatency, EpKernels::Pull] {
        peer_never_calls(EpConfig {
            kernels,
            ..cfg(64, 64, 2, 4, Precision::Bf16)
        });
    }
}

fn peer_never_calls(c: EpConfig) {
    let heap = c.layout(2).unwrap().heap_bytes;
    let group = format!("ep-timeout-{}-{}", c.kernels.name(), std::process::id());
    let r = run_threads("cuda timeout", 2, watchdog(), move |rank| {
        let device = Device::cuda(rank as u32);
        let mut w = world(&group, rank, 2, device, heap, Duration::from_millis(500));
        let mut g = EpGroup::new(&mut w, c).unwrap();
        if rank == 1 {
            return None;
        }
        let mut m = CudaMem::new(device);
        let x = m.alloc(64 * 64 * 2);
        let ids = m.alloc(64 * 2 * 4);
        let probs = m.alloc(64 * 2 * 4);
        m.write(
            ids,
            &(0..128)
                .flat_map(|i: i32| (i % 4).to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let out = expert_major(&mut m, &g, false);
        let t = std::time::Instant::now();
        // SAFETY: the buffers above.
        unsafe { g.dispatch(x, ids, probs, 64, &out, m.stream()) }.unwrap();
        m.sync();
        let e = g.check().unwrap_err();
        Some((e.status(), e.to_string(), t.elapsed()))
    });
    let (status, msg, took) = r[0].clone().unwrap();
    assert_eq!(status, Status::Timeout, "{msg}");
    assert!(msg.contains("for PE 1"), "{:?}: {msg}", c.kernels);
    assert!(took < Duration::from_secs(10), "{took:?}");
}
