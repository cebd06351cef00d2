//! What the memory system gives permute's row writes, with xcall's kernels
//! out of the picture: one plain kernel (a warp per token, 16-byte vectors,
//! a token's row loaded into registers a few vectors per lane at a time and
//! stored to each of its routes with evict-first stores) run over the same
//! random top-k routes in several layouts and launch shapes, beside a copy
//! and a memset of the same bytes in the same run:
//!
//! - `expert-major`: the rows where permute puts them (each expert's rows
//!   together, in token order);
//! - `token-major`: row `t * topK + k` (a token's routes side by side), the
//!   same kernel and bytes with the writes in order;
//! - `write-only`: a constant stored instead of the row (no row reads);
//! - `S slices`: a warp per slice of a token's row (T x S warps' worth of
//!   work instead of T), `U vectors` per lane at a time, `loaded ahead`:
//!   the next U loaded before the current U are stored;
//! - `+ probs`: each route's prob copied too, as permute does;
//! - `G groups`: each block serves the routes of one of G expert groups,
//!   so a block writes into E / G experts' regions instead of all E (a
//!   token's row is read once per group it routes to);
//! - `bulk loads`: a row, or each of S slices of it, lands in shared memory
//!   through `cp.async.bulk` (sm_90+), 4 or 8 stages in flight per block,
//!   and leaves through one bulk store per route (`bulk stores`) or the
//!   block's 8 warps' 16-byte stores.
//!
//! Before anything is timed, every layout's output is checked against the
//! Host's (four vectors of every route's row) and its probs in full. Prints one table per shape:
//! CUDA-event medians of interleaved rounds, GB/s with permute's byte model
//! (rows read once, written once per route; write-only: the writes) and
//! the ratio to the faster of the driver's and a kernel's copy of [N, H].

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use xcall_core::cuda::device::{BULK_COPY, MBARRIER};
use xcall_core::cuda::{self as cuda, RawStream, Stream};
use xcall_core::testing::{interleaved_medians, XorShift};
use xcall_core::Device;

const ROUNDS: usize = 20;

const SOURCE: &str = r#"
typedef long long i64;
// A warp per token (grid-stride over tokens); block b serves expert group
// b % groups (gridDim.x is a multiple of groups). Lane k < K holds route
// k's destination row and expert. dst == 0: destination t * K + k.
template <int U>
__device__ __forceinline__ void load(uint4 (&r)[U], const uint4* src, i64 base, i64 end, i64 t, int read) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const i64 i = base + 32 * u;
        r[u] = make_uint4((unsigned)i, (unsigned)t, 1u, 2u);
        if (read && i < end) r[u] = src[i];
    }
}
// U vectors per lane at a time; PF: the next U are loaded before the
// current ones are stored.
template <int U, bool PF>
__device__ void rows_body(const uint4* __restrict__ in, uint4* __restrict__ out, const int* __restrict__ dst,
                          const int* __restrict__ ex, int T, int K, i64 nv, int read, int groups, int gsize,
                          int slices, const float* __restrict__ probs, float* __restrict__ pprobs, int E) {
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int grp = blockIdx.x % groups;
    const i64 step = (i64)(gridDim.x / groups) * wpb;
    for (i64 item = (i64)(blockIdx.x / groups) * wpb + warp; item < (i64)T * slices; item += step) {
        const i64 t = item / slices;
        const int sl = (int)(item % slices);
        int my_d = -1;
        if (lane < K) {
            const int e = ex[t * K + lane];
            if (e / gsize == grp) my_d = dst ? dst[t * K + lane] : (int)(t * K + lane);
            if (pprobs && my_d >= 0 && sl == 0) pprobs[my_d] = probs[t * E + e];
        }
        const uint4* src = in + t * nv;
        const i64 end = nv * (sl + 1) / slices;
        uint4 cur[U], nxt[U];
        i64 base = nv * sl / slices + lane;
        if (PF) load<U>(cur, src, base, end, t, read);
        for (; base < end; base += 32 * U) {
            if (PF) load<U>(nxt, src, base + 32 * U, end, t, read);
            else load<U>(cur, src, base, end, t, read);
            for (int k = 0; k < K; ++k) {
                const int d = __shfl_sync(0xffffffffu, my_d, k);
                if (d < 0) continue;
                uint4* o = out + (i64)d * nv;
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (base + 32 * u < end) __stcs(o + base + 32 * u, cur[u]);
            }
            if (PF) {
#pragma unroll
                for (int u = 0; u < U; ++u) cur[u] = nxt[u];
            }
        }
    }
}
#define ROWS(U, PF)                                                                                       \
    extern "C" __global__ void rows_##U##_##PF(const uint4* in, uint4* out, const int* dst, const int* ex, \
                                               int T, int K, i64 nv, int read, int groups, int gsize,      \
                                               int slices, const float* probs, float* pprobs, int E) {     \
        rows_body<U, PF>(in, out, dst, ex, T, K, nv, read, groups, gsize, slices, probs, pprobs, E);      \
    }
ROWS(2, 0)
ROWS(4, 0)
ROWS(8, 0)
ROWS(2, 1)
ROWS(4, 1)
"#;

/// The bulk-copy (TMA) kernel, compiled for the device's own architecture
/// (`cp.async.bulk` needs sm_90): rows land in shared memory through bulk
/// loads, `stages` of them in flight per block, and leave either through
/// bulk stores (`mode` 0, one thread issues everything) or through every
/// thread's 16-byte evict-first stores from shared memory (`mode` 1).
/// Compiled after core's mbarrier and bulk-copy helpers
/// (`xcall_core::cuda::device`).
const TMA_SOURCE: &str = r#"
typedef long long i64;
// Block b serves items b, b + gridDim.x, ... (item: a slice of a token's
// row, `slices` per row); its j-th item sits in stage j % stages (at most
// 8). When an item's piece is loaded, warp 0's lanes k < K also fetch its
// routes' destinations (and probs) into the stage's slots, so that no
// iteration waits on a map read. Thread 0 issues every bulk copy.
extern "C" __global__ void tma_rows(const char* __restrict__ in, char* __restrict__ out, const int* __restrict__ dst,
                                    const int* __restrict__ ex, int T, int K, i64 row, int stages,
                                    const float* __restrict__ probs, float* __restrict__ pprobs, int E, int mode,
                                    int slices) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bars = (unsigned long long*)smem;
    unsigned char* buf = smem + 128;
    __shared__ int rows[8][32];
    __shared__ float pv[8][32];
    const int tid = threadIdx.x;
    const i64 piece = row / slices, items = (i64)T * slices;
    const int mine = (int)blockIdx.x < items ? (int)((items - 1 - blockIdx.x) / gridDim.x + 1) : 0;
    auto item = [&](int j) { return (i64)blockIdx.x + (i64)j * gridDim.x; };
    // Warp 0: stage s takes item j (destinations, probs, then the piece).
    auto fill = [&](int s, int j) {
        const i64 it = item(j), t = it / slices;
        if (tid < K) {
            const int d = dst ? dst[t * K + tid] : (int)(t * K + tid);
            rows[s][tid] = d;
            if (pprobs && it % slices == 0) pv[s][tid] = probs[t * E + ex[t * K + tid]];
        }
        if (tid == 0) {
            const u32 bar = smem_addr(&bars[s]);
            fence_proxy_async();
            bulk_load_arrive(smem_addr(buf + s * piece), in + t * row + (it % slices) * piece, (u32)piece, bar);
        }
    };
    if (tid == 0) {
        for (int s = 0; s < stages; ++s) mbar_init(smem_addr(&bars[s]), 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (tid < 32)
        for (int j = 0; j < stages && j < mine; ++j) fill(j, j);
    __syncthreads();
    for (int j = 0; j < mine; ++j) {
        const int s = j % stages;
        const i64 it = item(j);
        const i64 off = (it % slices) * piece;
        mbar_wait(smem_addr(&bars[s]), (u32)(j / stages) & 1u);
        if (tid < K && pprobs && it % slices == 0) pprobs[rows[s][tid]] = pv[s][tid];
        if (mode == 0) {
            if (tid < 32) {
                __syncwarp();
                if (tid == 0) {
                    for (int k = 0; k < K; ++k) bulk_store(out + (i64)rows[s][k] * row + off, smem_addr(buf + s * piece), (u32)piece);
                    bulk_commit();
                    // Item j - 1's stores have read its stage: refill it.
                    bulk_wait_read<1>();
                }
                __syncwarp();
                if (j >= 1 && j - 1 + stages < mine) fill((j - 1) % stages, j - 1 + stages);
            }
        } else {
            const uint4* src = (const uint4*)(buf + s * piece);
            const i64 nv = piece / 16;
            for (int k = 0; k < K; ++k) {
                uint4* o = (uint4*)(out + (i64)rows[s][k] * row + off);
                for (i64 i = tid; i < nv; i += blockDim.x) __stcs(o + i, src[i]);
            }
            __syncthreads();  // stage s read by all
            if (tid < 32 && j + stages < mine) fill(s, j + stages);
        }
    }
    if (tid == 0) bulk_wait<0>();
}
"#;

/// The bulk-copy kernel and its launch shape.
struct Tma {
    func: CudaFunction,
    multiprocessors: u32,
}

impl Tma {
    /// Shared memory a block of `stages` rows of `row` bytes takes.
    fn smem(row: usize, stages: usize) -> usize {
        128 + stages * row
    }

    /// # Safety
    /// As [`Rows::enqueue`]; `l.nv * 16 * stages + 128` bytes of shared
    /// memory fit a block (set with [`Tma::allow`]).
    unsafe fn enqueue(&self, l: Launch, stream: RawStream) {
        let (stages, mode, threads, slices) = l.tma.unwrap();
        let row = l.nv as usize * 16;
        let smem = Self::smem(row / slices as usize, stages);
        let per_sm = (227 * 1024 / (smem + 3 * 1024))
            .min(2048 / threads as usize)
            .clamp(1, 32) as u32;
        let (mut input, mut out, mut dst, mut ex) = (l.input, l.out, l.dst, l.ex);
        let (mut t, mut k, mut rowb, mut st) = (l.t, l.k, row as i64, stages as i32);
        let (mut probs, mut pprobs, mut e, mut mode) = (l.probs, l.pprobs, l.e, mode);
        let mut slices = slices;
        let mut params: [*mut c_void; 13] = [
            (&mut input as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
            (&mut dst as *mut u64).cast(),
            (&mut ex as *mut u64).cast(),
            (&mut t as *mut i32).cast(),
            (&mut k as *mut i32).cast(),
            (&mut rowb as *mut i64).cast(),
            (&mut st as *mut i32).cast(),
            (&mut probs as *mut u64).cast(),
            (&mut pprobs as *mut u64).cast(),
            (&mut e as *mut i32).cast(),
            (&mut mode as *mut i32).cast(),
            (&mut slices as *mut i32).cast(),
        ];
        let blocks = (self.multiprocessors * per_sm).min(l.t as u32 * slices as u32);
        // SAFETY: the kernel's thirteen parameters in order, each pointing at
        // a live local; the caller vouches for the buffers, the shared
        // memory and the stream.
        unsafe {
            common::launch_smem(
                &self.func,
                blocks,
                threads,
                smem as u32,
                &mut params,
                stream,
            )
        };
    }

    /// Lets a block take the shared memory of `stages` rows of `row` bytes.
    fn allow(&self, row: usize, stages: usize) {
        cuda::set_max_dynamic_shared(Device::cuda(0), &self.func, Self::smem(row, stages) as u32)
            .unwrap();
    }
}

/// The kernels, by (U, PF) of `rows_U_PF`, and the grid they run on.
struct Rows {
    funcs: Vec<((u32, u32), CudaFunction)>,
    blocks: u32,
}

#[derive(Clone, Copy)]
struct Launch {
    input: u64,
    out: u64,
    dst: u64,
    ex: u64,
    t: i32,
    k: i32,
    nv: i64,
    read: i32,
    groups: i32,
    gsize: i32,
    slices: i32,
    probs: u64,
    pprobs: u64,
    e: i32,
    /// `rows_U_PF`: vectors per lane at a time, next ones loaded ahead.
    func: (u32, u32),
    /// The bulk-copy kernel instead: (stages, mode, threads per block,
    /// slices per row).
    tma: Option<(usize, i32, u32, i32)>,
}

impl Rows {
    /// Enqueues `l` on the kernel it names.
    ///
    /// # Safety
    /// As [`Rows::enqueue`].
    unsafe fn run(&self, tma: Option<&Tma>, l: Launch, stream: RawStream) {
        match l.tma {
            // SAFETY: the caller's contract; `allow` ran for this shape.
            Some(_) => unsafe { tma.unwrap().enqueue(l, stream) },
            // SAFETY: the caller's contract.
            None => unsafe { self.enqueue(l, stream) },
        }
    }

    /// # Safety
    /// Every pointer of `l` is a live device allocation of the stream's
    /// context large enough for `l`'s shape.
    unsafe fn enqueue(&self, l: Launch, stream: RawStream) {
        let mut l = l;
        let blocks = self.blocks / l.groups as u32 * l.groups as u32;
        let func = &self.funcs.iter().find(|(f, _)| *f == l.func).unwrap().1;
        let mut params: [*mut c_void; 14] = [
            (&mut l.input as *mut u64).cast(),
            (&mut l.out as *mut u64).cast(),
            (&mut l.dst as *mut u64).cast(),
            (&mut l.ex as *mut u64).cast(),
            (&mut l.t as *mut i32).cast(),
            (&mut l.k as *mut i32).cast(),
            (&mut l.nv as *mut i64).cast(),
            (&mut l.read as *mut i32).cast(),
            (&mut l.groups as *mut i32).cast(),
            (&mut l.gsize as *mut i32).cast(),
            (&mut l.slices as *mut i32).cast(),
            (&mut l.probs as *mut u64).cast(),
            (&mut l.pprobs as *mut u64).cast(),
            (&mut l.e as *mut i32).cast(),
        ];
        // SAFETY: the kernel's fourteen parameters in order, each pointing
        // at a live local; the caller vouches for the buffers and the
        // stream.
        unsafe { common::launch(func, blocks, 256, &mut params, stream) };
    }
}

/// Routes of a random top-k routing: expert of (t, k) and its expert-major
/// row (each expert's rows together, tokens in order within an expert).
fn routes(t: usize, e: usize, k: usize, seed: u64) -> (Vec<i32>, Vec<i32>) {
    let routing = XorShift::new(seed).top_k_routing(t, e, k);
    let ex: Vec<i32> = routing
        .chunks(e)
        .flat_map(|row| (0..e).filter(|&x| row[x] != 0).map(|x| x as i32))
        .collect();
    let mut counts = vec![0usize; e];
    for &x in &ex {
        counts[x as usize] += 1;
    }
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0, |acc, &c| {
            let at = *acc;
            *acc += c;
            Some(at)
        })
        .collect();
    let dst = ex
        .iter()
        .map(|&x| {
            let d = next[x as usize];
            next[x as usize] += 1;
            d as i32
        })
        .collect();
    (ex, dst)
}

fn ptr<T>(stream: &Arc<CudaStream>, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(stream).0
}

/// Checks `out` against the rows the layout puts there: for each route, a
/// sample of 16-byte vectors equals the input's (`read`) or the kernel's
/// constant.
#[allow(clippy::too_many_arguments)]
fn check(
    stream: &Arc<CudaStream>,
    input: &[u8],
    out: &CudaSlice<u8>,
    dst: Option<&[i32]>,
    t: usize,
    k: usize,
    nv: usize,
    read: bool,
    what: &str,
) {
    let got: Vec<u8> = stream.clone_dtoh(out).unwrap();
    let row = nv * 16;
    for tok in 0..t {
        for r in 0..k {
            let d = dst.map_or(tok * k + r, |d| d[tok * k + r] as usize);
            for v in [0, nv / 2, nv - 1, (tok * 7 + r) % nv] {
                let at = d * row + v * 16;
                let want: Vec<u8> = if read {
                    input[tok * row + v * 16..][..16].to_vec()
                } else {
                    [v as u32, tok as u32, 1, 2]
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect()
                };
                assert_eq!(
                    &got[at..at + 16],
                    &want[..],
                    "{what}: token {tok} route {r} vector {v}"
                );
            }
        }
    }
}

fn main() {
    let Some((info, ctx, stream, copy)) = common::setup("cuda_permute_bound") else {
        return;
    };
    let ptx = cudarc::nvrtc::compile_ptx(SOURCE).unwrap();
    let module = ctx.load_module(ptx).unwrap();
    let kernel = Rows {
        funcs: [(2, 0), (4, 0), (8, 0), (2, 1), (4, 1)]
            .into_iter()
            .map(|(u, pf)| {
                let name = format!("rows_{u}_{pf}");
                ((u, pf), module.load_function(&name).unwrap())
            })
            .collect(),
        blocks: info.multiprocessors as u32 * 8,
    };
    let tma = (info.compute_capability.0 >= 9).then(|| {
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture={}", info.arch())],
            ..Default::default()
        };
        let source = format!("{MBARRIER}{BULK_COPY}{TMA_SOURCE}");
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).unwrap();
        Tma {
            func: ctx
                .load_module(ptx)
                .unwrap()
                .load_function("tma_rows")
                .unwrap(),
            multiprocessors: info.multiprocessors as u32,
        }
    });
    if tma.is_none() {
        eprintln!("skip: the bulk-copy layouts need sm_90 or newer");
    }
    println!(
        "device: {}; a warp per token, {} blocks x 256 threads; bf16 rows (H x 2 bytes)",
        info.name, kernel.blocks
    );
    // (T, H, topK, E values)
    let shapes: [(usize, usize, usize, &[usize]); 5] = [
        (4096, 7168, 8, &[8, 256]),
        (16384, 4096, 6, &[128]),
        (4096, 2048, 8, &[256]),
        (4096, 4096, 6, &[256]),
        (16384, 1024, 8, &[256]),
    ];
    for (t, h, k, es) in shapes {
        let row = h * 2;
        let (n, nv) = (t * k, row / 16);
        let mut g = XorShift::new(7);
        let input: Vec<u8> = (0..t * row).map(|_| g.next_u64() as u8).collect();
        let d_in = stream.clone_htod(&input).unwrap();
        let out = stream.alloc_zeros::<u8>(n * row).unwrap();
        let scratch = stream.alloc_zeros::<u8>(n * row).unwrap();
        let (p_in, p_out, p_scr) = (
            ptr(&stream, &d_in),
            ptr(&stream, &out),
            ptr(&stream, &scratch),
        );
        let s = stream.cu_stream();
        // SAFETY: the bench's live stream of cuda:0.
        let on = unsafe { Stream::from_raw(Device::cuda(0), s) };
        for &e in es {
            let (ex, dst) = routes(t, e, k, 11 + e as u64);
            let (d_ex, d_dst) = (
                stream.clone_htod(&ex).unwrap(),
                stream.clone_htod(&dst).unwrap(),
            );
            let probs: Vec<f32> = (0..t * e).map(|i| i as f32 * 0.5 + 1.0).collect();
            let d_probs = stream.clone_htod(&probs).unwrap();
            let d_pprobs = stream.alloc_zeros::<f32>(n).unwrap();
            let p_pprobs = ptr(&stream, &d_pprobs);
            let base = Launch {
                input: p_in,
                out: p_out,
                dst: ptr(&stream, &d_dst),
                ex: ptr(&stream, &d_ex),
                t: t as i32,
                k: k as i32,
                nv: nv as i64,
                read: 1,
                groups: 1,
                gsize: e as i32,
                slices: 1,
                probs: ptr(&stream, &d_probs),
                pprobs: 0,
                e: e as i32,
                func: (2, 0),
                tma: None,
            };
            let mut layouts: Vec<(String, Launch)> = vec![
                ("expert-major".into(), base),
                ("token-major".into(), Launch { dst: 0, ..base }),
                (
                    "expert-major, write-only".into(),
                    Launch { read: 0, ..base },
                ),
                (
                    "token-major, write-only".into(),
                    Launch {
                        dst: 0,
                        read: 0,
                        ..base
                    },
                ),
                (
                    "expert-major, write-only, 4 slices".into(),
                    Launch {
                        slices: 4,
                        read: 0,
                        ..base
                    },
                ),
                (
                    "token-major, 4 slices".into(),
                    Launch {
                        slices: 4,
                        dst: 0,
                        ..base
                    },
                ),
            ];
            for slices in [4, 8] {
                for func in [(2, 0), (4, 0), (8, 0), (2, 1), (4, 1)] {
                    layouts.push((
                        format!(
                            "expert-major, {slices} slices, {} vectors{}",
                            func.0,
                            if func.1 == 1 { " loaded ahead" } else { "" }
                        ),
                        Launch {
                            slices,
                            func,
                            ..base
                        },
                    ));
                }
            }
            for (slices, func) in [(4, (2, 0)), (4, (4, 1))] {
                layouts.push((
                    format!(
                        "expert-major + probs, {slices} slices, {} vectors{}",
                        func.0,
                        if func.1 == 1 { " loaded ahead" } else { "" }
                    ),
                    Launch {
                        slices,
                        func,
                        pprobs: p_pprobs,
                        ..base
                    },
                ));
            }
            for groups in [4usize] {
                if groups < e && e % groups == 0 {
                    layouts.push((
                        format!("expert-major, {groups} groups"),
                        Launch {
                            groups: groups as i32,
                            gsize: (e / groups) as i32,
                            ..base
                        },
                    ));
                }
            }
            if let Some(tm) = &tma {
                tm.allow(row, 8);
                for slices in [1i32, 2, 4] {
                    for stages in [4usize, 8] {
                        for (mode, threads, what) in
                            [(0, 32, "bulk stores"), (1, 256, "8 warps' stores")]
                        {
                            if stages * row / slices as usize > 100 * 1024 {
                                continue;
                            }
                            layouts.push((
                                format!("bulk loads, {slices} slices, {stages} stages, {what}"),
                                Launch {
                                    tma: Some((stages, mode, threads, slices)),
                                    ..base
                                },
                            ));
                        }
                    }
                }
                for (mode, threads, what) in [(0, 32, "bulk stores"), (1, 256, "8 warps' stores")] {
                    layouts.push((
                        format!("bulk loads, 2 slices, 4 stages, {what} + probs"),
                        Launch {
                            tma: Some((4, mode, threads, 2)),
                            pprobs: p_pprobs,
                            ..base
                        },
                    ));
                }
            }
            let tm = tma.as_ref();
            for (name, l) in &layouts {
                // SAFETY: poisons the live output before each layout.
                unsafe { on.memset_d8(p_out, 0xa5, n * row) }.unwrap();
                // SAFETY: every pointer of `l` is a live allocation sized
                // for this shape.
                unsafe { kernel.run(tm, *l, s) };
                stream.synchronize().unwrap();
                let dsts = (l.dst != 0).then_some(&dst[..]);
                check(&stream, &input, &out, dsts, t, k, nv, l.read != 0, name);
                if l.pprobs != 0 {
                    let got: Vec<f32> = stream.clone_dtoh(&d_pprobs).unwrap();
                    for (i, (&d, &x)) in dst.iter().zip(&ex).enumerate() {
                        let want = probs[i / k * e + x as usize];
                        assert_eq!(got[d as usize], want, "{name}: probs of route {i}");
                    }
                }
            }
            let mut variants: Vec<Box<dyn FnMut() + '_>> = vec![
                // SAFETY: both buffers hold n * row bytes.
                Box::new(|| unsafe { copy.enqueue(p_scr, p_out, n * row, s) }),
                Box::new(|| {
                    // SAFETY: as above.
                    unsafe { on.copy_dtod(p_scr, p_out, n * row) }.unwrap()
                }),
                Box::new(|| {
                    // SAFETY: the scratch buffer holds n * row bytes.
                    unsafe { on.memset_d32(p_scr, 0x3c003c00, n * row / 4) }.unwrap()
                }),
            ];
            let kernel = &kernel;
            for (_, l) in &layouts {
                let l = *l;
                // SAFETY: as in the checks above.
                variants.push(Box::new(move || unsafe { kernel.run(tm, l, s) }));
            }
            let us: Vec<f64> = interleaved_medians(&ctx, &stream, ROUNDS, &mut variants)
                .into_iter()
                .map(|ms| ms * 1e3)
                .collect();
            let copy_us = us[0].min(us[1]);
            let copy_gbs = 2.0 * (n * row) as f64 / copy_us / 1e3;
            println!("\n(T, E, H, topK) = ({t}, {e}, {h}, {k}); copy of [N, H]: kernel {:.1} us, driver {:.1} us", us[0], us[1]);
            println!("| layout | us | GB/s | ratio to copy |");
            println!("|---|---|---|---|");
            let memset_gbs = (n * row) as f64 / us[2] / 1e3;
            println!(
                "| memset of [N, H] (writes only) | {:.1} | {:.0} | {:.3} |",
                us[2],
                memset_gbs,
                memset_gbs / copy_gbs
            );
            for ((name, l), u) in layouts.iter().zip(&us[3..]) {
                let bytes = n * row + if l.read != 0 { t * row } else { 0 };
                let gbs = bytes as f64 / u / 1e3;
                println!("| {name} | {u:.1} | {gbs:.0} | {:.3} |", gbs / copy_gbs);
            }
        }
    }
}
