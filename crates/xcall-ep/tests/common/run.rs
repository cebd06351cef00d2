//! One PE's run of a case on any platform: memory through [`Mem`], every
//! output poisoned before the call and checked against the reference of
//! `super` after it.

use std::ffi::c_void;

use xcall_ep::{Buf, EpGroup, ExpertMajor, Precision};

use super::*;

/// A PE's memory (Host vectors, or device memory of its GPU) and its
/// stream.
pub trait Mem {
    fn alloc(&mut self, bytes: usize) -> Buf;
    fn write(&mut self, b: Buf, data: &[u8]);
    fn read(&mut self, b: Buf) -> Vec<u8>;
    fn stream(&self) -> *mut c_void;
    /// Waits for the stream.
    fn sync(&mut self);
}

/// Host memory: 16-byte aligned vectors, kept until the run ends.
#[derive(Default)]
pub struct HostMem(Vec<Vec<u128>>);

impl Mem for HostMem {
    fn alloc(&mut self, bytes: usize) -> Buf {
        let v = vec![0u128; bytes.div_ceil(16).max(1)];
        let b = Buf::new(v.as_ptr() as u64, bytes);
        self.0.push(v);
        b
    }
    fn write(&mut self, b: Buf, data: &[u8]) {
        assert!(data.len() <= b.bytes);
        // SAFETY: `b` is one of this memory's vectors, of b.bytes bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.addr as *mut u8, data.len()) };
    }
    fn read(&mut self, b: Buf) -> Vec<u8> {
        // SAFETY: as for write.
        unsafe { std::slice::from_raw_parts(b.addr as *const u8, b.bytes) }.to_vec()
    }
    fn stream(&self) -> *mut c_void {
        std::ptr::null_mut()
    }
    fn sync(&mut self) {}
}

fn bytes_i64(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// PE data's tokens, ids and probs in new buffers of `m`.
pub fn inputs(m: &mut dyn Mem, d: &PeData) -> (Buf, Buf, Buf) {
    let le = |v: Vec<[u8; 4]>| v.concat();
    let x = m.alloc(d.x.len());
    m.write(x, &d.x);
    let ids = m.alloc(d.ids.len() * 4);
    m.write(ids, &le(d.ids.iter().map(|v| v.to_le_bytes()).collect()));
    let probs = m.alloc(d.probs.len() * 4);
    m.write(
        probs,
        &le(d.probs.iter().map(|v| v.to_le_bytes()).collect()),
    );
    (x, ids, probs)
}

/// What a PE's run saw, for tests that compare platforms.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outputs {
    pub expert_rows: Vec<u8>,
    pub y: Vec<u8>,
    pub grad_x: Vec<u8>,
    pub grad_expert_out: Vec<u8>,
    pub grad_probs: Vec<f32>,
}

/// Poisons `b` with 0xFF bytes (NaN in f32 and in bf16).
fn poison(m: &mut dyn Mem, b: Buf) {
    m.write(b, &vec![0xff; b.bytes]);
}

/// The expert-major buffers of `g` in `m`.
pub fn expert_major(m: &mut dyn Mem, g: &EpGroup, bf16_too: bool) -> ExpertMajor {
    let (c, l) = (g.config(), g.layout());
    let (rows, le) = (l.expert_rows, l.local_experts);
    let fp8 = c.precision == Precision::Fp8Dispatch;
    ExpertMajor {
        rows: m.alloc(g.expert_rows_bytes()),
        scales: if fp8 {
            m.alloc(rows * c.hidden / 128 * 4)
        } else {
            Buf::NONE
        },
        rows_bf16: if fp8 && bf16_too {
            m.alloc(rows * c.hidden * 2)
        } else {
            Buf::NONE
        },
        tokens_per_expert: m.alloc(le * 8),
        padded_per_expert: m.alloc(le * 8),
        offsets: m.alloc((le + 1) * 8),
    }
}

/// One full round on PE `rank`: dispatch (outputs checked exactly), the
/// tests' experts, combine (checked within rounding), and with
/// `backward` both backward halves (checked against the reference).
/// Returns the outputs.
pub fn round(
    case: &Case,
    rank: usize,
    g: &mut EpGroup,
    m: &mut dyn Mem,
    backward: bool,
) -> Outputs {
    let c = case.config;
    let all: Vec<PeData> = (0..case.pes).map(|r| data(case, r)).collect();
    let me = &all[rank];
    let (h, k, n) = (c.hidden, c.topk, case.sent[rank]);
    let elem = case.elem();
    let x = m.alloc(n * h * elem);
    let ids = m.alloc(n * k * 4);
    let probs = m.alloc(n * k * 4);
    m.write(x, &me.x);
    m.write(
        ids,
        &me.ids
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    m.write(
        probs,
        &me.probs
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    let fp8 = c.precision == Precision::Fp8Dispatch;
    let mut out = expert_major(m, g, true);
    if fp8 && case.bf16_only {
        (out.rows, out.scales) = (Buf::NONE, Buf::NONE);
    }
    for b in [
        out.rows,
        out.scales,
        out.rows_bf16,
        out.tokens_per_expert,
        out.padded_per_expert,
        out.offsets,
    ] {
        if b.addr != 0 {
            poison(m, b);
        }
    }
    let dropped_before = g.dropped_routes().unwrap();
    // SAFETY: every buffer is this PE's, of the sizes given, and kept until
    // the stream is synchronized below.
    unsafe { g.dispatch(x, ids, probs, n, &out, m.stream()) }.unwrap();
    m.sync();
    g.check().unwrap();
    let want = received(case, &all, rank);
    let what = |s: &str| format!("PE {rank} of {}: {s} ({:?})", case.pes, case.routing);
    assert_eq!(
        i64s(&m.read(out.tokens_per_expert)),
        want.tokens_per_expert,
        "{}",
        what("tokens_per_expert")
    );
    assert_eq!(
        i64s(&m.read(out.padded_per_expert)),
        want.padded,
        "{}",
        what("padded_per_expert")
    );
    assert_eq!(
        i64s(&m.read(out.offsets)),
        want.offsets,
        "{}",
        what("offsets")
    );
    assert_eq!(
        g.dropped_routes().unwrap() - dropped_before,
        want.dropped,
        "{}",
        what("dropped routes")
    );
    // Without FP8 rows, the bf16 rows stand for them in the outputs.
    let rows = match fp8 && case.bf16_only {
        true => m.read(out.rows_bf16),
        false => m.read(out.rows),
    };
    let wire = c.precision.wire_bytes();
    let (scales, bf) = match fp8 {
        true => (
            match case.bf16_only {
                true => Vec::new(),
                false => f32s(&m.read(out.scales)),
            },
            to_f32(Precision::Bf16, &m.read(out.rows_bf16)),
        ),
        false => (Vec::new(), Vec::new()),
    };
    for kept in &want.kept {
        let src = &all[kept.s].x[kept.t * h * elem..(kept.t + 1) * h * elem];
        if fp8 {
            let (q, s) = quantize(&to_f32(Precision::Bf16, src));
            if !case.bf16_only {
                let got = &rows[kept.row * h * wire..(kept.row + 1) * h * wire];
                assert_eq!(got, &q[..], "{}", what(&format!("fp8 row of {kept:?}")));
                assert_eq!(
                    &scales[kept.row * h / 128..(kept.row + 1) * h / 128],
                    &s[..],
                    "{}",
                    what("scales")
                );
            }
            let deq: Vec<f32> = dequantize(&q, &s)
                .iter()
                .map(|v| bf16::from_f32(*v).to_f32())
                .collect();
            assert_eq!(
                &bf[kept.row * h..(kept.row + 1) * h],
                &deq[..],
                "{}",
                what("bf16 rows")
            );
        } else {
            let got = &rows[kept.row * h * wire..(kept.row + 1) * h * wire];
            assert_eq!(got, src, "{}", what(&format!("row of {kept:?}")));
        }
    }
    // The experts: x * scale(e) per kept row, into the combine type.
    let prec = if fp8 { Precision::Bf16 } else { c.precision };
    let rows_bytes = g.layout().expert_rows * h * prec.element_bytes();
    let expert_out = m.alloc(rows_bytes);
    poison(m, expert_out);
    let mut eo = m.read(expert_out);
    for kept in &want.kept {
        let v = expert_out_row(case, &all, kept, rank);
        let at = kept.row * h * prec.element_bytes();
        eo[at..at + h * prec.element_bytes()].copy_from_slice(&from_f32(prec, &v));
    }
    m.write(expert_out, &eo);
    let y = m.alloc(n * h * prec.element_bytes());
    poison(m, y);
    // SAFETY: as above.
    unsafe { g.combine(expert_out, y, m.stream()) }.unwrap();
    m.sync();
    g.check().unwrap();
    let y_bytes = m.read(y);
    let (ry, mag) = combined(case, &all, rank);
    close(
        &what("combine"),
        &to_f32(prec, &y_bytes),
        &ry,
        &mag,
        prec,
        3.0,
    );
    let mut outputs = Outputs {
        expert_rows: rows,
        y: y_bytes,
        ..Outputs::default()
    };
    if !backward {
        return outputs;
    }
    // dispatch_backward of the experts' outputs: each token's unweighted
    // sum over its kept routes.
    let grad_x = m.alloc(n * h * prec.element_bytes());
    poison(m, grad_x);
    // SAFETY: as above.
    unsafe { g.dispatch_backward(expert_out, grad_x, m.stream()) }.unwrap();
    m.sync();
    let gx = m.read(grad_x);
    let mut want_gx = vec![0f64; n * h];
    let mut mag = vec![0f64; n * h];
    for q in 0..case.pes {
        for kept in received(case, &all, q).kept.iter().filter(|r| r.s == rank) {
            let v = expert_out_row(case, &all, kept, q);
            for i in 0..h {
                want_gx[kept.t * h + i] += v[i] as f64;
                mag[kept.t * h + i] += v[i].abs() as f64;
            }
        }
    }
    close(
        &what("dispatch_backward"),
        &to_f32(prec, &gx),
        &want_gx,
        &mag,
        prec,
        3.0,
    );
    // combine_backward of a random output gradient.
    let gy: Vec<f32> = xcall_core::testing::random_f32(n * h, case.seed + 77 + rank as u64);
    let gy_buf = m.alloc(n * h * prec.element_bytes());
    m.write(gy_buf, &from_f32(prec, &gy));
    let gy = to_f32(prec, &from_f32(prec, &gy));
    let geo = m.alloc(rows_bytes);
    let gp = m.alloc(n * k * 4);
    poison(m, geo);
    poison(m, gp);
    // SAFETY: as above.
    unsafe { g.combine_backward(gy_buf, expert_out, geo, gp, m.stream()) }.unwrap();
    m.sync();
    g.check().unwrap();
    let geo_bytes = m.read(geo);
    let geo_f = to_f32(prec, &geo_bytes);
    let gp_f = f32s(&m.read(gp));
    // This PE's kept rows: prob times the sender's gradient, rounded once.
    for kept in &want.kept {
        let sgy: Vec<f32> =
            xcall_core::testing::random_f32(case.sent[kept.s] * h, case.seed + 77 + kept.s as u64);
        let sgy = to_f32(prec, &from_f32(prec, &sgy));
        let p = all[kept.s].probs[kept.t * k + kept.j];
        let want_row: Vec<f32> = (0..h).map(|i| p * sgy[kept.t * h + i]).collect();
        let want_row = to_f32(prec, &from_f32(prec, &want_row));
        assert_eq!(
            &geo_f[kept.row * h..(kept.row + 1) * h],
            &want_row[..],
            "{}",
            what("grad_expert_out")
        );
    }
    // This PE's probs' gradient: the dot product where the route was kept.
    let mut want_gp = vec![0f64; n * k];
    let mut mag_gp = vec![0f64; n * k];
    for q in 0..case.pes {
        for kept in received(case, &all, q).kept.iter().filter(|r| r.s == rank) {
            let v = expert_out_row(case, &all, kept, q);
            for i in 0..h {
                want_gp[kept.t * k + kept.j] += v[i] as f64 * gy[kept.t * h + i] as f64;
                mag_gp[kept.t * k + kept.j] += (v[i] as f64 * gy[kept.t * h + i] as f64).abs();
            }
        }
    }
    close(
        &what("grad_probs"),
        &gp_f,
        &want_gp,
        &mag_gp,
        Precision::F32,
        64.0,
    );
    outputs.grad_x = gx;
    outputs.grad_expert_out = geo_bytes;
    outputs.grad_probs = gp_f;
    outputs
}

/// [`super::expert_out`], by another name here (the tests' experts).
pub fn expert_out_row(case: &Case, all: &[PeData], kept: &Kept, q: usize) -> Vec<f32> {
    expert_out(case, all, kept, q)
}

/// `times` rounds of `case` on PE `rank` (with their backward halves),
/// each with the next seed, every one checked by [`round`].
pub fn rounds(case: &Case, rank: usize, g: &mut EpGroup, m: &mut dyn Mem, times: u64) {
    for r in 0..times {
        let c = Case {
            seed: case.seed + r,
            ..case.clone()
        };
        round(&c, rank, g, m, true);
    }
}
