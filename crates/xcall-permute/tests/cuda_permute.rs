// Over 600 lines: every op on CUDA against the Host reference, sharing the device fixtures and the random cases.
//! Every op on CUDA against the Host path of the same entry points, on
//! fresh random data with poisoned outputs: bit-identical results expected
//! (the kernels follow the Host's order and rounding). Also: autotuned vs
//! untuned, in-place variants, stream capture, device-memory checks. Skips
//! without a GPU unless XCALL_REQUIRE_CUDA=1.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use xcall_core::cuda::Stream;
use xcall_core::testing::{capture_graph, cuda_devices_or_skip, new_stream, XorShift};
use xcall_core::Device;
use xcall_core::{DType, Status};
use xcall_permute::call::{
    self, MakeChunkSortMapArgs, MakeRowIdMapArgs, PermuteArgs, SortChunksArgs, Target, Tensor,
    UnpermuteArgs, UnpermuteBackwardArgs,
};
use xcall_permute::chunks::Direction;
use xcall_permute::{ExpertGroups, MapFaults, PermuteError, RowIdMapOptions};

const POISON: u8 = 0xa5;

struct Gpu {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    keep: Vec<CudaSlice<u8>>,
}

impl Gpu {
    fn new() -> Self {
        let ctx = CudaContext::new(0).unwrap();
        // Not while another test's thread captures: the first stream of a
        // context handle synchronizes the context.
        let stream = new_stream(&ctx);
        Gpu {
            _ctx: ctx,
            stream,
            keep: Vec::new(),
        }
    }

    /// The test stream as core's stream of GPU 0.
    fn on(&self) -> Stream {
        // SAFETY: the test's live stream of GPU 0, which outlives `self`'s
        // uses of it.
        unsafe { Stream::from_raw(Device::cuda(0), self.stream.cu_stream()) }
    }

    fn target(&self, autotune: bool) -> Target {
        Target {
            autotune,
            ..Target::cuda(0, self.stream.cu_stream().cast())
        }
    }

    /// Captures `work` on the test stream into a graph, runs
    /// `before_replay`, replays the graph once and waits for it; the graph
    /// and its executable are destroyed before returning.
    fn capture_and_replay(
        &self,
        work: impl FnOnce() -> Result<(), PermuteError>,
        before_replay: impl FnOnce(),
    ) {
        let mut work = Some(work);
        let mut result = None;
        let exec = capture_graph(Device::cuda(0), &self.stream, &mut || {
            result = work.take().map(|w| w())
        });
        result.expect("captured once").unwrap();
        before_replay();
        // An executable graph of this stream's context, whose buffers
        // outlive the replay; destroyed once the stream is idle.
        self.on().launch_graph(&exec).unwrap();
        self.stream.synchronize().unwrap();
        drop(exec);
    }

    /// Uploads `bytes` (at least one byte is allocated) and returns the
    /// device address; the allocation lives as long as `self`.
    fn upload(&mut self, bytes: &[u8]) -> u64 {
        let data = if bytes.is_empty() { &[0u8][..] } else { bytes };
        let slice = self.stream.clone_htod(data).unwrap();
        let ptr = slice.device_ptr(&self.stream).0;
        self.keep.push(slice);
        ptr
    }

    fn download(&self, address: u64, bytes: usize) -> Vec<u8> {
        self.stream.synchronize().unwrap();
        let mut out = vec![0u8; bytes];
        if bytes > 0 {
            // SAFETY: `address` is an allocation of this context of at least
            // `bytes` bytes; the stream is idle.
            unsafe { xcall_core::cuda::copy_dtoh_sync(Device::cuda(0), &mut out, address) }
                .unwrap();
        }
        out
    }
}

/// A host tensor and its device twin, both holding the same bytes.
struct Pair {
    host: Vec<u8>,
    dtype: DType,
    dims: Vec<u64>,
    device: u64,
}

impl Pair {
    fn new(gpu: &mut Gpu, host: Vec<u8>, dtype: DType, dims: &[u64]) -> Pair {
        let device = gpu.upload(&host);
        Pair {
            host,
            dtype,
            dims: dims.to_vec(),
            device,
        }
    }

    fn poisoned(gpu: &mut Gpu, dtype: DType, dims: &[u64]) -> Pair {
        let n = dims.iter().product::<u64>() as usize * dtype.size_bytes();
        Self::new(gpu, vec![POISON; n], dtype, dims)
    }

    fn h(&self) -> Tensor {
        Tensor::new(self.host.as_ptr() as u64, self.dtype, &self.dims)
    }

    fn d(&self) -> Tensor {
        Tensor::new(self.device, self.dtype, &self.dims)
    }

    fn same(&self, gpu: &Gpu, what: &str) {
        let got = gpu.download(self.device, self.host.len());
        if let Some(i) = got.iter().zip(&self.host).position(|(a, b)| a != b) {
            panic!(
                "{what}: CUDA differs from Host at byte {i} of {} ({:#04x} vs {:#04x})",
                got.len(),
                got[i],
                self.host[i]
            );
        }
    }
}

fn routing(t: usize, e: usize, topk: usize, g: &mut XorShift) -> Vec<u8> {
    let mut r = vec![0u8; t * e];
    for tok in 0..t {
        // Some tokens route nowhere; most take topk distinct experts.
        let k = if g.next_u64() % 11 == 0 {
            0
        } else {
            topk.min(e)
        };
        let mut chosen = 0;
        while chosen < k {
            let x = (g.next_u64() % e as u64) as usize;
            if r[tok * e + x] == 0 {
                r[tok * e + x] = 1 + (g.next_u64() % 3) as u8; // any nonzero byte routes
                chosen += 1;
            }
        }
    }
    r
}

fn random_values(dtype: DType, n: usize, g: &mut XorShift) -> Vec<u8> {
    let mut out = vec![0u8; n * dtype.size_bytes()];
    match xcall_core::FloatCodec::new(dtype) {
        Some(c) => (0..n).for_each(|i| c.store(&mut out, i, g.next_f32() * 4.0)),
        // fp8: every byte, NaN and E5M2 infinities included, some rows of
        // large values so that sums saturate.
        None => out.iter_mut().for_each(|b| {
            *b = match g.next_u64() % 8 {
                0 => 0x7d | (g.next_u64() as u8 & 0x80),
                _ => g.next_u64() as u8,
            }
        }),
    }
    out
}

fn f32s(n: usize, g: &mut XorShift) -> Vec<u8> {
    (0..n).flat_map(|_| g.next_f32().to_le_bytes()).collect()
}

fn both(gpu: &Gpu, autotune: bool, f: impl Fn(&Target, bool) -> Result<(), PermuteError>) {
    f(&Target::host(), false).unwrap();
    f(&gpu.target(autotune), true).unwrap();
}

struct Case {
    t: usize,
    e: usize,
    h: usize,
    topk: usize,
    cap: Option<usize>,
    align: Option<usize>,
    capacity: Option<usize>,
    groups: Option<ExpertGroups>,
    dtype: DType,
}

/// (T, E, H, top-k, cap, align, dtype): a case without expert capacity or
/// groups.
type Plain = (
    usize,
    usize,
    usize,
    usize,
    Option<usize>,
    Option<usize>,
    DType,
);

impl Case {
    fn plain((t, e, h, topk, cap, align, dtype): Plain) -> Case {
        Case {
            t,
            e,
            h,
            topk,
            cap,
            align,
            capacity: None,
            groups: None,
            dtype,
        }
    }
}

/// make_row_id_map of `routing` ([T, E] bytes) on the Host and on CUDA
/// into fresh poisoned tensors, its three outputs checked to agree:
/// (row_id_map, tokens_per_expert, expert_offsets).
fn row_id_map_on_both(
    gpu: &mut Gpu,
    routing: &Pair,
    options: RowIdMapOptions,
    autotune: bool,
    what: &str,
) -> (Pair, Pair, Pair) {
    let (t, e) = (routing.dims[0], routing.dims[1]);
    let map = Pair::poisoned(gpu, DType::I32, &[t, 2 * e + 1]);
    let tpe = Pair::poisoned(gpu, DType::I64, &[e]);
    let off = Pair::poisoned(gpu, DType::I64, &[e + 1]);
    both(gpu, autotune, |tg, dev| {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        // SAFETY: host vectors and device allocations of the tensors' sizes.
        unsafe {
            call::make_row_id_map(
                tg,
                &MakeRowIdMapArgs {
                    routing: pick(routing),
                    options,
                    row_id_map: pick(&map),
                    tokens_per_expert: pick(&tpe),
                    expert_offsets: pick(&off),
                },
            )
        }
    });
    map.same(gpu, &format!("{what}: row_id_map"));
    tpe.same(gpu, &format!("{what}: tokens_per_expert"));
    off.same(gpu, &format!("{what}: expert_offsets"));
    (map, tpe, off)
}

fn run_case(gpu: &mut Gpu, c: &Case, seed: u64, autotune: bool) {
    let what = format!(
        "T={} E={} H={} topk={} cap={:?} align={:?} capacity={:?} groups={:?} {}",
        c.t, c.e, c.h, c.topk, c.cap, c.align, c.capacity, c.groups, c.dtype
    );
    let mut g = XorShift::new(seed);
    let (t, e, h) = (c.t as u64, c.e as u64, c.h as u64);
    let r = Pair::new(gpu, routing(c.t, c.e, c.topk, &mut g), DType::U8, &[t, e]);
    let options = RowIdMapOptions {
        num_out_tokens: c.cap,
        align: c.align,
        capacity: c.capacity,
        groups: c.groups,
    };
    let (map, tpe, off) = row_id_map_on_both(gpu, &r, options, autotune, &what);
    let offsets: Vec<i64> = off
        .host
        .chunks(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let n = c.cap.map_or(offsets[c.e] as u64, |x| x as u64);

    // permute with probs and scales.
    let input = Pair::new(
        gpu,
        random_values(c.dtype, c.t * c.h, &mut g),
        c.dtype,
        &[t, h],
    );
    let probs = Pair::new(gpu, f32s(c.t * c.e, &mut g), DType::F32, &[t, e]);
    let scales = Pair::new(gpu, f32s(c.t * 3, &mut g), DType::F32, &[t, 3]);
    let out = Pair::poisoned(gpu, c.dtype, &[n, h]);
    let pp = Pair::poisoned(gpu, DType::F32, &[n]);
    let ps = Pair::poisoned(gpu, DType::F32, &[n, 3]);
    both(gpu, autotune, |tg, dev| {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        // SAFETY: as above.
        unsafe {
            call::permute(
                tg,
                &PermuteArgs {
                    input: pick(&input),
                    row_id_map: pick(&map),
                    tokens_per_expert: pick(&tpe),
                    expert_offsets: pick(&off),
                    probs: Some(pick(&probs)),
                    scales: Some(pick(&scales)),
                    output: pick(&out),
                    permuted_probs: Some(pick(&pp)),
                    permuted_scales: Some(pick(&ps)),
                    in_place: false,
                    output_segments: None,
                },
            )
        }
    });
    out.same(gpu, &format!("{what}: permute output"));
    pp.same(gpu, &format!("{what}: permuted_probs"));
    ps.same(gpu, &format!("{what}: permuted_scales"));
    if !matches!(c.dtype, DType::F32 | DType::F16 | DType::Bf16) {
        // fp8: unpermute without probs (sum in f32, saturating stores), of
        // fresh rows (permute's output holds a token's row at each of its
        // routes: its sums would add a value to itself).
        let rows = Pair::new(
            gpu,
            random_values(c.dtype, n as usize * c.h, &mut g),
            c.dtype,
            &[n, h],
        );
        let plain = Pair::poisoned(gpu, c.dtype, &[t, h]);
        both(gpu, autotune, |tg, dev| {
            let pick = |p: &Pair| if dev { p.d() } else { p.h() };
            // SAFETY: as above.
            unsafe {
                call::unpermute(
                    tg,
                    &UnpermuteArgs {
                        input: pick(&rows),
                        row_id_map: pick(&map),
                        merging_probs: None,
                        permuted_probs: None,
                        output: pick(&plain),
                        unpermuted_probs: None,
                        input_segments: None,
                    },
                )
            }
        });
        plain.same(gpu, &format!("{what}: fp8 unpermute"));
        return;
    }

    // unpermute with merging probs and scattered probs, then without probs.
    let back = Pair::poisoned(gpu, c.dtype, &[t, h]);
    let up = Pair::poisoned(gpu, DType::F32, &[t, e]);
    let plain = Pair::poisoned(gpu, c.dtype, &[t, h]);
    both(gpu, autotune, |tg, dev| {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        // SAFETY: as above.
        unsafe {
            call::unpermute(
                tg,
                &UnpermuteArgs {
                    input: pick(&out),
                    row_id_map: pick(&map),
                    merging_probs: Some(pick(&probs)),
                    permuted_probs: Some(pick(&pp)),
                    output: pick(&back),
                    unpermuted_probs: Some(pick(&up)),
                    input_segments: None,
                },
            )?;
            call::unpermute(
                tg,
                &UnpermuteArgs {
                    input: pick(&out),
                    row_id_map: pick(&map),
                    merging_probs: None,
                    permuted_probs: None,
                    output: pick(&plain),
                    unpermuted_probs: None,
                    input_segments: None,
                },
            )
        }
    });
    back.same(gpu, &format!("{what}: unpermute output"));
    up.same(gpu, &format!("{what}: unpermuted_probs"));
    plain.same(gpu, &format!("{what}: unpermute without probs"));

    // unpermute_backward.
    let grad = Pair::new(
        gpu,
        random_values(c.dtype, c.t * c.h, &mut g),
        c.dtype,
        &[t, h],
    );
    let act = Pair::poisoned(gpu, c.dtype, &[n, h]);
    let pg = Pair::poisoned(gpu, DType::F32, &[t, e]);
    both(gpu, autotune, |tg, dev| {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        // SAFETY: as above.
        unsafe {
            call::unpermute_backward(
                tg,
                &UnpermuteBackwardArgs {
                    grad: pick(&grad),
                    fwd_input: pick(&out),
                    row_id_map: pick(&map),
                    tokens_per_expert: pick(&tpe),
                    expert_offsets: pick(&off),
                    merging_probs: pick(&probs),
                    act_grad: pick(&act),
                    probs_grad: pick(&pg),
                },
            )
        }
    });
    act.same(gpu, &format!("{what}: act_grad"));
    pg.same(gpu, &format!("{what}: probs_grad"));
}

#[test]
fn every_op_and_dtype_equals_the_host() {
    if cuda_devices_or_skip("permute cuda ops").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let mut seed = 100;
    let mut cases = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        cases.extend([
            Case {
                t: 4096,
                e: 7,
                h: 4096,
                topk: 2,
                cap: None,
                align: None,
                capacity: None,
                groups: None,
                dtype,
            },
            Case {
                t: 4096,
                e: 16,
                h: 1280,
                topk: 5,
                cap: Some(2039),
                align: None,
                capacity: None,
                groups: None,
                dtype,
            },
            Case {
                t: 1024,
                e: 64,
                h: 4096,
                topk: 6,
                cap: None,
                align: Some(16),
                capacity: None,
                groups: None,
                dtype,
            },
            Case {
                t: 300,
                e: 256,
                h: 7168,
                topk: 8,
                cap: None,
                align: Some(128),
                capacity: None,
                groups: None,
                dtype,
            },
            Case {
                t: 333,
                e: 5,
                h: 1029,
                topk: 3,
                cap: Some(5000),
                align: None,
                capacity: None,
                groups: None,
                dtype,
            },
            Case {
                t: 77,
                e: 3,
                h: 1,
                topk: 2,
                cap: None,
                align: None,
                capacity: None,
                groups: None,
                dtype,
            },
            Case {
                t: 0,
                e: 4,
                h: 64,
                topk: 2,
                cap: None,
                align: Some(8),
                capacity: None,
                groups: None,
                dtype,
            },
        ]);
    }
    // Expert capacity: drops (mean load 1170 > 1000), and padding.
    for (capacity, dtype) in [(1000, DType::Bf16), (3000, DType::F32)] {
        cases.push(Case {
            t: 4096,
            e: 7,
            h: 1024,
            topk: 2,
            cap: None,
            align: None,
            capacity: Some(capacity),
            groups: None,
            dtype,
        });
    }
    // Expert groups: no drop (one group of 256 experts holding T * k rows,
    // two of 4 holding T * 2), drops with padding, and every group full.
    for (t, e, topk, experts, rows, align, dtype) in [
        (300, 256, 8, 256, 2400, None, DType::Bf16),
        (4096, 8, 2, 4, 8192, None, DType::F32),
        (1000, 64, 6, 16, 1200, Some(8), DType::Bf16),
        (500, 12, 3, 3, 100, None, DType::F16),
    ] {
        cases.push(Case {
            t,
            e,
            h: 1024,
            topk,
            cap: None,
            align,
            capacity: None,
            groups: Some(ExpertGroups { experts, rows }),
            dtype,
        });
    }
    cases.push(Case {
        t: 2000,
        e: 512,
        h: 256,
        topk: 8,
        cap: None,
        align: None,
        capacity: None,
        groups: None,
        dtype: DType::Bf16,
    });
    // The backward's probs gradient: experts in 32 chunks of 32 (the last
    // chunk's bit) with more routes than a warp has lanes, and more chunks
    // than that (each lane looking through the routes).
    for (t, e, topk, dtype) in [(200, 1024, 40, DType::Bf16), (150, 1500, 9, DType::F32)] {
        cases.push(Case {
            t,
            e,
            h: 96,
            topk,
            cap: None,
            align: None,
            capacity: None,
            groups: None,
            dtype,
        });
    }
    for c in &cases {
        seed += 1;
        run_case(&mut gpu, c, seed, false);
    }
}

/// fp8: permute (pure movement) and unpermute without probs (f32 sums,
/// saturating stores); small enough to run under compute-sanitizer.
#[test]
fn fp8_permute_and_unpermute_equal_the_host() {
    if cuda_devices_or_skip("permute cuda fp8").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let mut cases = Vec::new();
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        cases.push(Case {
            t: 512,
            e: 8,
            h: 4096,
            topk: 2,
            cap: None,
            align: Some(4),
            capacity: None,
            groups: None,
            dtype,
        });
        cases.push(Case {
            t: 100,
            e: 9,
            h: 33,
            topk: 3,
            cap: Some(90),
            align: None,
            capacity: None,
            groups: None,
            dtype,
        });
        // Top-1 and top-2: unpermute maps a lone route's bytes and sums
        // two routes in f16 (rows of whole words), also with routes
        // dropped by the cap.
        for topk in [1, 2] {
            for (t, h, cap, align) in [(300, 4096, None, Some(4)), (77, 36, Some(60), None)] {
                cases.push(Case {
                    t,
                    e: 5,
                    h,
                    topk,
                    cap,
                    align: align.filter(|_| topk == 1),
                    capacity: None,
                    groups: None,
                    dtype,
                });
            }
        }
    }
    for (i, c) in cases.iter().enumerate() {
        run_case(&mut gpu, c, 900 + i as u64, i % 2 == 0);
    }
}

/// fp8 unpermute of tokens with two routes and no probs sums in f16 (see
/// `F8::pair4` in kernels.cu), where the Host sums in f32: every pair of
/// bytes (a, b), each format, must store the Host's byte.
/// fp8 unpermute without probs on the Host and the GPU, both formats: T =
/// 64 tokens of H = 1024 each route to experts 0 .. k (token t's route e
/// is row e * T + t of the input), whose rows are `columns[e](i)` for
/// value i = t * H + j.
fn fp8_unpermute_rows_on_both(what: &str, columns: &[fn(usize) -> u8]) {
    let mut gpu = Gpu::new();
    let (t, h, k) = (64u64, 1024u64, columns.len() as u64);
    let r = Pair::new(&mut gpu, vec![1u8; (k * t) as usize], DType::U8, &[t, k]);
    let (map, _, _) = row_id_map_on_both(&mut gpu, &r, RowIdMapOptions::default(), false, what);
    let n = (t * h) as usize;
    let rows: Vec<u8> = columns.iter().flat_map(|c| (0..n).map(c)).collect();
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let input = Pair::new(&mut gpu, rows.clone(), dtype, &[k * t, h]);
        let out = Pair::poisoned(&mut gpu, dtype, &[t, h]);
        both(&gpu, false, |tg, dev| {
            let pick = |p: &Pair| if dev { p.d() } else { p.h() };
            // SAFETY: as above.
            unsafe {
                call::unpermute(
                    tg,
                    &UnpermuteArgs {
                        input: pick(&input),
                        row_id_map: pick(&map),
                        merging_probs: None,
                        permuted_probs: None,
                        output: pick(&out),
                        unpermuted_probs: None,
                        input_segments: None,
                    },
                )
            }
        });
        out.same(&gpu, &format!("{dtype}: {what}"));
    }
}

#[test]
fn fp8_unpermute_sums_every_pair_of_bytes_as_the_host() {
    if cuda_devices_or_skip("permute cuda fp8 pairs").is_none() {
        return;
    }
    // Two routes (the f16 pair sums): value i sums the bytes i % 256 and
    // i / 256, every pair.
    fp8_unpermute_rows_on_both("every pair of bytes", &[|i| i as u8, |i| (i >> 8) as u8]);
}

#[test]
fn fp8_unpermute_sums_three_routes_of_every_byte_as_the_host() {
    if cuda_devices_or_skip("permute cuda fp8 three routes").is_none() {
        return;
    }
    // Three routes take the summing path, which converts a word of four
    // bytes at a time: value i sums the bytes i % 256, i / 256 and i / 4,
    // so every pair of the first two, and every byte at each of a word's
    // four places in the third (words with an all-ones exponent and words
    // without both come up).
    fp8_unpermute_rows_on_both(
        "three routes of every byte",
        &[|i| i as u8, |i| (i >> 8) as u8, |i| (i >> 2) as u8],
    );
}

#[test]
fn autotuned_results_equal_untuned_and_tuning_writes_nothing_visible() {
    if cuda_devices_or_skip("permute autotune").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    // Untuned first, then the same data with tuning on (the first tuned
    // call per kernel class times candidates on scratch): run_case
    // compares each against the Host, so both are bit-identical.
    for (i, dtype) in [DType::Bf16, DType::F32].into_iter().enumerate() {
        let c = Case {
            t: 2048,
            e: 32,
            h: 2880,
            topk: 4,
            cap: None,
            align: Some(8),
            capacity: None,
            groups: None,
            dtype,
        };
        run_case(&mut gpu, &c, 900 + i as u64, false);
        run_case(&mut gpu, &c, 900 + i as u64, true);
    }
    let tuned = xcall_permute::cuda::cached_configs(xcall_core::Device::cuda(0));
    eprintln!("tuned configs: {tuned:?}");
    assert!(tuned.len() >= 4, "tuning ran for the kernels: {tuned:?}");
}

/// Every launch config the tuner may pick (block- and warp-per-token
/// variants, each unroll and grid) computes the Host's bits: each
/// movement candidate forced on permute, unpermute and sort_chunks_by_map
/// in turn, the backward's candidates round-robin beside them. One case
/// has more routes per token than a warp stages at once (40 > 32).
#[test]
fn every_launch_config_equals_the_host() {
    if cuda_devices_or_skip("permute launch configs").is_none() {
        return;
    }
    use xcall_permute::cuda::{backward_candidates, movement_candidates, with_configs};
    let mut gpu = Gpu::new();
    // The row-holding backward kernels take only some rows: their own
    // test below.
    let backs: Vec<_> = backward_candidates()
        .into_iter()
        .filter(|c| c.held == 0)
        .collect();
    let moves = movement_candidates();
    // Four cases: each backward config (fewer than the movement configs)
    // meets two of them.
    let cases = [
        (300, 8, 1000, 2, DType::Bf16),
        (97, 64, 7, 40, DType::F32),
        (129, 16, 515, 3, DType::F16),
        (60, 1100, 40, 36, DType::Bf16),
    ];
    for (i, &m) in moves.iter().enumerate() {
        let (t, e, h, topk, dtype) = cases[i % cases.len()];
        let c = Case {
            t,
            e,
            h,
            topk,
            cap: None,
            align: (i % 2 == 0).then_some(4),
            capacity: None,
            groups: None,
            dtype,
        };
        let forced = [
            ("permute", m),
            ("unpermute", m),
            ("unpermute_backward", backs[i % backs.len()]),
            ("sort_chunks", m),
        ];
        eprintln!("configs {forced:?}");
        with_configs(&forced, || {
            run_case(&mut gpu, &c, 1200 + i as u64, true);
            chunk_case(&mut gpu, 5, 301, h, dtype, 1300 + i as u64, true);
            // Six routes per token on 16-byte vectors: unpermute's
            // two-route-load kernels (`l2_`) and, for fp8, its streaming
            // summing kernels (`s_`), with and without a cap.
            for (j, dtype) in [DType::Bf16, DType::F32, DType::F8E4M3, DType::F8E5M2]
                .into_iter()
                .enumerate()
                .filter(|(j, _)| j % 2 == i % 2)
            {
                let six = Case {
                    t: 64,
                    e: 16,
                    h: 512,
                    topk: 6,
                    cap: (i % 2 == 1).then_some(64 * 5),
                    align: None,
                    dtype,
                    ..c
                };
                run_case(&mut gpu, &six, 1400 + (10 * j + i) as u64, true);
            }
        });
    }
}

/// The row-holding unpermute_backward kernels (each thread keeps its groups
/// of the token's gradient in registers for all of the token's routes)
/// against the Host: one batch of routes and several (top-40 goes in five
/// batches of eight), capped and padded maps, and the widest row each
/// holds (256 x `held` groups of 16 bytes), in every float dtype; a row
/// one group wider runs with the default config instead.
#[test]
fn row_holding_backward_kernels_equal_the_host() {
    if cuda_devices_or_skip("row-holding unpermute_backward").is_none() {
        return;
    }
    use xcall_permute::cuda::{backward_candidates, with_configs};
    let mut gpu = Gpu::new();
    let held: Vec<_> = backward_candidates()
        .into_iter()
        .filter(|c| c.held > 0)
        .collect();
    assert!(held.len() >= 2, "{held:?}");
    for (i, &b) in held.iter().enumerate() {
        let widest = 256 * b.held as usize; // 16-byte groups
        let cases = [
            (300, 8, 1000, 2, None, None, DType::Bf16),
            (97, 64, 48, 40, None, Some(4), DType::F32),
            (
                129,
                16,
                widest * 8,
                3,
                Some(129 * 3 * 3 / 4),
                None,
                DType::F16,
            ),
            (40, 4, widest * 4, 1, None, None, DType::F32),
            (33, 8, widest * 8 - 8, 8, None, Some(8), DType::Bf16),
            // One group too wide to hold: the default config runs it.
            (40, 4, widest * 8 + 8, 2, None, None, DType::Bf16),
        ];
        for (j, &plain) in cases.iter().enumerate() {
            let c = Case::plain(plain);
            let (t, e, h, topk, dtype) = (c.t, c.e, c.h, c.topk, c.dtype);
            eprintln!("config {b:?}, T={t} E={e} H={h} top-{topk} {dtype}");
            with_configs(&[("unpermute_backward", b)], || {
                run_case(&mut gpu, &c, 1500 + (i * 10 + j) as u64, true)
            });
        }
    }
}

/// The bulk-copy permute configs (sm_90+), or `None` after a skip line on
/// an older device: there a forced bulk config runs the default kernel, so
/// a test of the bulk kernels would pass without running them.
fn bulk_configs(test: &str) -> Option<Vec<xcall_permute::cuda::LaunchConfig>> {
    let info = xcall_core::cuda::device_info(xcall_core::Device::cuda(0)).unwrap();
    if info.compute_capability.0 < 9 {
        xcall_core::testing::skip(test, "the bulk-copy permute kernels need sm_90 or newer");
        return None;
    }
    let bulk: Vec<_> = xcall_permute::cuda::permute_candidates()
        .into_iter()
        .filter(|c| c.stages > 0)
        .collect();
    assert!(bulk.len() >= 2, "{bulk:?}");
    Some(bulk)
}

/// permute through the bulk-copy kernels (every config forced) against the
/// Host, with probs and scales: a row in one piece and in uneven pieces
/// (14 KiB rows), more than 32 routes per token (the mover reads the map
/// past the staged routes), a cap, padded chunks, fp8 rows, and a row
/// that is not whole 16-byte units (the default kernel runs it instead).
#[test]
fn bulk_copy_permute_kernels_equal_the_host() {
    if cuda_devices_or_skip("bulk-copy permute").is_none() {
        return;
    }
    let Some(bulk) = bulk_configs("bulk_copy_permute_kernels_equal_the_host") else {
        return;
    };
    use xcall_permute::cuda::with_configs;
    let mut gpu = Gpu::new();
    // (T, E, H, top-k, cap, align, dtype)
    let cases = [
        (300, 8, 1000, 2, None, Some(4), DType::Bf16),
        (97, 64, 48, 40, None, None, DType::F32),
        (33, 8, 7168, 8, Some(33 * 8 - 20), None, DType::Bf16),
        (70, 16, 7168, 6, None, Some(8), DType::Bf16),
        (64, 16, 4096, 6, None, Some(4), DType::F8E4M3),
        (200, 4, 2048, 1, Some(150), None, DType::F16),
        (129, 16, 515, 3, None, None, DType::F16),
    ];
    for (i, &b) in bulk.iter().enumerate() {
        for (j, &plain) in cases.iter().enumerate() {
            let c = Case::plain(plain);
            let (t, e, h, topk, cap, dtype) = (c.t, c.e, c.h, c.topk, c.cap, c.dtype);
            eprintln!("config {b:?}, T={t} E={e} H={h} top-{topk} cap={cap:?} {dtype}");
            with_configs(&[("permute", b)], || {
                run_case(&mut gpu, &c, 1700 + (i * 10 + j) as u64, false)
            });
        }
        // The forced config ran its own kernel (not the default one a row
        // of other than whole 16-byte units runs instead).
        let name = format!("permute_bulk_{}", b.stages);
        let loaded = xcall_permute::cuda::loaded_kernels(xcall_core::Device::cuda(0));
        assert!(loaded.contains(&name), "{name} never loaded: {loaded:?}");
    }
}

/// unpermute's async configs (a warp per token, routes copied into shared
/// memory by cp.async).
fn async_configs() -> Vec<xcall_permute::cuda::LaunchConfig> {
    let a: Vec<_> = xcall_permute::cuda::unpermute_candidates(true)
        .into_iter()
        .filter(|c| c.stages > 0)
        .collect();
    assert!(a.len() >= 3, "{a:?}");
    a
}

/// unpermute through the async kernels (every config forced) against the
/// Host, with and without merging probs: one to eight routes, more than a
/// stage holds (top-12 and top-40: those tokens take the register path),
/// a cap (skipped routes), padded chunks, rows of vectors that are not
/// whole chunks of 32, every float dtype and both fp8s, and a row that is
/// not whole 16-byte vectors (the default kernel runs it instead).
#[test]
fn async_unpermute_kernels_equal_the_host() {
    if cuda_devices_or_skip("async unpermute").is_none() {
        return;
    }
    use xcall_permute::cuda::with_configs;
    let mut gpu = Gpu::new();
    // (T, E, H, top-k, cap, align, dtype)
    let cases = [
        (300, 8, 1000, 2, None, Some(4), DType::Bf16),
        (97, 64, 48, 40, None, None, DType::F32),
        (33, 16, 7168, 12, Some(33 * 12 - 20), None, DType::Bf16),
        (70, 16, 7168, 8, None, Some(8), DType::F16),
        (64, 16, 4096, 6, None, Some(4), DType::F8E4M3),
        (50, 8, 2064, 8, Some(300), None, DType::F8E5M2),
        (200, 4, 1024, 1, Some(150), None, DType::F32),
        (129, 16, 515, 3, None, None, DType::F16),
    ];
    for (i, &a) in async_configs().iter().enumerate() {
        for (j, &plain) in cases.iter().enumerate() {
            let c = Case::plain(plain);
            let (t, e, h, topk, cap, dtype) = (c.t, c.e, c.h, c.topk, c.cap, c.dtype);
            eprintln!("config {a:?}, T={t} E={e} H={h} top-{topk} cap={cap:?} {dtype}");
            with_configs(&[("unpermute", a)], || {
                run_case(&mut gpu, &c, 2200 + (i * 10 + j) as u64, false)
            });
        }
        let name = format!("unpermute_a{}_w_16_1", a.stages);
        let loaded = xcall_permute::cuda::loaded_kernels(xcall_core::Device::cuda(0));
        assert!(loaded.contains(&name), "{name} never loaded: {loaded:?}");
    }
}

/// The chunk-sort map of a split on Host and on CUDA (both checked to
/// succeed), for [`Pair::same`].
fn chunk_map_on_both(
    gpu: &mut Gpu,
    sizes: &[i64],
    sorted: &[i64],
    t: usize,
    autotune: bool,
) -> Pair {
    let s = sizes.len() as u64;
    let sz = Pair::new(gpu, bytes_of(sizes), DType::I64, &[s]);
    let so = Pair::new(gpu, bytes_of(sorted), DType::I64, &[s]);
    let map = Pair::poisoned(gpu, DType::I64, &[t as u64]);
    both(gpu, autotune, |tg, dev| {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        // SAFETY: host vectors and device allocations of the sizes given.
        unsafe {
            call::make_chunk_sort_map(
                tg,
                &MakeChunkSortMapArgs {
                    split_sizes: pick(&sz),
                    sorted_indices: pick(&so),
                    map: pick(&map),
                },
            )
        }
    });
    map
}

fn chunk_case(
    gpu: &mut Gpu,
    s: usize,
    t: usize,
    h: usize,
    dtype: DType,
    seed: u64,
    autotune: bool,
) {
    let what = format!("S={s} T={t} H={h} {dtype}");
    let mut g = XorShift::new(seed);
    // Random sizes that leave a tail of rows past the chunks.
    let mut sizes = vec![0i64; s];
    let mut left = t - t / 10;
    for (i, size) in sizes.iter_mut().enumerate() {
        let x = if i + 1 == s {
            left
        } else {
            (g.next_u64() as usize) % (2 * left / (s - i) + 1)
        };
        let x = x.min(left);
        *size = x as i64;
        left -= x;
    }
    let mut sorted: Vec<i64> = (0..s as i64).collect();
    for i in (1..s).rev() {
        sorted.swap(i, (g.next_u64() % (i as u64 + 1)) as usize);
    }
    let map = chunk_map_on_both(gpu, &sizes, &sorted, t, autotune);
    map.same(gpu, &format!("{what}: chunk map"));
    let input = Pair::new(
        gpu,
        random_values(dtype, t * h, &mut g),
        dtype,
        &[t as u64, h as u64],
    );
    let probs = Pair::new(gpu, f32s(t, &mut g), DType::F32, &[t as u64]);
    for direction in [Direction::Forward, Direction::Backward] {
        let out = Pair::poisoned(gpu, dtype, &[t as u64, h as u64]);
        let pp = Pair::poisoned(gpu, DType::F32, &[t as u64]);
        both(gpu, autotune, |tg, dev| {
            let pick = |p: &Pair| if dev { p.d() } else { p.h() };
            // SAFETY: as above.
            unsafe {
                call::sort_chunks_by_map(
                    tg,
                    &SortChunksArgs {
                        input: pick(&input),
                        map: pick(&map),
                        probs: Some(pick(&probs)),
                        direction,
                        output: pick(&out),
                        permuted_probs: Some(pick(&pp)),
                        in_place: false,
                    },
                )
            }
        });
        out.same(gpu, &format!("{what} {direction:?}: sorted rows"));
        pp.same(gpu, &format!("{what} {direction:?}: sorted probs"));
        // In place: the output is the input's own buffer.
        let inplace = Pair::new(gpu, input.host.clone(), dtype, &[t as u64, h as u64]);
        let mut host_copy = inplace.host.clone();
        let host_t = Tensor::new(host_copy.as_mut_ptr() as u64, dtype, &inplace.dims);
        let args = |x: Tensor| SortChunksArgs {
            input: x.clone(),
            map: map.h(),
            probs: None,
            direction,
            output: x,
            permuted_probs: None,
            in_place: true,
        };
        // SAFETY: as above; in_place allows the overlap.
        unsafe {
            call::sort_chunks_by_map(&Target::host(), &args(host_t)).unwrap();
            let mut dargs = args(inplace.d());
            dargs.map = map.d();
            call::sort_chunks_by_map(&gpu.target(autotune), &dargs).unwrap();
        }
        assert_eq!(
            host_copy, out.host,
            "{what}: Host in-place equals out-of-place"
        );
        let got = gpu.download(inplace.device, inplace.host.len());
        assert!(got == out.host, "{what}: CUDA in-place equals out-of-place");
    }
}

#[test]
fn chunk_sort_equals_the_host_including_in_place() {
    if cuda_devices_or_skip("permute cuda chunk sort").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let mut seed = 500;
    let max = xcall_permute::cuda::MAX_CUDA_CHUNKS;
    for (s, t, h) in [
        (8, 4096, 1280),
        (64, 4096, 4096),
        (256, 4096, 9216),
        (3, 17, 5),
        // More chunks than threads per block, up to the limit.
        (1000, 30_000, 8),
        (max, 3 * max + 7, 4),
    ] {
        for dtype in [DType::Bf16, DType::F32, DType::F8E4M3] {
            seed += 1;
            chunk_case(&mut gpu, s, t, h, dtype, seed, seed % 2 == 0);
        }
    }
}

#[test]
fn permute_in_place_equals_out_of_place() {
    if cuda_devices_or_skip("permute cuda in place").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let mut g = XorShift::new(77);
    let (t, e, h, dtype) = (1000usize, 8usize, 2048usize, DType::Bf16);
    let r = Pair::new(
        &mut gpu,
        routing(t, e, 2, &mut g),
        DType::U8,
        &[t as u64, e as u64],
    );
    let (map, tpe, off) =
        row_id_map_on_both(&mut gpu, &r, RowIdMapOptions::default(), false, "in place");
    let n = i64::from_le_bytes(off.host[8 * e..].try_into().unwrap()) as usize;
    let row = h * dtype.size_bytes();
    let data = random_values(dtype, t * h, &mut g);
    // One buffer of max(T, N) rows: input at its start, output over it.
    let mut buf = vec![POISON; t.max(n) * row];
    buf[..data.len()].copy_from_slice(&data);
    let dbuf = gpu.upload(&buf);
    let dinput = gpu.upload(&data);
    let dout = gpu.upload(&vec![POISON; n * row]);
    let args = |input: u64, output: u64, in_place: bool, dev: bool| PermuteArgs {
        input: Tensor::new(input, dtype, &[t as u64, h as u64]),
        row_id_map: if dev { map.d() } else { map.h() },
        tokens_per_expert: if dev { tpe.d() } else { tpe.h() },
        expert_offsets: if dev { off.d() } else { off.h() },
        probs: None,
        scales: None,
        output: Tensor::new(output, dtype, &[n as u64, h as u64]),
        permuted_probs: None,
        permuted_scales: None,
        in_place,
        output_segments: None,
    };
    for autotune in [false, true] {
        let dbuf2 = gpu.upload(&buf);
        // SAFETY: buffers of the sizes given.
        unsafe {
            let refused = call::permute(&gpu.target(autotune), &args(dbuf, dbuf, false, true));
            assert_eq!(refused.unwrap_err().status(), Status::Aliased);
            call::permute(&gpu.target(autotune), &args(dinput, dout, false, true)).unwrap();
            call::permute(&gpu.target(autotune), &args(dbuf2, dbuf2, true, true)).unwrap();
        }
        let want = gpu.download(dout, n * row);
        let got = gpu.download(dbuf2, n * row);
        assert!(
            got == want,
            "in-place permute equals out-of-place (autotune {autotune})"
        );
        assert_eq!(
            gpu.download(dbuf, buf.len()),
            buf,
            "the refused call wrote nothing"
        );
    }
    // And on Host.
    let mut host_out = vec![POISON; n * row];
    let mut host_buf = buf.clone();
    let hb = host_buf.as_mut_ptr() as u64;
    // SAFETY: host buffers of the sizes given.
    unsafe {
        call::permute(
            &Target::host(),
            &args(
                data.as_ptr() as u64,
                host_out.as_mut_ptr() as u64,
                false,
                false,
            ),
        )
        .unwrap();
        call::permute(&Target::host(), &args(hb, hb, true, false)).unwrap();
    }
    assert!(
        host_buf[..n * row] == host_out[..],
        "Host in-place equals out-of-place"
    );
    assert!(gpu.download(dout, n * row) == host_out, "CUDA equals Host");
}

#[test]
fn under_capture_nothing_is_tuned_and_the_graph_replays_correctly() {
    if cuda_devices_or_skip("permute cuda capture").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let mut g = XorShift::new(4242);
    // A row size no other test uses, so no config is cached for it.
    let (t, e, h, dtype) = (512usize, 8usize, 4000usize, DType::F16);
    let r = Pair::new(
        &mut gpu,
        routing(t, e, 3, &mut g),
        DType::U8,
        &[t as u64, e as u64],
    );
    let map = Pair::poisoned(&mut gpu, DType::I32, &[t as u64, 2 * e as u64 + 1]);
    let tpe = Pair::poisoned(&mut gpu, DType::I64, &[e as u64]);
    let off = Pair::poisoned(&mut gpu, DType::I64, &[e as u64 + 1]);
    let cap = 1000usize;
    let input = Pair::new(
        &mut gpu,
        random_values(dtype, t * h, &mut g),
        dtype,
        &[t as u64, h as u64],
    );
    let out = Pair::poisoned(&mut gpu, dtype, &[cap as u64, h as u64]);
    let sizes: Vec<u8> = [100i64, 200, 150]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let sorted: Vec<u8> = [2i64, 0, 1].iter().flat_map(|x| x.to_le_bytes()).collect();
    let sz = Pair::new(&mut gpu, sizes, DType::I64, &[3]);
    let so = Pair::new(&mut gpu, sorted, DType::I64, &[3]);
    let cmap = Pair::poisoned(&mut gpu, DType::I64, &[t as u64]);
    let sorted_out = Pair::poisoned(&mut gpu, dtype, &[t as u64, h as u64]);
    let step = |tg: &Target, dev: bool| -> Result<(), PermuteError> {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        // SAFETY: as above.
        unsafe {
            call::make_row_id_map(
                tg,
                &MakeRowIdMapArgs {
                    routing: pick(&r),
                    options: RowIdMapOptions {
                        num_out_tokens: Some(cap),
                        align: None,
                        capacity: None,
                        groups: None,
                    },
                    row_id_map: pick(&map),
                    tokens_per_expert: pick(&tpe),
                    expert_offsets: pick(&off),
                },
            )?;
            call::permute(
                tg,
                &PermuteArgs {
                    input: pick(&input),
                    row_id_map: pick(&map),
                    tokens_per_expert: pick(&tpe),
                    expert_offsets: pick(&off),
                    probs: None,
                    scales: None,
                    output: pick(&out),
                    permuted_probs: None,
                    permuted_scales: None,
                    in_place: false,
                    output_segments: None,
                },
            )?;
            call::make_chunk_sort_map(
                tg,
                &MakeChunkSortMapArgs {
                    split_sizes: pick(&sz),
                    sorted_indices: pick(&so),
                    map: pick(&cmap),
                },
            )?;
            call::sort_chunks_by_map(
                tg,
                &SortChunksArgs {
                    input: pick(&input),
                    map: pick(&cmap),
                    probs: None,
                    direction: Direction::Forward,
                    output: pick(&sorted_out),
                    permuted_probs: None,
                    in_place: false,
                },
            )
        }
    };
    step(&Target::host(), false).unwrap();
    let before = xcall_permute::cuda::cached_configs(xcall_core::Device::cuda(0)).len();
    gpu.capture_and_replay(|| step(&gpu.target(true), true), || {});
    let after = xcall_permute::cuda::cached_configs(xcall_core::Device::cuda(0)).len();
    assert_eq!(before, after, "no autotuning under capture");
    map.same(&gpu, "captured row_id_map");
    out.same(&gpu, "captured permute");
    cmap.same(&gpu, "captured chunk map");
    sorted_out.same(&gpu, "captured chunk sort");
}

#[test]
fn host_memory_and_bad_splits_are_refused_on_cuda() {
    if cuda_devices_or_skip("permute cuda refusals").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let host_input = [1u8; 4 * 8];
    let dout = gpu.upload(&[POISON; 32]);
    let dmap = gpu.upload(&[0u8; 32]);
    let args = SortChunksArgs {
        input: Tensor::new(host_input.as_ptr() as u64, DType::U8, &[4, 8]),
        map: Tensor::new(dmap, DType::I64, &[4]),
        probs: None,
        direction: Direction::Forward,
        output: Tensor::new(dout, DType::U8, &[4, 8]),
        permuted_probs: None,
        in_place: false,
    };
    // SAFETY: the refused call touches nothing.
    let err = unsafe { call::sort_chunks_by_map(&gpu.target(false), &args) }.unwrap_err();
    assert!(err.to_string().contains("input at"), "{err}");
    assert_eq!(gpu.download(dout, 32), vec![POISON; 32]);
    // A split that is not a permutation: a clear error, map untouched.
    let bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let sz = gpu.upload(&bytes(&[1, 1]));
    let so = gpu.upload(&bytes(&[1, 1]));
    let m = gpu.upload(&[POISON; 16]);
    let a = MakeChunkSortMapArgs {
        split_sizes: Tensor::new(sz, DType::I64, &[2]),
        sorted_indices: Tensor::new(so, DType::I64, &[2]),
        map: Tensor::new(m, DType::I64, &[2]),
    };
    // SAFETY: device buffers of the sizes given.
    let err = unsafe { call::make_chunk_sort_map(&gpu.target(false), &a) }.unwrap_err();
    assert!(err.to_string().contains("not a permutation"), "{err}");
    assert_eq!(gpu.download(m, 16), vec![POISON; 16]);
}

#[test]
fn a_bad_split_under_capture_leaves_the_map_untouched() {
    if cuda_devices_or_skip("permute cuda chunk map under capture").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let t = 600usize;
    // 300 chunks (more than one per thread), each case a valid split but
    // for one entry.
    let s = 300usize;
    let good_sizes: Vec<i64> = (0..s as i64).map(|i| i % 3).collect();
    let good_sorted: Vec<i64> = (0..s as i64).rev().collect();
    type Edit = fn(&mut Vec<i64>, &mut Vec<i64>);
    let cases: [(&str, Edit); 7] = [
        ("a negative size", |z, _| z[250] = -1),
        ("a size past T", |z, _| z[7] = 601),
        ("a size of i64::MAX", |z, _| z[299] = i64::MAX),
        ("sizes summing past T", |z, _| z[0] = 600),
        ("a repeated index", |_, o| o[280] = o[3]),
        ("an index past S", |_, o| o[0] = 300),
        ("a negative index", |_, o| o[150] = -2),
    ];
    for (what, edit) in cases {
        let (mut sizes, mut sorted) = (good_sizes.clone(), good_sorted.clone());
        edit(&mut sizes, &mut sorted);
        let sz = gpu.upload(&bytes(&sizes));
        let so = gpu.upload(&bytes(&sorted));
        let m = gpu.upload(&[POISON; 8 * 600]);
        let a = MakeChunkSortMapArgs {
            split_sizes: Tensor::new(sz, DType::I64, &[s as u64]),
            sorted_indices: Tensor::new(so, DType::I64, &[s as u64]),
            map: Tensor::new(m, DType::I64, &[t as u64]),
        };
        gpu.capture_and_replay(
            // SAFETY: device buffers of the sizes given.
            || unsafe { call::make_chunk_sort_map(&gpu.target(false), &a) },
            || {},
        );
        assert_eq!(gpu.download(m, 8 * t), vec![POISON; 8 * t], "{what}");
    }
    // The valid split: the device map equals the Host's.
    let map = chunk_map_on_both(&mut gpu, &good_sizes, &good_sorted, t, false);
    map.same(&gpu, "the valid split");
}

/// A fault put into a valid row-id map (host copies of map, tokens per
/// expert, offsets; E experts; N rows), and the fault bit it is.
struct BadMap {
    what: &'static str,
    fault: u32,
    /// Whether only the chunks can show it (`unpermute` has none).
    chunks_only: bool,
    edit: fn(&mut [i32], &mut [i64], &[i64], usize, usize),
}

/// Token `t`'s routes as (k, row, expert).
fn routes_of(map: &[i32], e: usize, t: usize) -> Vec<(usize, i32, i32)> {
    let row = &map[t * (2 * e + 1)..(t + 1) * (2 * e + 1)];
    (0..row[2 * e] as usize)
        .map(|k| (k, row[k], row[e + k]))
        .collect()
}

/// The first token with a route, and its first route's expert.
fn first_routed(map: &[i32], e: usize) -> (usize, usize) {
    let t = (0..).find(|&t| !routes_of(map, e, t).is_empty()).unwrap();
    (t, routes_of(map, e, t)[0].2 as usize)
}

const BAD_MAPS: [BadMap; 8] = [
    BadMap {
        what: "route count E + 1",
        fault: MapFaults::ROUTE_COUNT,
        chunks_only: false,
        edit: |m, _, _, e, _| {
            let (t, _) = first_routed(m, e);
            m[t * (2 * e + 1) + 2 * e] = e as i32 + 1;
        },
    },
    BadMap {
        what: "route count -1",
        fault: MapFaults::ROUTE_COUNT,
        chunks_only: false,
        edit: |m, _, _, e, _| m[2 * e] = -1,
    },
    BadMap {
        what: "expert E",
        fault: MapFaults::EXPERT,
        chunks_only: false,
        edit: |m, _, _, e, _| {
            let (t, _) = first_routed(m, e);
            m[t * (2 * e + 1) + e] = e as i32;
        },
    },
    BadMap {
        what: "row N",
        fault: MapFaults::ROW,
        chunks_only: false,
        edit: |m, _, _, e, n| {
            let (t, _) = first_routed(m, e);
            m[t * (2 * e + 1)] = n as i32;
        },
    },
    BadMap {
        what: "row -3",
        fault: MapFaults::ROW,
        chunks_only: false,
        edit: |m, _, _, e, _| {
            let (t, _) = first_routed(m, e);
            m[t * (2 * e + 1)] = -3;
        },
    },
    BadMap {
        what: "a row of another expert's chunk",
        fault: MapFaults::CHUNK_ROW,
        chunks_only: true,
        edit: |m, tpe, off, e, _| {
            let (t, x) = first_routed(m, e);
            let other = (0..e).find(|&y| y != x && tpe[y] > 0).unwrap();
            m[t * (2 * e + 1)] = off[other] as i32;
        },
    },
    BadMap {
        what: "two tokens writing one row",
        fault: MapFaults::DUPLICATE_ROW,
        chunks_only: true,
        edit: |m, _, _, e, _| {
            let (t, x) = first_routed(m, e);
            let row = m[t * (2 * e + 1)];
            let (u, k) = (t + 1..)
                .find_map(|u| {
                    routes_of(m, e, u)
                        .into_iter()
                        .find(|r| r.2 as usize == x)
                        .map(|r| (u, r.0))
                })
                .unwrap();
            m[u * (2 * e + 1) + k] = row;
        },
    },
    BadMap {
        what: "tokens_per_expert[0] = i64::MAX",
        fault: MapFaults::COUNTS,
        chunks_only: true,
        edit: |_, tpe, _, _, _| tpe[0] = i64::MAX,
    },
];

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain integers, read as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        .to_vec()
}

/// A poisoned device output with `GUARD` poisoned bytes on either side:
/// an out-of-range write shows in the guards.
struct Guarded {
    base: u64,
    bytes: usize,
    dtype: DType,
    dims: Vec<u64>,
}

const GUARD: usize = 4096;

impl Guarded {
    fn new(gpu: &mut Gpu, dtype: DType, dims: &[u64]) -> Guarded {
        let bytes = dims.iter().product::<u64>() as usize * dtype.size_bytes();
        Guarded {
            base: gpu.upload(&vec![POISON; bytes + 2 * GUARD]),
            bytes,
            dtype,
            dims: dims.to_vec(),
        }
    }

    fn d(&self) -> Tensor {
        Tensor::new(self.base + GUARD as u64, self.dtype, &self.dims)
    }

    /// One guarded output per (dtype, dims), and their tensors.
    fn outputs(gpu: &mut Gpu, shapes: &[(DType, Vec<u64>)]) -> (Vec<Guarded>, Vec<Tensor>) {
        let outs: Vec<Guarded> = shapes
            .iter()
            .map(|(d, dims)| Guarded::new(gpu, *d, dims))
            .collect();
        let tensors = outs.iter().map(Guarded::d).collect();
        (outs, tensors)
    }

    fn guards_intact(&self, gpu: &Gpu, what: &str) {
        let all = gpu.download(self.base, self.bytes + 2 * GUARD);
        let (head, rest) = all.split_at(GUARD);
        let tail = &rest[self.bytes..];
        assert!(
            head.iter().chain(tail).all(|&b| b == POISON),
            "{what}: a write landed outside the output"
        );
    }

    fn untouched(&self, gpu: &Gpu, what: &str) {
        let all = gpu.download(self.base, self.bytes + 2 * GUARD);
        assert!(all.iter().all(|&b| b == POISON), "{what}: output written");
    }
}

/// A device's fault record is one word per module, shared by every call on
/// that device: the tests that read it run one at a time, so one test's bad
/// maps never show in another's record.
fn fault_record() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn bad_maps_never_write_out_of_range_and_cuda_reports_what_the_host_refuses() {
    if cuda_devices_or_skip("permute cuda bad maps").is_none() {
        return;
    }
    let _record = fault_record();
    let mut gpu = Gpu::new();
    let mut g = XorShift::new(99);
    let (t, e, h, topk) = (96usize, 8usize, 24usize, 3usize);
    let (tu, eu, hu) = (t as u64, e as u64, h as u64);
    let routing_map = routing(t, e, topk, &mut g);
    let host_map =
        xcall_permute::make_row_id_map(&routing_map, t, e, RowIdMapOptions::default()).unwrap();
    let n = host_map.expert_offsets[e] as usize;
    let nu = n as u64;
    let input = Pair::new(&mut gpu, f32s(t * h, &mut g), DType::F32, &[tu, hu]);
    let probs = Pair::new(&mut gpu, f32s(t * e, &mut g), DType::F32, &[tu, eu]);
    let fwd = Pair::new(&mut gpu, f32s(n * h, &mut g), DType::F32, &[nu, hu]);
    let pprobs_in = Pair::new(&mut gpu, f32s(n, &mut g), DType::F32, &[nu]);
    let grad = Pair::new(&mut gpu, f32s(t * h, &mut g), DType::F32, &[tu, hu]);
    let checked = Target {
        checked: true,
        ..gpu.target(false)
    };
    let unchecked = Target {
        checked: false,
        ..gpu.target(false)
    };
    // Nothing recorded before the cases (earlier tests had valid maps).
    call::take_faults(&unchecked).unwrap();

    // Each map through the default kernels, then (sm_90+) with permute
    // through the bulk-copy kernel, then unpermute through an async kernel.
    let bulk = bulk_configs("bad maps through the bulk-copy permute").unwrap_or_default();
    let passes: Vec<Vec<(&str, xcall_permute::cuda::LaunchConfig)>> = std::iter::once(vec![])
        .chain(bulk.iter().take(1).map(|&b| vec![("permute", b)]))
        .chain(std::iter::once(vec![("unpermute", async_configs()[0])]))
        .collect();
    for bad in &BAD_MAPS {
        let (mut m, mut tpe) = (host_map.map.clone(), host_map.tokens_per_expert.clone());
        (bad.edit)(&mut m, &mut tpe, &host_map.expert_offsets, e, n);
        let map = Pair::new(&mut gpu, bytes_of(&m), DType::I32, &[tu, 2 * eu + 1]);
        let tpe = Pair::new(&mut gpu, bytes_of(&tpe), DType::I64, &[eu]);
        let off = Pair::new(
            &mut gpu,
            bytes_of(&host_map.expert_offsets),
            DType::I64,
            &[eu + 1],
        );
        // Each op as (name, uses the chunks, output shapes, call on a
        // target: device inputs when `dev`, outputs `outs`).
        type Run<'a> = Box<dyn Fn(&Target, bool, &[Tensor]) -> Result<(), PermuteError> + 'a>;
        type Shapes = Vec<(DType, Vec<u64>)>;
        let ops: Vec<(&str, bool, Shapes, Run)> = vec![
            (
                "permute",
                true,
                vec![(DType::F32, vec![nu, hu]), (DType::F32, vec![nu])],
                Box::new(|tg, dev, outs| {
                    let pick = |p: &Pair| if dev { p.d() } else { p.h() };
                    // SAFETY: host vectors and device allocations of the
                    // tensors' sizes.
                    unsafe {
                        call::permute(
                            tg,
                            &PermuteArgs {
                                input: pick(&input),
                                row_id_map: pick(&map),
                                tokens_per_expert: pick(&tpe),
                                expert_offsets: pick(&off),
                                probs: Some(pick(&probs)),
                                scales: None,
                                output: outs[0].clone(),
                                permuted_probs: Some(outs[1].clone()),
                                permuted_scales: None,
                                in_place: false,
                                output_segments: None,
                            },
                        )
                    }
                }),
            ),
            (
                "unpermute",
                false,
                vec![(DType::F32, vec![tu, hu]), (DType::F32, vec![tu, eu])],
                Box::new(|tg, dev, outs| {
                    let pick = |p: &Pair| if dev { p.d() } else { p.h() };
                    // SAFETY: as above.
                    unsafe {
                        call::unpermute(
                            tg,
                            &UnpermuteArgs {
                                input: pick(&fwd),
                                row_id_map: pick(&map),
                                merging_probs: Some(pick(&probs)),
                                permuted_probs: Some(pick(&pprobs_in)),
                                output: outs[0].clone(),
                                unpermuted_probs: Some(outs[1].clone()),
                                input_segments: None,
                            },
                        )
                    }
                }),
            ),
            (
                "unpermute_backward",
                true,
                vec![(DType::F32, vec![nu, hu]), (DType::F32, vec![tu, eu])],
                Box::new(|tg, dev, outs| {
                    let pick = |p: &Pair| if dev { p.d() } else { p.h() };
                    // SAFETY: as above.
                    unsafe {
                        call::unpermute_backward(
                            tg,
                            &UnpermuteBackwardArgs {
                                grad: pick(&grad),
                                fwd_input: pick(&fwd),
                                row_id_map: pick(&map),
                                tokens_per_expert: pick(&tpe),
                                expert_offsets: pick(&off),
                                merging_probs: pick(&probs),
                                act_grad: outs[0].clone(),
                                probs_grad: outs[1].clone(),
                            },
                        )
                    }
                }),
            ),
        ];
        for (op, chunks, shapes, run) in &ops {
            if bad.chunks_only && !chunks {
                continue;
            }
            let what = format!("{op} with {}", bad.what);
            let host_outs: Vec<Vec<f32>> = shapes
                .iter()
                .map(|(_, dims)| vec![0f32; dims.iter().product::<u64>() as usize])
                .collect();
            let host_tensors: Vec<Tensor> = host_outs
                .iter()
                .zip(shapes)
                .map(|(o, (dtype, dims))| Tensor::of(o, *dtype, dims))
                .collect();
            let host = run(&Target::host(), false, &host_tensors).expect_err(&what);
            assert_eq!(host.status(), Status::InvalidArgument, "{what}: {host}");

            for forced in &passes {
                // A forced pass runs its op; the other ops ran in the first pass.
                if !forced.is_empty() && !forced.iter().any(|f| f.0 == *op) {
                    continue;
                }
                let what = format!("{what} (forced {forced:?})");
                // Unchecked: the call returns, nothing lands outside the
                // outputs, and the bounds faults are recorded.
                let (outs, tensors) = Guarded::outputs(&mut gpu, shapes);
                xcall_permute::cuda::with_configs(forced, || run(&unchecked, true, &tensors))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                for o in &outs {
                    o.guards_intact(&gpu, &what);
                }
                let seen = call::take_faults(&unchecked).unwrap();
                let bounds = MapFaults::ROUTE_COUNT | MapFaults::EXPERT | MapFaults::ROW;
                assert_eq!(seen.0, bad.fault & bounds, "{what}: recorded {seen}");
                assert!(
                    call::take_faults(&unchecked).unwrap().is_empty(),
                    "{what}: not cleared"
                );

                // Checked: the Host's status, a message naming the fault,
                // nothing written, nothing left recorded.
                let (outs, tensors) = Guarded::outputs(&mut gpu, shapes);
                let err =
                    xcall_permute::cuda::with_configs(forced, || run(&checked, true, &tensors))
                        .expect_err(&what);
                assert_eq!(err.status(), host.status(), "{what}: {err}");
                let named = MapFaults(bad.fault).to_string();
                assert!(
                    err.to_string().contains("checked on cuda:0")
                        && err.to_string().contains(&named),
                    "{what}: {err} (want {named})"
                );
                for o in &outs {
                    o.untouched(&gpu, &what);
                }
                assert!(call::take_faults(&unchecked).unwrap().is_empty(), "{what}");
            }
        }
    }
}

#[test]
fn checked_mode_passes_valid_maps_and_records_faults_under_capture() {
    if cuda_devices_or_skip("permute cuda checked mode").is_none() {
        return;
    }
    let _record = fault_record();
    let mut gpu = Gpu::new();
    let mut g = XorShift::new(5);
    let (t, e, h) = (200usize, 16usize, 40usize);
    let (tu, eu, hu) = (t as u64, e as u64, h as u64);
    let rmap = xcall_permute::make_row_id_map(
        &routing(t, e, 4, &mut g),
        t,
        e,
        RowIdMapOptions {
            align: Some(8),
            ..Default::default()
        },
    )
    .unwrap();
    let n = rmap.expert_offsets[e] as usize;
    let nu = n as u64;
    let map = Pair::new(&mut gpu, bytes_of(&rmap.map), DType::I32, &[tu, 2 * eu + 1]);
    let tpe = Pair::new(
        &mut gpu,
        bytes_of(&rmap.tokens_per_expert),
        DType::I64,
        &[eu],
    );
    let off = Pair::new(
        &mut gpu,
        bytes_of(&rmap.expert_offsets),
        DType::I64,
        &[eu + 1],
    );
    let input = Pair::new(&mut gpu, f32s(t * h, &mut g), DType::F32, &[tu, hu]);
    let out = Pair::poisoned(&mut gpu, DType::F32, &[nu, hu]);
    let args = |dev: bool, map: &Pair| {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        PermuteArgs {
            input: pick(&input),
            row_id_map: pick(map),
            tokens_per_expert: pick(&tpe),
            expert_offsets: pick(&off),
            probs: None,
            scales: None,
            output: pick(&out),
            permuted_probs: None,
            permuted_scales: None,
            in_place: false,
            output_segments: None,
        }
    };
    let checked = Target {
        checked: true,
        ..gpu.target(false)
    };
    // A valid, padded map passes the device check; results equal the Host.
    // SAFETY: host vectors and device allocations of the tensors' sizes.
    unsafe {
        call::permute(&Target::host(), &args(false, &map)).unwrap();
        call::permute(&checked, &args(true, &map)).unwrap();
    }
    out.same(&gpu, "checked permute");
    assert!(call::take_faults(&checked).unwrap().is_empty());
    assert_eq!(i64s(&tpe.host), rmap.tokens_per_expert);

    // Under capture the check is captured and records at replay.
    let mut bad = rmap.map.clone();
    let (tok, _) = first_routed(&bad, e);
    bad[tok * (2 * e + 1)] = n as i32 + 7;
    let bad = Pair::new(&mut gpu, bytes_of(&bad), DType::I32, &[tu, 2 * eu + 1]);
    gpu.capture_and_replay(
        // SAFETY: the captured call's buffers outlive the graph.
        || unsafe { call::permute(&checked, &args(true, &bad)) },
        || {
            assert!(
                call::take_faults(&checked).unwrap().is_empty(),
                "nothing ran yet"
            )
        },
    );
    let seen = call::take_faults(&checked).unwrap();
    // The route outside [0, N) is not counted for its expert either.
    assert_eq!(
        seen.0,
        MapFaults::ROW | MapFaults::COUNTS,
        "replay recorded {seen}"
    );
}

#[test]
fn tuning_trials_leave_the_real_outputs_untouched() {
    if cuda_devices_or_skip("permute tuning trials").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let mut g = XorShift::new(31);
    // A row of 280,000 bytes: a size class no other test tunes, so the
    // first call of each kernel here runs the trials.
    let (t, e, h) = (48usize, 4usize, 70_000usize);
    let (tu, eu, hu) = (t as u64, e as u64, h as u64);
    let rmap =
        xcall_permute::make_row_id_map(&routing(t, e, 2, &mut g), t, e, RowIdMapOptions::default())
            .unwrap();
    let n = rmap.expert_offsets[e] as usize;
    let nu = n as u64;
    let map = Pair::new(&mut gpu, bytes_of(&rmap.map), DType::I32, &[tu, 2 * eu + 1]);
    let tpe = Pair::new(
        &mut gpu,
        bytes_of(&rmap.tokens_per_expert),
        DType::I64,
        &[eu],
    );
    let off = Pair::new(
        &mut gpu,
        bytes_of(&rmap.expert_offsets),
        DType::I64,
        &[eu + 1],
    );
    let input = Pair::new(&mut gpu, f32s(t * h, &mut g), DType::F32, &[tu, hu]);
    let probs = Pair::new(&mut gpu, f32s(t * e, &mut g), DType::F32, &[tu, eu]);
    let permuted = Pair::poisoned(&mut gpu, DType::F32, &[nu, hu]);
    let back = Pair::poisoned(&mut gpu, DType::F32, &[tu, hu]);
    let act = Pair::poisoned(&mut gpu, DType::F32, &[nu, hu]);
    let pgrad = Pair::poisoned(&mut gpu, DType::F32, &[tu, eu]);
    let target = gpu.target(true);
    let stream = gpu.stream.cu_stream() as usize;

    // After each kernel's trials, before its real launch: the outputs the
    // caller passed still hold nothing but poison.
    let watch = |outs: Vec<(u64, usize)>| {
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let log = seen.clone();
        xcall_permute::cuda::set_after_tuning_hook(Some(Box::new(move |kernel: &str| {
            for &(address, bytes) in &outs {
                let mut host = vec![0u8; bytes];
                // SAFETY: the test's live stream of GPU 0; a live
                // allocation of `bytes` bytes of this context, copied after
                // the trials on the stream.
                unsafe {
                    let on = Stream::from_handle(Device::cuda(0), stream as u64);
                    on.sync().unwrap();
                    xcall_core::cuda::copy_dtoh_sync(Device::cuda(0), &mut host, address).unwrap();
                }
                assert!(
                    host.iter().all(|&b| b == POISON),
                    "{kernel}: a tuning trial wrote the caller's output at {address:#x}"
                );
            }
            log.borrow_mut().push(kernel.to_string());
        })));
        seen
    };
    let d = |p: &Pair| (p.device, p.host.len());
    let permuted_probs = Pair::poisoned(&mut gpu, DType::F32, &[nu]);
    let seen = watch(vec![d(&permuted), d(&permuted_probs)]);
    let permute = |tg: &Target, dev: bool| {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        // SAFETY: host vectors and device allocations of the tensors' sizes.
        unsafe {
            call::permute(
                tg,
                &PermuteArgs {
                    input: pick(&input),
                    row_id_map: pick(&map),
                    tokens_per_expert: pick(&tpe),
                    expert_offsets: pick(&off),
                    probs: Some(pick(&probs)),
                    scales: None,
                    output: pick(&permuted),
                    permuted_probs: Some(pick(&permuted_probs)),
                    permuted_scales: None,
                    in_place: false,
                    output_segments: None,
                },
            )
        }
    };
    permute(&target, true).unwrap();
    permute(&Target::host(), false).unwrap();
    permuted.same(&gpu, "tuned permute");
    permuted_probs.same(&gpu, "tuned permuted_probs");

    let seen_unpermute = watch(vec![d(&back)]);
    // SAFETY: as above.
    let unpermute = |tg: &Target, dev: bool| unsafe {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        call::unpermute(
            tg,
            &UnpermuteArgs {
                input: pick(&permuted),
                row_id_map: pick(&map),
                merging_probs: Some(pick(&probs)),
                permuted_probs: None,
                output: pick(&back),
                unpermuted_probs: None,
                input_segments: None,
            },
        )
    };
    unpermute(&target, true).unwrap();
    unpermute(&Target::host(), false).unwrap();
    back.same(&gpu, "tuned unpermute");

    let seen_backward = watch(vec![d(&act), d(&pgrad)]);
    // SAFETY: as above.
    let backward = |tg: &Target, dev: bool| unsafe {
        let pick = |p: &Pair| if dev { p.d() } else { p.h() };
        call::unpermute_backward(
            tg,
            &UnpermuteBackwardArgs {
                grad: pick(&back),
                fwd_input: pick(&permuted),
                row_id_map: pick(&map),
                tokens_per_expert: pick(&tpe),
                expert_offsets: pick(&off),
                merging_probs: pick(&probs),
                act_grad: pick(&act),
                probs_grad: pick(&pgrad),
            },
        )
    };
    backward(&target, true).unwrap();
    backward(&Target::host(), false).unwrap();
    act.same(&gpu, "tuned act_grad");
    pgrad.same(&gpu, "tuned probs_grad");
    xcall_permute::cuda::set_after_tuning_hook(None);
    let tuned: Vec<String> = [seen, seen_unpermute, seen_backward]
        .iter()
        .flat_map(|s| s.borrow().clone())
        .collect();
    assert_eq!(
        tuned,
        ["permute", "unpermute", "unpermute_backward"],
        "each kernel tuned once, here"
    );
}

/// Runs permute into `segs` (device buffers of `rows` rows of `row` bytes)
/// and unpermute from them into `y`, on Host (`host: true`, the segments
/// and `y` are host addresses) or CUDA.
#[allow(clippy::too_many_arguments)]
fn segmented_layer(
    target: &Target,
    (x, map, tpe, offsets, probs): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    segs: &[u64],
    rows: u64,
    y: &Tensor,
) -> Result<(), PermuteError> {
    let (dtype, h) = (x.dtype, x.dims[1]);
    let n = segs.len() as u64 * rows;
    let segments = Some(call::Segments {
        bases: segs.to_vec(),
        rows,
    });
    // SAFETY: every tensor and segment is a live allocation of its size
    // on the target's device.
    unsafe {
        call::permute(
            target,
            &PermuteArgs {
                input: x.clone(),
                row_id_map: map.clone(),
                tokens_per_expert: tpe.clone(),
                expert_offsets: offsets.clone(),
                probs: None,
                scales: None,
                output: Tensor::new(segs[0], dtype, &[n, h]),
                permuted_probs: None,
                permuted_scales: None,
                in_place: false,
                output_segments: segments.clone(),
            },
        )?;
        call::unpermute(
            target,
            &UnpermuteArgs {
                input: Tensor::new(segs[0], dtype, &[n, h]),
                row_id_map: map.clone(),
                merging_probs: Some(probs.clone()),
                permuted_probs: None,
                output: y.clone(),
                unpermuted_probs: None,
                input_segments: segments,
            },
        )
    }
}

#[test]
fn segmented_permute_and_unpermute_equal_the_host_eager_and_captured() {
    if cuda_devices_or_skip("permute cuda segments").is_none() {
        return;
    }
    use xcall_permute::cuda::with_configs;
    let bulk = bulk_configs("segmented permute through the bulk-copy kernel").unwrap_or_default();
    let mut gpu = Gpu::new();
    // (T, E, k, H, dtype, segments, rows per segment): full groups, a
    // group too small for its routes, odd row sizes (narrow vectors).
    for (seed, (t, e, k, h, dtype, s, rows)) in [
        (
            1u64,
            (
                300usize,
                16usize,
                4usize,
                1024u64,
                DType::Bf16,
                4usize,
                330u64,
            ),
        ),
        (2, (257, 8, 2, 72, DType::F32, 2, 200)),
        (3, (128, 32, 8, 3, DType::F16, 8, 40)),
        (4, (64, 4, 1, 4096, DType::Bf16, 1, 70)),
    ] {
        let mut g = XorShift::new(seed);
        let r = routing(t, e, k, &mut g);
        let groups = RowIdMapOptions {
            groups: Some(ExpertGroups {
                experts: e / s,
                rows: rows as usize,
            }),
            ..RowIdMapOptions::default()
        };
        let m = xcall_permute::make_row_id_map(&r, t, e, groups).unwrap();
        let (t64, e64) = (t as u64, e as u64);
        let x = Pair::new(
            &mut gpu,
            random_values(dtype, t * h as usize, &mut g),
            dtype,
            &[t64, h],
        );
        let map = Pair::new(&mut gpu, bytes_of(&m.map), DType::I32, &[t64, 2 * e64 + 1]);
        let tpe = Pair::new(&mut gpu, bytes_of(&m.tokens_per_expert), DType::I64, &[e64]);
        let offsets = Pair::new(
            &mut gpu,
            bytes_of(&m.expert_offsets),
            DType::I64,
            &[e64 + 1],
        );
        let probs = Pair::new(&mut gpu, f32s(t * e, &mut g), DType::F32, &[t64, e64]);
        let seg_dims = [rows, h];
        let mut host_segs: Vec<Pair> = (0..s)
            .map(|_| Pair::poisoned(&mut gpu, dtype, &seg_dims))
            .collect();
        let mut y = Pair::poisoned(&mut gpu, dtype, &[t64, h]);
        let host_bases: Vec<u64> = host_segs
            .iter_mut()
            .map(|p| p.host.as_mut_ptr() as u64)
            .collect();
        segmented_layer(
            &Target::host(),
            (&x.h(), &map.h(), &tpe.h(), &offsets.h(), &probs.h()),
            &host_bases,
            rows,
            &Tensor::new(y.host.as_mut_ptr() as u64, dtype, &[t64, h]),
        )
        .unwrap();
        let (xd, md, td, od, pd) = (x.d(), map.d(), tpe.d(), offsets.d(), probs.d());
        let bases: Vec<u64> = host_segs.iter().map(|p| p.device).collect();
        // Default, tuned, and through the bulk-copy kernel (sm_90+) and an
        // async unpermute (a staged source in a segment).
        let forced: Vec<_> = bulk
            .iter()
            .take(1)
            .map(|&b| ("permute", b))
            .chain([("unpermute", async_configs()[0])])
            .collect();
        for (autotune, forced) in [(false, &[][..]), (true, &[][..]), (false, &forced[..])] {
            with_configs(forced, || {
                segmented_layer(
                    &gpu.target(autotune),
                    (&xd, &md, &td, &od, &pd),
                    &bases,
                    rows,
                    &y.d(),
                )
            })
            .unwrap();
            for (i, seg) in host_segs.iter().enumerate() {
                seg.same(
                    &gpu,
                    &format!("seed {seed} autotune {autotune} forced {forced:?}: segment {i}"),
                );
            }
            y.same(
                &gpu,
                &format!("seed {seed} autotune {autotune} forced {forced:?}: y"),
            );
        }
        // Captured: re-poison, replay, compare again.
        let target = gpu.target(true);
        let poison_all = || {
            for p in host_segs.iter().chain(std::iter::once(&y)) {
                // On the test's stream, so the replay comes after it: a
                // plain cuMemset runs on the legacy stream, which this
                // non-blocking stream does not wait for.
                // SAFETY: a live allocation of this context of exactly
                // these bytes, on a live stream of that context.
                unsafe { gpu.on().memset_d8(p.device, POISON, p.host.len()) }.unwrap();
            }
        };
        gpu.capture_and_replay(
            || segmented_layer(&target, (&xd, &md, &td, &od, &pd), &bases, rows, &y.d()),
            poison_all,
        );
        for (i, seg) in host_segs.iter().enumerate() {
            seg.same(&gpu, &format!("seed {seed} captured: segment {i}"));
        }
        y.same(&gpu, &format!("seed {seed} captured: y"));
    }
}

#[test]
fn a_segment_in_host_memory_is_refused_on_cuda() {
    if cuda_devices_or_skip("permute cuda segments in host memory").is_none() {
        return;
    }
    let mut gpu = Gpu::new();
    let mut g = XorShift::new(9);
    let (t, e, h) = (16usize, 4usize, 8u64);
    let r = routing(t, e, 2, &mut g);
    let m = xcall_permute::make_row_id_map(&r, t, e, RowIdMapOptions::default()).unwrap();
    let n = m.out_rows as u64;
    let x = Pair::new(
        &mut gpu,
        f32s(t * h as usize, &mut g),
        DType::F32,
        &[t as u64, h],
    );
    let map = Pair::new(
        &mut gpu,
        bytes_of(&m.map),
        DType::I32,
        &[t as u64, 2 * e as u64 + 1],
    );
    let tpe = Pair::new(
        &mut gpu,
        bytes_of(&m.tokens_per_expert),
        DType::I64,
        &[e as u64],
    );
    let offsets = Pair::new(
        &mut gpu,
        bytes_of(&m.expert_offsets),
        DType::I64,
        &[e as u64 + 1],
    );
    let out = Pair::poisoned(&mut gpu, DType::F32, &[n, h]);
    let mut host = vec![0f32; (n * h) as usize];
    // Two segments of n/2 rows (n is even: 2 routes a token), the second in
    // host memory.
    let args = PermuteArgs {
        input: x.d(),
        row_id_map: map.d(),
        tokens_per_expert: tpe.d(),
        expert_offsets: offsets.d(),
        probs: None,
        scales: None,
        output: Tensor::new(out.device, DType::F32, &[n, h]),
        permuted_probs: None,
        permuted_scales: None,
        in_place: false,
        output_segments: Some(call::Segments {
            bases: vec![out.device, host.as_mut_ptr() as u64],
            rows: n / 2,
        }),
    };
    // SAFETY: the device tensors are live; the call is refused before it
    // touches the host segment.
    let e = unsafe { call::permute(&gpu.target(false), &args) }.unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.to_string().contains("output segment 1 at"), "{e}");
    out.same(&gpu, "a refused segmented permute");
}
