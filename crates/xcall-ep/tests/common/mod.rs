//! Shared by the Host and CUDA tests: the data of a case, drawn per PE
//! from a seed, and the reference, written as plain loops in f64 over
//! (token, slot) routes, independently of the library's tiles, scans and
//! phases.

#![allow(dead_code)]

pub mod cuda;
pub mod run;
pub mod threads;

use half::bf16;
use xcall_core::testing::XorShift;
use xcall_core::{fp8_decode, fp8_encode, Fp8};
use xcall_ep::{Capacity, EpConfig, Precision};

/// How the tokens are routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// k distinct experts drawn uniformly.
    Random,
    /// Every token to experts of PE `0` only (k <= L).
    AllToFirst,
    /// Each token's k experts all on one PE (its token index mod P).
    OnePe,
    /// Random, with every third slot -1 (no route).
    Holes,
}

/// A case: the group's config, the PEs, how many tokens each sends, and
/// the routing.
#[derive(Clone, Debug)]
pub struct Case {
    pub config: EpConfig,
    pub pes: usize,
    pub sent: Vec<usize>,
    pub routing: Routing,
    pub seed: u64,
    /// FP8 groups: dispatch writes the bf16 rows alone (no FP8 rows, no
    /// scales).
    pub bf16_only: bool,
}

impl Case {
    pub fn new(config: EpConfig, pes: usize, routing: Routing, seed: u64) -> Case {
        Case {
            config,
            pes,
            sent: vec![config.tokens; pes],
            routing,
            seed,
            bf16_only: false,
        }
    }

    pub fn local(&self) -> usize {
        self.config.experts / self.pes
    }

    /// Bytes of an element as the caller hands tokens in.
    pub fn elem(&self) -> usize {
        self.config.precision.element_bytes()
    }
}

/// A config of these sizes in `precision`, the rest as `EpConfig::new`.
pub fn cfg(
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    precision: Precision,
) -> EpConfig {
    EpConfig {
        precision,
        ..EpConfig::new(tokens, hidden, topk, experts)
    }
}

/// One PE's inputs.
#[derive(Clone, Debug)]
pub struct PeData {
    /// `[n, H]` in the precision's element type.
    pub x: Vec<u8>,
    pub ids: Vec<i32>,
    pub probs: Vec<f32>,
}

/// The expert function the tests apply between dispatch and combine:
/// `x * scale(e)` for global expert `e`.
pub fn scale(e: usize) -> f32 {
    0.5 + (e % 7) as f32 * 0.25
}

pub fn to_f32(precision: Precision, bytes: &[u8]) -> Vec<f32> {
    match precision {
        Precision::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

pub fn from_f32(precision: Precision, v: &[f32]) -> Vec<u8> {
    match precision {
        Precision::F32 => v.iter().flat_map(|f| f.to_le_bytes()).collect(),
        _ => v
            .iter()
            .flat_map(|f| bf16::from_f32(*f).to_le_bytes())
            .collect(),
    }
}

/// PE `rank`'s inputs of `case`.
pub fn data(case: &Case, rank: usize) -> PeData {
    let c = &case.config;
    let n = case.sent[rank];
    let mut rng = XorShift::new(case.seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let x: Vec<f32> = (0..n * c.hidden).map(|_| rng.next_f32() * 2.0).collect();
    let (l, p) = (case.local(), case.pes);
    let mut ids = Vec::with_capacity(n * c.topk);
    for t in 0..n {
        let mut chosen: Vec<i32> = Vec::new();
        while chosen.len() < c.topk {
            let e = match case.routing {
                Routing::Random | Routing::Holes => rng.next_u64() as usize % c.experts,
                Routing::AllToFirst => rng.next_u64() as usize % l,
                Routing::OnePe => (t % p) * l + rng.next_u64() as usize % l,
            } as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        if case.routing == Routing::Holes {
            for (j, e) in chosen.iter_mut().enumerate() {
                if (t + j) % 3 == 0 {
                    *e = -1;
                }
            }
        }
        ids.extend(chosen);
    }
    let probs = (0..n * c.topk)
        .map(|_| (rng.next_f32() + 1.0) * 0.45 + 0.05)
        .collect();
    PeData {
        x: from_f32(c.precision, &x),
        ids,
        probs,
    }
}

/// A route PE `q` keeps: sender, token, slot, local expert, row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kept {
    pub s: usize,
    pub t: usize,
    pub j: usize,
    pub l: usize,
    pub row: usize,
}

/// What PE `q` receives: its kept routes, counts, padded counts, offsets,
/// and the routes its capacity dropped.
#[derive(Clone, Debug)]
pub struct Received {
    pub kept: Vec<Kept>,
    pub tokens_per_expert: Vec<i64>,
    pub padded: Vec<i64>,
    pub offsets: Vec<i64>,
    pub dropped: u64,
}

/// PE `q`'s receipt, by plain loops: for each local expert, the routes to
/// it in (sender, token) order, the first `capacity` kept.
pub fn received(case: &Case, all: &[PeData], q: usize) -> Received {
    let c = &case.config;
    let l = case.local();
    let mut per: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new(); l];
    for (s, d) in all.iter().enumerate() {
        for t in 0..case.sent[s] {
            for j in 0..c.topk {
                let e = d.ids[t * c.topk + j];
                if e >= 0 && e as usize / l == q {
                    per[e as usize % l].push((s, t, j));
                }
            }
        }
    }
    let cap = match c.capacity {
        Capacity::Dropless => usize::MAX,
        Capacity::PerExpert(n) => n,
    };
    let (mut kept, mut tpe, mut padded, mut offsets, mut dropped) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0u64);
    let mut next = 0usize;
    for (e, routes) in per.iter().enumerate() {
        let k = routes.len().min(cap);
        dropped += (routes.len() - k) as u64;
        offsets.push(next as i64);
        for (i, &(s, t, j)) in routes.iter().take(k).enumerate() {
            kept.push(Kept {
                s,
                t,
                j,
                l: e,
                row: next + i,
            });
        }
        tpe.push(k as i64);
        let pad = k.div_ceil(c.align) * c.align;
        padded.push(pad as i64);
        next += pad;
    }
    offsets.push(next as i64);
    Received {
        kept,
        tokens_per_expert: tpe,
        padded,
        offsets,
        dropped,
    }
}

/// The FP8 quantization of one bf16 row, written independently: per block
/// of 128, scale = amax / 448 (1 for an all-zero block), value / scale
/// rounded to e4m3.
pub fn quantize(row: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut q = Vec::new();
    let mut scales = Vec::new();
    for block in row.chunks(128) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        scales.push(s);
        q.extend(block.iter().map(|v| fp8_encode(Fp8::E4M3, v / s)));
    }
    (q, scales)
}

pub fn dequantize(q: &[u8], scales: &[f32]) -> Vec<f32> {
    q.iter()
        .enumerate()
        .map(|(i, b)| fp8_decode(Fp8::E4M3, *b) * scales[i / 128])
        .collect()
}

/// The expert rows PE `q` should hold (as f32), each row the sender's
/// token (FP8: quantized and back).
pub fn expert_row(case: &Case, all: &[PeData], k: &Kept) -> Vec<f32> {
    let h = case.config.hidden;
    let x = to_f32(
        case.config.precision,
        &all[k.s].x[k.t * h * case.elem()..(k.t + 1) * h * case.elem()],
    );
    match case.config.precision {
        Precision::Fp8Dispatch => {
            let (q, s) = quantize(&x);
            dequantize(&q, &s)
        }
        _ => x,
    }
}

/// The experts' output row of a kept route, as the tests' experts compute
/// it (in f32, rounded to the element type).
pub fn expert_out(case: &Case, all: &[PeData], k: &Kept, q: usize) -> Vec<f32> {
    let e = q * case.local() + k.l;
    let v: Vec<f32> = expert_row(case, all, k)
        .iter()
        .map(|x| x * scale(e))
        .collect();
    to_f32(case.config.precision, &from_f32(case.config.precision, &v))
}

/// Combine's reference for sender `s`: each token's sum over kept routes
/// of prob times the expert's output, in f64, and the sum of the terms'
/// magnitudes (for the tolerance).
pub fn combined(case: &Case, all: &[PeData], s: usize) -> (Vec<f64>, Vec<f64>) {
    let (h, k) = (case.config.hidden, case.config.topk);
    let n = case.sent[s];
    let mut y = vec![0f64; n * h];
    let mut mag = vec![0f64; n * h];
    for q in 0..case.pes {
        for kept in received(case, all, q).kept.iter().filter(|r| r.s == s) {
            let p = all[s].probs[kept.t * k + kept.j] as f64;
            let out = expert_out(case, all, kept, q);
            for i in 0..h {
                y[kept.t * h + i] += p * out[i] as f64;
                mag[kept.t * h + i] += (p * out[i] as f64).abs();
            }
        }
    }
    (y, mag)
}

/// Relative rounding of the element type.
pub fn eps(precision: Precision) -> f64 {
    match precision {
        Precision::F32 => 1.0 / (1u64 << 23) as f64,
        _ => 1.0 / 256.0,
    }
}

/// Checks `got` against `want` within `ulps` roundings of the element
/// type relative to `mag`; names the first element off.
pub fn close(what: &str, got: &[f32], want: &[f64], mag: &[f64], precision: Precision, ulps: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for i in 0..got.len() {
        let tol = ulps * eps(precision) * mag[i].max(want[i].abs()) + 1e-6;
        assert!(
            (got[i] as f64 - want[i]).abs() <= tol,
            "{what}: element {i}: {} vs reference {} (tolerance {tol})",
            got[i],
            want[i]
        );
    }
}

/// Tests that start worlds run one at a time: a device (Host slot or GPU)
/// holds one PE of one live world.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The test binary run again as one PE: only its `pe_process` test, with
/// `env` set to `spec`.
pub fn spawn_pe(env: &str, spec: String) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "pe_process", "--nocapture", "--test-threads=1"])
        .env(env, spec)
        .spawn()
        .unwrap()
}

/// A Unix socket path named `name`, unique to this process.
pub fn socket_path(name: &str) -> String {
    std::env::temp_dir()
        .join(format!("xcall-ep-{name}-{}.sock", std::process::id()))
        .to_string_lossy()
        .into_owned()
}
