//! A dispatch's routing saved, another dispatch made, the first put back:
//! combine and the backward calls then follow the first dispatch (Host
//! PEs as threads, checked against plain loops over the routes).

use std::time::Duration;

use xcall_core::testing::{run_threads, watchdog, XorShift};
use xcall_core::{Device, Platform, Status};
use xcall_ep::{Buf, EpConfig, EpGroup, ExpertMajor, Precision};
use xcall_shmem::{World, WorldConfig};

const T: usize = 24;
const H: usize = 8;
const K: usize = 2;
const E: usize = 8;

fn buf(v: &mut [u8]) -> Buf {
    Buf::new(v.as_mut_ptr() as u64, v.len())
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// One PE's tokens and top-k routing for `seed` (distinct experts).
fn inputs(seed: u64, rank: usize) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let mut r = XorShift::new(seed * 31 + rank as u64);
    let x: Vec<f32> = (0..T * H).map(|_| r.next_f32()).collect();
    let mut ids = Vec::new();
    let mut probs = Vec::new();
    for _ in 0..T {
        let a = (r.next_u64() % E as u64) as i32;
        let b = (a + 1 + (r.next_u64() % (E as u64 - 1)) as i32) % E as i32;
        ids.extend([a, b]);
        probs.extend([0.25 + r.next_f32().abs() / 2.0, 0.5]);
    }
    (x, ids, probs)
}

/// y[t] = sum_k p_k * scale(e_k) * x[t], with expert e scaling by e + 1.
fn reference(x: &[f32], ids: &[i32], probs: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; T * H];
    for t in 0..T {
        for s in 0..K {
            let w = probs[t * K + s] as f64 * (ids[t * K + s] + 1) as f64;
            for j in 0..H {
                y[t * H + j] += (w * x[t * H + j] as f64) as f32;
            }
        }
    }
    y
}

/// Each received row times its expert's scale: the experts' outputs.
fn experts(rows: &[u8], tpe: &[i64], rank: usize) -> Vec<u8> {
    let mut out = floats(rows);
    let local = E / 2;
    let mut row = 0;
    for (l, &n) in tpe.iter().enumerate() {
        let scale = (rank * local + l + 1) as f32;
        for r in row..row + n as usize {
            for v in &mut out[r * H..(r + 1) * H] {
                *v *= scale;
            }
        }
        row += n as usize;
    }
    f32s(&out)
}

fn close(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn a_restored_routing_makes_combine_and_backward_follow_its_dispatch() {
    let name = format!("ep-saved-{}", std::process::id());
    run_threads("saved routing", 2, watchdog(), move |rank| {
        let config = EpConfig {
            precision: Precision::F32,
            ..EpConfig::new(T, H, K, E)
        };
        let layout = config.layout(2).unwrap();
        let mut wc =
            WorldConfig::in_process(&name, rank, 2, Device::new(Platform::Host, rank as u32));
        wc.heap_bytes = Some(layout.heap_bytes + (1 << 20));
        wc.timeout = Duration::from_secs(20);
        let mut w = World::new();
        w.init(&wc).unwrap();
        let mut g = EpGroup::new(&mut w, config).unwrap();
        let null = std::ptr::null_mut();
        let rows_bytes = layout.expert_rows * H * 4;
        let mut saved = vec![0u8; g.routing_bytes() + 16];
        let at = saved.as_ptr().align_offset(16);
        let saved = Buf::new(saved.as_mut_ptr() as u64 + at as u64, g.routing_bytes());

        // Nothing dispatched yet: nothing to save.
        // SAFETY: `saved` holds routing_bytes.
        let e = unsafe { g.save_routing(saved, null) }.unwrap_err();
        assert_eq!(e.status(), Status::InvalidState, "{e}");

        let dispatch = |seed: u64, n: usize, g: &mut EpGroup| {
            let (x, ids, probs) = inputs(seed, rank);
            let (mut xb, mut ib, mut pb) = (
                f32s(&x),
                ids.iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
                f32s(&probs),
            );
            let mut rows = vec![0u8; rows_bytes];
            let mut tpe = vec![0u8; layout.local_experts * 8];
            let out = ExpertMajor {
                rows: buf(&mut rows),
                tokens_per_expert: buf(&mut tpe),
                ..ExpertMajor::default()
            };
            // SAFETY: host buffers of the sizes given, alive for the call.
            unsafe { g.dispatch(buf(&mut xb), buf(&mut ib), buf(&mut pb), n, &out, null) }.unwrap();
            let tpe: Vec<i64> = tpe
                .chunks(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (x, ids, probs, rows, tpe)
        };

        let (xa, ida, pa, rows_a, tpe_a) = dispatch(1, T, &mut g);
        // SAFETY: as above.
        unsafe { g.save_routing(saved, null) }.unwrap();
        let (xb, idb, pb, rows_b, tpe_b) = dispatch(2, T - 5, &mut g);
        assert_ne!(ida, idb, "the two routings differ");

        let mut y = vec![0u8; T * H * 4];
        let mut out_b = experts(&rows_b, &tpe_b, rank);
        // SAFETY: as above.
        unsafe { g.combine(buf(&mut out_b), buf(&mut y), null) }.unwrap();
        // It sent T - 5 tokens: the first T - 5 rows are its.
        close(
            &floats(&y)[..(T - 5) * H],
            &reference(&xb, &idb, &pb)[..(T - 5) * H],
            "y of the second dispatch",
        );

        // Back to the first dispatch's routing: its combine is right.
        // SAFETY: `saved` holds what save_routing wrote.
        unsafe { g.restore_routing(saved, T, null) }.unwrap();
        let mut out_a = experts(&rows_a, &tpe_a, rank);
        // SAFETY: as above.
        unsafe { g.combine(buf(&mut out_a), buf(&mut y), null) }.unwrap();
        close(
            &floats(&y),
            &reference(&xa, &ida, &pa),
            "y of the restored dispatch",
        );

        // Its backward calls too: dispatch_backward of the expert rows
        // gives each token k times itself (every route kept).
        let mut gx = vec![0u8; T * H * 4];
        let mut rows = rows_a.clone();
        // SAFETY: as above.
        unsafe { g.dispatch_backward(buf(&mut rows), buf(&mut gx), null) }.unwrap();
        let want: Vec<f32> = xa.iter().map(|v| K as f32 * v).collect();
        close(&floats(&gx), &want, "grad_x of the restored dispatch");
        // combine_backward: each route's probs' gradient is its expert's
        // output row dotted with grad_y (here x itself).
        let (mut gy, mut geo, mut gp) = (f32s(&xa), vec![0u8; rows_bytes], vec![0u8; T * K * 4]);
        // SAFETY: as above.
        unsafe {
            g.combine_backward(
                buf(&mut gy),
                buf(&mut out_a),
                buf(&mut geo),
                buf(&mut gp),
                null,
            )
        }
        .unwrap();
        let gp = floats(&gp);
        for t in 0..T {
            let norm: f32 = xa[t * H..(t + 1) * H].iter().map(|v| v * v).sum();
            for s in 0..K {
                let want = norm * (ida[t * K + s] + 1) as f32;
                let got = gp[t * K + s];
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "grad_probs[{t},{s}]: {got} vs {want}"
                );
            }
        }

        // While a dispatch_send waits for its dispatch_recv, nothing is
        // saved, put back or fenced.
        let (x, ids, probs) = inputs(3, rank);
        let (mut xb, mut pb) = (f32s(&x), f32s(&probs));
        let mut ib: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        // SAFETY: host buffers of the sizes given, alive until dispatch_recv.
        unsafe { g.dispatch_send(buf(&mut xb), buf(&mut ib), buf(&mut pb), T, null) }.unwrap();
        // SAFETY: each is refused before touching memory.
        let refused = unsafe {
            [
                g.save_routing(saved, null),
                g.restore_routing(saved, T, null),
                g.phase_barrier(null),
            ]
        };
        for e in refused {
            assert_eq!(e.unwrap_err().status(), Status::InvalidState);
        }
        let (mut rows, mut tpe) = (vec![0u8; rows_bytes], vec![0u8; layout.local_experts * 8]);
        let out = ExpertMajor {
            rows: buf(&mut rows),
            tokens_per_expert: buf(&mut tpe),
            ..ExpertMajor::default()
        };
        // SAFETY: as above.
        unsafe { g.dispatch_recv(&out, null) }.unwrap();

        // A buffer too small is refused before the barrier.
        let small = Buf::new(saved.addr, saved.bytes - 1);
        // SAFETY: refused before any access.
        let e = unsafe { g.restore_routing(small, T, null) }.unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
        // SAFETY: as above.
        let e = unsafe { g.restore_routing(saved, T + 1, null) }.unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
        g.destroy(&mut w).unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}
