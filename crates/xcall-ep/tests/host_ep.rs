//! Expert-parallel dispatch and combine on Host PEs (threads of this
//! process), every output compared with the plain-loop reference of
//! `common`.

use std::time::Duration;

use xcall_core::testing::{run_threads, watchdog};
use xcall_core::{Device, Platform, Status};
use xcall_ep::{Buf, Capacity, EpConfig, EpError, EpGroup, EpKernels, ExpertMajor, Precision};
use xcall_shmem::{World, WorldConfig};

mod common;
use common::run::{expert_major, inputs, round, HostMem, Mem};
use common::*;

fn world(group: &str, rank: usize, n: usize, heap: usize) -> World {
    let mut c = WorldConfig::in_process(group, rank, n, Device::new(Platform::Host, rank as u32));
    c.heap_bytes = Some(heap + (1 << 20));
    c.timeout = Duration::from_secs(20);
    let mut w = World::new();
    w.init(&c).unwrap();
    w
}

/// Runs `rounds` rounds of `case` on its PEs as threads.
fn run(name: &str, case: Case, rounds: usize, backward: bool) {
    let heap = case.config.layout(case.pes).unwrap().heap_bytes;
    let group = format!("ep-{name}-{}", std::process::id());
    run_threads(name, case.pes, watchdog(), move |rank| {
        let mut w = world(&group, rank, case.pes, heap);
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        let mut m = HostMem::default();
        for r in 0..rounds {
            let c = Case {
                seed: case.seed + r as u64,
                ..case.clone()
            };
            round(&c, rank, &mut g, &mut m, backward);
        }
        g.destroy(&mut w).unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

#[test]
fn every_pe_count_and_precision_matches_the_reference() {
    let _s = serial();
    for pes in 1..=4 {
        for precision in [Precision::F32, Precision::Bf16] {
            let c = cfg(70, 16, 3, 4 * pes, precision);
            run(
                &format!("basic-{pes}-{}", precision.name()),
                Case::new(c, pes, Routing::Random, 11),
                2,
                true,
            );
        }
    }
}

#[test]
fn eight_pes_with_alignment_and_tiles_of_several_senders() {
    let _s = serial();
    let c = EpConfig {
        align: 8,
        ..cfg(150, 8, 4, 16, Precision::F32)
    };
    run("eight", Case::new(c, 8, Routing::Random, 5), 1, true);
}

#[test]
fn fp8_dispatch_quantizes_once_and_the_receiver_gets_rows_scales_and_bf16() {
    let _s = serial();
    for pes in [1, 2, 3] {
        let c = EpConfig {
            align: 4,
            ..cfg(40, 256, 2, 6, Precision::Fp8Dispatch)
        };
        run(
            &format!("fp8-{pes}"),
            Case::new(c, pes, Routing::Random, 21),
            2,
            true,
        );
    }
}

/// Experts that read bf16 take the bf16 rows alone: the same bf16 rows
/// (checked against the quantize-dequantize reference), and the same
/// outputs byte for byte as with the FP8 rows and scales written too.
#[test]
fn fp8_dispatch_writes_the_bf16_rows_alone_when_asked() {
    let _s = serial();
    for pes in [1, 3] {
        let c = EpConfig {
            align: 4,
            ..cfg(40, 256, 2, 6, Precision::Fp8Dispatch)
        };
        let both = Case::new(c, pes, Routing::Random, 23);
        let alone = Case {
            bf16_only: true,
            ..both.clone()
        };
        let outputs = |name: String, case: Case| {
            let heap = case.config.layout(case.pes).unwrap().heap_bytes;
            let group = format!("ep-{name}-{}", std::process::id());
            run_threads(&name, case.pes, watchdog(), move |rank| {
                let mut w = world(&group, rank, case.pes, heap);
                let mut g = EpGroup::new(&mut w, case.config).unwrap();
                let mut m = HostMem::default();
                let o = round(&case, rank, &mut g, &mut m, true);
                g.destroy(&mut w).unwrap();
                assert!(w.finalize().unwrap().leaked.is_empty());
                o
            })
        };
        let with_fp8 = outputs(format!("fp8-both-{pes}"), both);
        let bf16_alone = outputs(format!("fp8-bf16-{pes}"), alone);
        assert_eq!(with_fp8.len(), pes);
        for (a, b) in with_fp8.iter().zip(&bf16_alone) {
            assert_eq!(
                (&a.y, &a.grad_x, &a.grad_probs),
                (&b.y, &b.grad_x, &b.grad_probs)
            );
        }
    }
}

#[test]
fn capacity_drops_routes_in_sender_token_order_and_counts_them() {
    let _s = serial();
    for pes in [1, 2, 4] {
        let c = EpConfig {
            capacity: Capacity::PerExpert(9),
            align: 4,
            ..cfg(64, 16, 3, 4 * pes, Precision::Bf16)
        };
        run(
            &format!("capacity-{pes}"),
            Case::new(c, pes, Routing::Random, 3),
            2,
            true,
        );
    }
}

#[test]
fn routing_edge_cases() {
    let _s = serial();
    // All tokens to PE 0 (the others receive nothing); each token's
    // experts on one PE; -1 holes; k = 1; k = L; E = P.
    let cases = [
        (
            "all-to-first",
            cfg(50, 8, 2, 8, Precision::F32),
            4,
            Routing::AllToFirst,
        ),
        (
            "one-pe",
            cfg(50, 8, 3, 12, Precision::F32),
            3,
            Routing::OnePe,
        ),
        (
            "holes",
            cfg(50, 8, 3, 12, Precision::Bf16),
            3,
            Routing::Holes,
        ),
        ("k1", cfg(50, 8, 1, 4, Precision::F32), 2, Routing::Random),
        (
            "k-is-l",
            cfg(50, 8, 4, 8, Precision::F32),
            2,
            Routing::OnePe,
        ),
        (
            "e-is-p",
            cfg(50, 8, 3, 3, Precision::F32),
            3,
            Routing::Random,
        ),
        // One PE, k = 1: every third token has no route (its output is
        // zeros, written by the sums themselves).
        (
            "solo-holes",
            cfg(50, 8, 1, 4, Precision::Bf16),
            1,
            Routing::Holes,
        ),
    ];
    for (name, c, pes, routing) in cases {
        run(name, Case::new(c, pes, routing, 8), 1, true);
    }
}

#[test]
fn pes_may_send_fewer_tokens_than_the_group_holds_or_none() {
    let _s = serial();
    let c = cfg(70, 8, 2, 6, Precision::F32);
    let mut case = Case::new(c, 3, Routing::Random, 4);
    case.sent = vec![70, 0, 13];
    run("ragged", case, 2, true);
}

#[test]
fn dispatching_twice_in_a_row_is_fenced_and_stays_right() {
    let _s = serial();
    let case = Case::new(cfg(30, 8, 2, 4, Precision::F32), 2, Routing::Random, 9);
    let heap = case.config.layout(2).unwrap().heap_bytes;
    let group = format!("ep-twice-{}", std::process::id());
    run_threads("twice", 2, watchdog(), move |rank| {
        let mut w = world(&group, rank, 2, heap);
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        let mut m = HostMem::default();
        let all: Vec<PeData> = (0..2).map(|r| data(&case, r)).collect();
        let d = &all[rank];
        let (x, ids, probs) = inputs(&mut m, d);
        let out = expert_major(&mut m, &g, false);
        for _ in 0..3 {
            // SAFETY: the buffers above, alive for the test.
            unsafe { g.dispatch(x, ids, probs, 30, &out, std::ptr::null_mut()) }.unwrap();
        }
        // The last dispatch's combine is still right.
        round(&case, rank, &mut g, &mut m, false);
        g.destroy(&mut w).unwrap();
    });
}

#[test]
fn bad_routing_is_not_taken_and_reported_by_its_pe_alone() {
    let _s = serial();
    let c = cfg(20, 8, 2, 4, Precision::F32);
    let group = format!("ep-bad-{}", std::process::id());
    let heap = c.layout(2).unwrap().heap_bytes;
    let results = run_threads("bad routing", 2, watchdog(), move |rank| {
        let mut w = world(&group, rank, 2, heap);
        let mut g = EpGroup::new(&mut w, c).unwrap();
        let mut m = HostMem::default();
        let x = m.alloc(20 * 8 * 4);
        m.write(x, &vec![0x3f; 20 * 8 * 4]);
        // Rank 1: token 0 lists expert 4 (out of range) and token 1
        // expert 2 twice.
        let mut ids: Vec<i32> = (0..40).map(|i| i % 4).collect();
        if rank == 1 {
            ids[0] = 4;
            ids[2] = 2;
            ids[3] = 2;
        }
        let ib = m.alloc(160);
        m.write(
            ib,
            &ids.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
        );
        let pb = m.alloc(160);
        m.write(pb, &[0u8; 160]);
        let out = expert_major(&mut m, &g, false);
        // SAFETY: the buffers above.
        let r = unsafe { g.dispatch(x, ib, pb, 20, &out, std::ptr::null_mut()) };
        let tpe: Vec<u8> = m.read(out.tokens_per_expert);
        g.destroy(&mut w).unwrap();
        (r.map_err(|e| e.to_string()), tpe)
    });
    assert!(results[0].0.is_ok(), "{:?}", results[0].0);
    let err = results[1].0.as_ref().unwrap_err();
    assert!(err.contains("2 expert id(s)"), "{err}");
    // Token t lists experts [0, 1] (t even) or [2, 3] (t odd); PE 0
    // hosts 0 and 1, PE 1 2 and 3. PE 1's token 0 loses its route to
    // expert 0 (listed as 4) and token 1 its route to 3 (listed as a
    // second 2); everything else lands: 10 tokens per expert per sender.
    let counts = |b: &[u8]| -> Vec<i64> {
        b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    assert_eq!(counts(&results[0].1), vec![19, 20]);
    assert_eq!(counts(&results[1].1), vec![20, 19]);
}

#[test]
fn bad_arguments_get_a_specific_error_and_write_nothing() {
    let _s = serial();
    let c = cfg(16, 8, 2, 4, Precision::F32);
    let heap = c.layout(1).unwrap().heap_bytes;
    let group = format!("ep-args-{}", std::process::id());
    run_threads("bad arguments", 1, watchdog(), move |rank| {
        let mut w = world(&group, rank, 1, heap);
        let mut g = EpGroup::new(&mut w, c).unwrap();
        let mut m = HostMem::default();
        let x = m.alloc(16 * 8 * 4);
        let ids = m.alloc(16 * 2 * 4);
        let probs = m.alloc(16 * 2 * 4);
        let out = expert_major(&mut m, &g, false);
        m.write(out.tokens_per_expert, &[0x5a; 32]);
        let s = std::ptr::null_mut();
        // Combine before any dispatch.
        let y = m.alloc(16 * 8 * 4);
        // SAFETY: (every call below) the buffers above; each is refused
        // before anything runs.
        let e = unsafe { g.combine(out.rows, y, s) }.unwrap_err();
        assert_eq!(e.status(), Status::InvalidState, "{e}");
        let small = Buf::new(x.addr, 16 * 8 * 4 - 1);
        // SAFETY: the buffers above, alive for the test.
        let e = unsafe { g.dispatch(small, ids, probs, 16, &out, s) }.unwrap_err();
        assert!(
            matches!(&e, EpError::InvalidArgument(m) if m.contains("x holds 511 bytes")),
            "{e}"
        );
        // SAFETY: the buffers above, alive for the test.
        let e = unsafe { g.dispatch(x, ids, probs, 17, &out, s) }.unwrap_err();
        assert!(e.to_string().contains("more than the group's 16"), "{e}");
        let mut short = out;
        short.tokens_per_expert.bytes = 8;
        // SAFETY: the buffers above, alive for the test.
        let e = unsafe { g.dispatch(x, ids, probs, 16, &short, s) }.unwrap_err();
        assert!(e.to_string().contains("out.tokens_per_expert"), "{e}");
        let mut odd = out;
        odd.rows.addr += 4;
        // SAFETY: the buffers above, alive for the test.
        let e = unsafe { g.dispatch(x, ids, probs, 16, &odd, s) }.unwrap_err();
        assert!(e.to_string().contains("16-byte aligned"), "{e}");
        let mut fp8_only = out;
        fp8_only.scales = out.offsets;
        // SAFETY: the buffers above, alive for the test.
        let e = unsafe { g.dispatch(x, ids, probs, 16, &fp8_only, s) }.unwrap_err();
        assert!(e.to_string().contains("FP8 dispatch only"), "{e}");
        // SAFETY: the buffers above, alive for the test.
        let e = unsafe { g.dispatch(Buf::new(0, 512), ids, probs, 16, &out, s) }.unwrap_err();
        assert!(e.to_string().contains("x is null"), "{e}");
        // Nothing was written, and no phase was announced: a good call
        // still works alone.
        assert_eq!(m.read(out.tokens_per_expert), vec![0x5a; 32]);
        let good: Vec<u8> = (0..32).flat_map(|i: i32| (i % 2).to_le_bytes()).collect();
        m.write(ids, &good);
        // SAFETY: the buffers above, alive for the test.
        unsafe { g.dispatch(x, ids, probs, 16, &out, s) }.unwrap();
        // SAFETY: the buffers above, alive for the test.
        let e = unsafe { g.combine(out.rows, Buf::new(y.addr, 100), s) }.unwrap_err();
        assert!(e.to_string().contains("y holds 100 bytes"), "{e}");
        g.destroy(&mut w).unwrap();
    });
}

/// FP8 dispatch writes the FP8 rows with their scales, the bf16 rows, or
/// both: any other mix is refused with its reason and writes nothing; f32
/// and bf16 groups need their rows.
#[test]
fn fp8_rows_scales_and_bf16_rows_that_do_not_go_together_are_refused() {
    let _s = serial();
    let c = cfg(16, 128, 2, 4, Precision::Fp8Dispatch);
    let heap = c.layout(1).unwrap().heap_bytes;
    let group = format!("ep-fp8-args-{}", std::process::id());
    run_threads("fp8 arguments", 1, watchdog(), move |rank| {
        let mut w = world(&group, rank, 1, heap);
        let mut g = EpGroup::new(&mut w, c).unwrap();
        let mut m = HostMem::default();
        let x = m.alloc(16 * 128 * 2);
        let ids = m.alloc(16 * 2 * 4);
        let probs = m.alloc(16 * 2 * 4);
        let out = expert_major(&mut m, &g, true);
        m.write(out.tokens_per_expert, &[0x5a; 32]);
        m.write(out.rows_bf16, &vec![0x5a; out.rows_bf16.bytes]);
        let s = std::ptr::null_mut();
        let mut refused = |o: ExpertMajor, want: &str| {
            // SAFETY: the buffers above, alive for the test; refused before
            // anything runs.
            let e = unsafe { g.dispatch(x, ids, probs, 16, &o, s) }.unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument, "{e}");
            assert!(e.to_string().contains(want), "{want}: {e}");
        };
        let none = ExpertMajor {
            rows: Buf::NONE,
            scales: Buf::NONE,
            rows_bf16: Buf::NONE,
            ..out
        };
        refused(none, "out.rows and out.rows_bf16 are both null");
        refused(
            ExpertMajor {
                rows: Buf::NONE,
                ..out
            },
            "out.scales given without out.rows",
        );
        refused(
            ExpertMajor {
                scales: Buf::NONE,
                ..out
            },
            "out.rows given without out.scales",
        );
        refused(
            ExpertMajor {
                scales: Buf::new(out.scales.addr, out.scales.bytes - 4),
                ..out
            },
            "out.scales holds",
        );
        let short = Buf::new(out.rows_bf16.addr, out.rows_bf16.bytes - 2);
        refused(
            ExpertMajor {
                rows: Buf::NONE,
                scales: Buf::NONE,
                rows_bf16: short,
                ..out
            },
            "out.rows_bf16 holds",
        );
        assert_eq!(m.read(out.tokens_per_expert), vec![0x5a; 32]);
        assert_eq!(m.read(out.rows_bf16), vec![0x5a; out.rows_bf16.bytes]);
        g.destroy(&mut w).unwrap();
        // An f32 group needs its rows.
        let f = cfg(16, 8, 2, 4, Precision::F32);
        let mut g = EpGroup::new(&mut w, f).unwrap();
        let out = expert_major(&mut m, &g, false);
        let x = m.alloc(16 * 8 * 4);
        // SAFETY: as above.
        let e = unsafe {
            g.dispatch(
                x,
                ids,
                probs,
                16,
                &ExpertMajor {
                    rows: Buf::NONE,
                    ..out
                },
                s,
            )
        }
        .unwrap_err();
        assert!(e.to_string().contains("out.rows holds 0 bytes"), "{e}");
        g.destroy(&mut w).unwrap();
    });
}

#[test]
fn a_heap_too_small_names_the_bytes() {
    let _s = serial();
    let c = cfg(4096, 1024, 8, 64, Precision::Bf16);
    let group = format!("ep-heap-{}", std::process::id());
    run_threads("small heap", 2, watchdog(), move |rank| {
        let mut w = world(&group, rank, 2, 0);
        let e = EpGroup::new(&mut w, c).unwrap_err();
        let need = c.layout(2).unwrap().heap_bytes;
        assert_eq!(e.status(), Status::OutOfMemory);
        assert!(
            e.to_string().contains(&format!("needs {need} bytes")),
            "{e}"
        );
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

#[test]
fn a_peer_that_never_calls_makes_the_others_time_out() {
    let _s = serial();
    let c = cfg(8, 8, 1, 2, Precision::F32);
    let heap = c.layout(2).unwrap().heap_bytes;
    let group = format!("ep-timeout-{}", std::process::id());
    let r = run_threads("timeout", 2, watchdog(), move |rank| {
        let mut cfg =
            WorldConfig::in_process(&group, rank, 2, Device::new(Platform::Host, rank as u32));
        cfg.heap_bytes = Some(heap + (1 << 20));
        cfg.timeout = Duration::from_millis(300);
        let mut w = World::new();
        w.init(&cfg).unwrap();
        let mut g = EpGroup::new(&mut w, c).unwrap();
        if rank == 1 {
            return None;
        }
        let mut m = HostMem::default();
        let x = m.alloc(256);
        let ids = m.alloc(32);
        let probs = m.alloc(32);
        let out = expert_major(&mut m, &g, false);
        let t = std::time::Instant::now();
        // SAFETY: the buffers above.
        let e = unsafe { g.dispatch(x, ids, probs, 8, &out, std::ptr::null_mut()) }.unwrap_err();
        Some((e.status(), e.to_string(), t.elapsed()))
    });
    let (status, msg, took) = r[0].clone().unwrap();
    assert_eq!(status, Status::Timeout, "{msg}");
    assert!(msg.contains("for PE 1"), "{msg}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn tokens_written_into_the_send_rows_are_sent_in_place() {
    let _s = serial();
    let case = Case::new(cfg(40, 16, 2, 8, Precision::Bf16), 2, Routing::Random, 12);
    let heap = case.config.layout(2).unwrap().heap_bytes;
    let group = format!("ep-inplace-{}", std::process::id());
    run_threads("in place", 2, watchdog(), move |rank| {
        let mut w = world(&group, rank, 2, heap);
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        let mut m = HostMem::default();
        let all: Vec<PeData> = (0..2).map(|r| data(&case, r)).collect();
        let x = g.send_rows();
        m.write(x, &all[rank].x);
        let ids = m.alloc(40 * 2 * 4);
        m.write(
            ids,
            &all[rank]
                .ids
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let probs = m.alloc(40 * 2 * 4);
        m.write(
            probs,
            &all[rank]
                .probs
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let out = expert_major(&mut m, &g, false);
        // SAFETY: the buffers above (x is the group's own send rows).
        unsafe { g.dispatch(x, ids, probs, 40, &out, std::ptr::null_mut()) }.unwrap();
        let rows = m.read(out.rows);
        for kept in received(&case, &all, rank).kept {
            let row = 16 * 2;
            assert_eq!(
                &rows[kept.row * row..(kept.row + 1) * row],
                &all[kept.s].x[kept.t * row..(kept.t + 1) * row],
                "PE {rank}: {kept:?}"
            );
        }
        // Any other address inside the group is refused.
        let inside = Buf::new(x.addr + 16, 16 * 2 * 40);
        // SAFETY: refused before anything runs.
        let e =
            unsafe { g.dispatch(inside, ids, probs, 40, &out, std::ptr::null_mut()) }.unwrap_err();
        assert!(
            e.to_string().contains("overlaps the group's own memory"),
            "{e}"
        );
        g.destroy(&mut w).unwrap();
    });
}

/// The layer `L = sum(y * g)` of dispatch, the tests' experts (`x *
/// scale(e)`, linear) and combine, on 2 PEs in f32: the probs' gradient
/// from `combine_backward` and the tokens' gradient from
/// `dispatch_backward` (after the experts' own backward, `* scale(e)`)
/// match central finite differences of `L`.
#[test]
fn gradients_match_finite_differences() {
    let _s = serial();
    let c = cfg(24, 8, 3, 8, Precision::F32);
    let case = Case::new(c, 2, Routing::Random, 31);
    let heap = c.layout(2).unwrap().heap_bytes;
    let group = format!("ep-fd-{}", std::process::id());
    run_threads("finite differences", 2, watchdog(), move |rank| {
        let mut w = world(&group, rank, 2, heap);
        let mut g = EpGroup::new(&mut w, c).unwrap();
        let mut m = HostMem::default();
        let all: Vec<PeData> = (0..2).map(|r| data(&case, r)).collect();
        let (n, h, k, l) = (24, 8, 3, 4);
        let x = m.alloc(n * h * 4);
        let ids = m.alloc(n * k * 4);
        let probs = m.alloc(n * k * 4);
        let y = m.alloc(n * h * 4);
        let out = expert_major(&mut m, &g, false);
        let eo = m.alloc(out.rows.bytes);
        let gy: Vec<f32> = xcall_core::testing::random_f32(n * h, 99 + rank as u64);
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|f| f.to_le_bytes()).collect() };
        m.write(
            ids,
            &all[rank]
                .ids
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        // One forward pass with these tokens and probs; every PE runs it
        // (the perturbation is PE 0's alone): L on this PE, in f64.
        let forward = |m: &mut HostMem, g: &mut EpGroup, xv: &[f32], pv: &[f32]| -> f64 {
            m.write(x, &bytes(xv));
            m.write(probs, &bytes(pv));
            // SAFETY: the buffers above, alive for the test.
            unsafe { g.dispatch(x, ids, probs, n, &out, std::ptr::null_mut()) }.unwrap();
            let rows = f32s(&m.read(out.rows));
            let starts: Vec<i64> = m
                .read(out.offsets)
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let mut outv = vec![0f32; rows.len()];
            for e in 0..l {
                for r in starts[e] as usize..starts[e + 1] as usize {
                    for i in 0..h {
                        outv[r * h + i] = rows[r * h + i] * scale(rank * l + e);
                    }
                }
            }
            m.write(eo, &bytes(&outv));
            // SAFETY: as above.
            unsafe { g.combine(eo, y, std::ptr::null_mut()) }.unwrap();
            f32s(&m.read(y))
                .iter()
                .zip(&gy)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum()
        };
        let (x0, p0) = (f32s(&all[rank].x), all[rank].probs.clone());
        forward(&mut m, &mut g, &x0, &p0);
        // The gradients: combine_backward, the experts' backward, then
        // dispatch_backward.
        let gyb = m.alloc(n * h * 4);
        m.write(gyb, &bytes(&gy));
        let geo = m.alloc(out.rows.bytes);
        let gp = m.alloc(n * k * 4);
        // SAFETY: as above.
        unsafe { g.combine_backward(gyb, eo, geo, gp, std::ptr::null_mut()) }.unwrap();
        let grad_probs = f32s(&m.read(gp));
        let starts: Vec<i64> = m
            .read(out.offsets)
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let mut gin = f32s(&m.read(geo));
        for e in 0..l {
            for r in starts[e] as usize..starts[e + 1] as usize {
                for i in 0..h {
                    gin[r * h + i] *= scale(rank * l + e);
                }
            }
        }
        m.write(geo, &bytes(&gin));
        let gx = m.alloc(n * h * 4);
        // SAFETY: as above.
        unsafe { g.dispatch_backward(geo, gx, std::ptr::null_mut()) }.unwrap();
        let grad_x = f32s(&m.read(gx));
        // Central differences of the sum of L over both PEs, perturbing
        // PE 0's inputs: every PE runs the same passes, PE 0 changes one
        // value, each PE returns its part of L.
        let eps = 1e-2f32;
        let mut fd = Vec::new();
        for (which, at) in [(0, 5usize), (0, 40), (1, 2), (1, 50)] {
            let mut parts = [0f64; 2];
            for (i, sign) in [1f32, -1.0].iter().enumerate() {
                let (mut xv, mut pv) = (x0.clone(), p0.clone());
                if rank == 0 {
                    if which == 0 {
                        pv[at] += sign * eps
                    } else {
                        xv[at] += sign * eps
                    }
                }
                parts[i] = forward(&mut m, &mut g, &xv, &pv);
            }
            fd.push((which, at, parts));
        }
        g.destroy(&mut w).unwrap();
        (grad_probs, grad_x, fd)
    })
    .into_iter()
    .enumerate()
    .fold(
        None::<Vec<(usize, usize, f64)>>,
        |acc, (rank, (gp, gx, fd))| {
            // Sum each difference's L over the PEs; keep PE 0's gradients.
            let mut acc = acc.unwrap_or_default();
            for (i, (which, at, parts)) in fd.iter().enumerate() {
                if rank == 0 {
                    let analytic = if *which == 0 { gp[*at] } else { gx[*at] } as f64;
                    acc.push((*which, *at, analytic - (parts[0] - parts[1]) / 2e-2));
                } else {
                    acc[i].2 -= (parts[0] - parts[1]) / 2e-2;
                }
            }
            Some(acc)
        },
    )
    .unwrap()
    .iter()
    .for_each(|(which, at, err)| {
        assert!(
            err.abs() < 2e-3,
            "{} {at}: analytic minus finite difference {err}",
            if *which == 0 { "prob" } else { "x" }
        );
    });
}

/// dispatch_send then dispatch_recv lay out the same rows as dispatch;
/// calls out of that order are refused by name and change nothing.
#[test]
fn dispatch_in_two_halves_equals_dispatch_and_keeps_its_order() {
    let _s = serial();
    let case = Case::new(cfg(40, 16, 3, 8, Precision::Bf16), 2, Routing::Random, 23);
    let heap = case.config.layout(2).unwrap().heap_bytes;
    let group = format!("ep-halves-{}", std::process::id());
    run_threads("halves", 2, watchdog(), move |rank| {
        let mut w = world(&group, rank, 2, heap);
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        let mut m = HostMem::default();
        let all: Vec<PeData> = (0..2).map(|r| data(&case, r)).collect();
        let (x, ids, probs) = inputs(&mut m, &all[rank]);
        let (a, b) = (
            expert_major(&mut m, &g, false),
            expert_major(&mut m, &g, false),
        );
        let s = std::ptr::null_mut();
        // SAFETY: (every call below) the buffers above, alive for the test.
        unsafe {
            let e = g.dispatch_recv(&a, s).unwrap_err();
            assert!(e.to_string().contains("needs a dispatch_send first"), "{e}");
            g.dispatch(x, ids, probs, 40, &a, s).unwrap();
            g.dispatch_send(x, ids, probs, 40, s).unwrap();
            let e = g.dispatch_send(x, ids, probs, 40, s).unwrap_err();
            assert!(e.to_string().contains("call dispatch_recv first"), "{e}");
            let e = g.combine(a.rows, x, s).unwrap_err();
            assert!(
                e.to_string().contains("combine while a dispatch_send"),
                "{e}"
            );
            g.dispatch_recv(&b, s).unwrap();
        }
        let want = received(&case, &all, rank);
        for out in [a, b] {
            let counts: Vec<i64> = m
                .read(out.tokens_per_expert)
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(counts, want.tokens_per_expert, "PE {rank}");
        }
        let (ra, rb) = (m.read(a.rows), m.read(b.rows));
        for k in &want.kept {
            let row = 16 * 2;
            assert_eq!(
                ra[k.row * row..(k.row + 1) * row],
                rb[k.row * row..(k.row + 1) * row],
                "PE {rank}: {k:?}"
            );
        }
        // The second dispatch's combine is right too.
        round(&case, rank, &mut g, &mut m, false);
        g.destroy(&mut w).unwrap();
    });
}

/// PEs of one process read each other's `x` and experts' outputs where
/// they are: no PE returns from dispatch or combine while a peer may still
/// read them. PE 1 sends every token to PE 0's experts and writes NaN over
/// its `x` as soon as its dispatch returns, while PE 0 takes its time
/// between the two halves of its dispatch; PE 0 comes late to combine and
/// writes NaN over its experts' outputs (from the last row back) as soon
/// as its combine returns, while PE 1 sums all its tokens from them. Both
/// still get the reference's rows.
#[test]
fn no_pe_returns_while_a_peer_still_reads_its_buffers() {
    let _s = serial();
    let mut case = Case::new(
        cfg(2048, 1024, 1, 2, Precision::Bf16),
        2,
        Routing::AllToFirst,
        41,
    );
    case.sent = vec![1, 2048];
    let heap = case.config.layout(2).unwrap().heap_bytes;
    let group = format!("ep-late-reader-{}", std::process::id());
    run_threads("late reader", 2, watchdog(), move |rank| {
        let mut w = world(&group, rank, 2, heap);
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        let mut m = HostMem::default();
        let all: Vec<PeData> = (0..2).map(|r| data(&case, r)).collect();
        let (x, ids, probs) = inputs(&mut m, &all[rank]);
        let out = expert_major(&mut m, &g, false);
        let (h, n) = (case.config.hidden, case.sent[rank]);
        let row = h * 2;
        let nan = |m: &mut HostMem, b: Buf, rows: usize| {
            for r in (0..rows).rev() {
                m.write(Buf::new(b.addr + (r * row) as u64, row), &vec![0xff; row]);
            }
        };
        let s = std::ptr::null_mut();
        // SAFETY: (every call below) the buffers above, alive for the test.
        unsafe {
            if rank == 0 {
                g.dispatch_send(x, ids, probs, n, s).unwrap();
                std::thread::sleep(Duration::from_millis(200));
                g.dispatch_recv(&out, s).unwrap();
            } else {
                g.dispatch(x, ids, probs, n, &out, s).unwrap();
                nan(&mut m, x, n);
            }
        }
        let want = received(&case, &all, rank);
        let rows = m.read(out.rows);
        for k in &want.kept {
            let src = &all[k.s].x[k.t * row..(k.t + 1) * row];
            assert_eq!(
                &rows[k.row * row..(k.row + 1) * row],
                src,
                "PE {rank}: {k:?}"
            );
        }
        // The experts: x * scale(e) on every kept row.
        let expert_rows = g.layout().expert_rows;
        let eo = m.alloc(expert_rows * row);
        let mut bytes = vec![0u8; expert_rows * row];
        for k in &want.kept {
            let v = common::run::expert_out_row(&case, &all, k, rank);
            bytes[k.row * row..(k.row + 1) * row].copy_from_slice(&from_f32(Precision::Bf16, &v));
        }
        m.write(eo, &bytes);
        let y = m.alloc(n * row);
        // SAFETY: as above.
        unsafe {
            // PE 1 waits in combine for PE 0, which then sums its one
            // token at once, returns and overwrites its outputs while PE 1
            // wakes up to sum its 2048 tokens from them.
            if rank == 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            g.combine(eo, y, s).unwrap();
            if rank == 0 {
                nan(&mut m, eo, expert_rows);
            }
        }
        let (ry, mag) = combined(&case, &all, rank);
        close(
            &format!("PE {rank}: combine"),
            &to_f32(Precision::Bf16, &m.read(y)),
            &ry,
            &mag,
            Precision::Bf16,
            3.0,
        );
        g.destroy(&mut w).unwrap();
    });
}

/// PEs of one process read each other's rows where they are: a dispatch
/// and a combine leave every PE's receive rows (FP8: and scales) and
/// partial rows as they were, and still match the reference.
#[test]
fn pes_of_one_process_store_no_rows_into_each_other() {
    let _s = serial();
    for precision in [Precision::Bf16, Precision::Fp8Dispatch] {
        let case = Case::new(cfg(48, 256, 3, 9, precision), 3, Routing::Random, 51);
        let heap = case.config.layout(3).unwrap().heap_bytes;
        let group = format!("ep-no-stores-{}-{}", precision.name(), std::process::id());
        run_threads("no stores", 3, watchdog(), move |rank| {
            let mut w = world(&group, rank, 3, heap);
            let mut g = EpGroup::new(&mut w, case.config).unwrap();
            assert!(g.pulls(), "PE {rank}: threads of one process pull");
            // Host runs the steps, whatever the config asked of CUDA.
            assert_eq!(g.kernels_run(), EpKernels::Steps, "PE {rank}");
            let (c, at) = (case.config, g.layout().at);
            let base = g.send_rows().addr - at.send as u64;
            let (rows, h) = (3 * c.tokens, c.hidden);
            let parts = [
                (at.recv, rows * h * c.precision.wire_bytes()),
                (at.partial, rows * h * 2),
                (
                    at.recv_scales,
                    rows * (h / 128) * 4 * usize::from(precision == Precision::Fp8Dispatch),
                ),
            ];
            for &(off, bytes) in &parts {
                // SAFETY: the part lies in this PE's group allocation, which
                // no peer writes before the barrier below.
                unsafe { std::ptr::write_bytes((base + off as u64) as *mut u8, 0x5a, bytes) };
            }
            w.barrier_all().unwrap();
            round(&case, rank, &mut g, &mut HostMem::default(), false);
            w.barrier_all().unwrap();
            for (i, &(off, bytes)) in parts.iter().enumerate() {
                // SAFETY: as above; every PE's calls are done.
                let part =
                    unsafe { std::slice::from_raw_parts((base + off as u64) as *const u8, bytes) };
                assert!(
                    part.iter().all(|&b| b == 0x5a),
                    "PE {rank}: part {i} of the group's memory was written ({})",
                    precision.name()
                );
            }
            g.destroy(&mut w).unwrap();
        });
    }
}
