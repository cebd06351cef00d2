//! The generated Hopper kernels against the Host executor. Skips without a
//! GPU unless XCALL_REQUIRE_CUDA=1; skips (loudly) on a non-Hopper GPU.

mod common;

use common::{decode, random_bytes};
use cudarc::driver::{CudaContext, DevicePtr};
use xcall_core::testing::{cuda_devices_or_skip, skip};
use xcall_core::{cuda, DType, Device, Status};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::{DeviceBuffers, Variant, WsKernels};
use xcall_warpspec::ops::{mul_host, silu_scale_host, GroupScales, HostExecutor, OpConfig, Scale};

fn hopper() -> Option<()> {
    cuda_devices_or_skip("warpspec cuda ops")?;
    let info = cuda::device_info(Device::cuda(0)).unwrap();
    if info.compute_capability.0 != 9 {
        skip(
            "warpspec cuda ops",
            &format!("{} is {}, not Hopper", info.name, info.arch()),
        );
        return None;
    }
    Some(())
}

#[test]
fn generated_kernels_equal_the_host_executor() {
    if hopper().is_none() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let kernels = WsKernels::new();
    let configs = [
        OpConfig {
            stages: 1,
            tile_bytes: 4096,
            compute_warpgroups: 1,
        },
        OpConfig {
            stages: 2,
            tile_bytes: 8192,
            compute_warpgroups: 2,
        },
        OpConfig {
            stages: 4,
            tile_bytes: 16384,
            compute_warpgroups: 2,
        },
        OpConfig {
            stages: 3,
            tile_bytes: 1040,
            compute_warpgroups: 1,
        },
    ];
    let mut seed = 7;
    for dtype in [DType::F32, DType::Bf16] {
        for config in &configs {
            for n in [1usize, 5, 1000, 65_536 + 3, (1 << 20) + 7] {
                for op in [ElementwiseOp::Mul, ElementwiseOp::SiluScale] {
                    seed += 1;
                    let a = random_bytes(dtype, n, seed);
                    let b = random_bytes(dtype, n, seed + 1000);
                    let mut want = vec![0u8; a.len()];
                    match op {
                        ElementwiseOp::Mul => {
                            mul_host(dtype, &a, &b, &mut want, config, HostExecutor::Vectorized)
                                .unwrap()
                        }
                        ElementwiseOp::SiluScale => silu_scale_host(
                            dtype,
                            &a,
                            Scale::One(0.75),
                            &mut want,
                            config,
                            HostExecutor::Vectorized,
                        )
                        .unwrap(),
                    }
                    let (da, db) = (
                        stream.clone_htod(&a).unwrap(),
                        stream.clone_htod(&b).unwrap(),
                    );
                    let out = stream.clone_htod(&vec![0xa5u8; a.len()]).unwrap(); // poisoned
                    let inputs: Vec<u64> = match op {
                        ElementwiseOp::Mul => {
                            vec![da.device_ptr(&stream).0, db.device_ptr(&stream).0]
                        }
                        ElementwiseOp::SiluScale => vec![da.device_ptr(&stream).0],
                    };
                    let bufs = DeviceBuffers {
                        sms: 0,
                        inputs: &inputs,
                        output: out.device_ptr(&stream).0,
                        bytes: a.len() as u64,
                        scales: None,
                        ragged: None,
                    };
                    for variant in [Variant::WarpSpecialized, Variant::Plain] {
                        let launch = Launch {
                            kernels: &kernels,
                            stream: &stream,
                            op,
                            dtype,
                            variant,
                            config,
                        };
                        // SAFETY: allocations of a.len() bytes.
                        let got = unsafe { launch.run(&bufs, 0.75, &out) };
                        let what = format!("{op:?} {dtype} {variant:?} {config:?} n={n}");
                        if op == ElementwiseOp::Mul {
                            assert_eq!(got, want, "{what}");
                        } else {
                            assert_silu_close(dtype, &got, &want, &what);
                        }
                    }
                }
            }
        }
    }
}

/// One kernel of one op on cuda:0's test stream.
struct Launch<'a> {
    kernels: &'a WsKernels,
    stream: &'a std::sync::Arc<cudarc::driver::CudaStream>,
    op: ElementwiseOp,
    dtype: DType,
    variant: Variant,
    config: &'a OpConfig,
}

impl Launch<'_> {
    /// Launches the kernel on `bufs` and returns the output's bytes.
    ///
    /// # Safety
    /// `bufs` are allocations of cuda:0 of the sizes they state, `out` the
    /// output among them.
    unsafe fn run(
        &self,
        bufs: &DeviceBuffers<'_>,
        scale: f32,
        out: &cudarc::driver::CudaSlice<u8>,
    ) -> Vec<u8> {
        // SAFETY: a live stream of cuda:0; the caller's promise on `bufs`.
        unsafe {
            self.kernels.launch(
                Device::cuda(0),
                self.stream.cu_stream(),
                self.op,
                self.dtype,
                self.variant,
                self.config,
                bufs,
                scale,
            )
        }
        .unwrap();
        let got = self.stream.clone_dtoh(out).unwrap();
        self.stream.synchronize().unwrap();
        got
    }
}

/// The CUDA kernels' fast exp and division against the Host's f32
/// definition: within 4e-6 (f32) or one bf16 step (8e-3) of the larger of
/// the value and 1, and NaN exactly where the Host has NaN.
fn assert_silu_close(dtype: DType, got: &[u8], want: &[u8], what: &str) {
    let tol = if dtype == DType::F32 { 4e-6 } else { 8e-3 };
    for (i, (g, w)) in decode(dtype, got)
        .iter()
        .zip(decode(dtype, want))
        .enumerate()
    {
        let close =
            (g.is_nan() && w.is_nan()) || g == &w || (g - w).abs() <= tol * w.abs().max(1.0);
        assert!(close, "{what}: element {i}: {g} vs {w}");
    }
}

/// One scale per group (an expert's block of rows): both kernels against
/// the Host executor, on groups that end mid-tile, groups smaller than a
/// tile, one group of an odd size, and inputs of every magnitude with
/// infinities and NaN.
#[test]
fn grouped_scales_equal_the_host() {
    if hopper().is_none() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let kernels = WsKernels::new();
    let configs = [
        OpConfig::default(),
        OpConfig {
            stages: 2,
            tile_bytes: 8192,
            compute_warpgroups: 4,
        },
    ];
    // (dtype, elements per group, groups)
    let cases = [
        (DType::Bf16, 7168 * 5, 6),
        (DType::F32, 2048 * 3, 5),
        (DType::F32, 12, 1000),
        (DType::Bf16, 1003, 1),
    ];
    let mut seed = 900;
    for (dtype, per_group, groups) in cases {
        for config in &configs {
            seed += 1;
            let n = per_group * groups;
            let mut v: Vec<f32> = xcall_core::testing::random_f32(n, seed)
                .into_iter()
                .map(|x| x * 40.0)
                .collect();
            for (i, special) in [
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                -100.0,
                100.0,
                0.0,
            ]
            .into_iter()
            .enumerate()
            {
                v[(i * 7919) % n] = special;
            }
            let x = common::encode(dtype, &v);
            let scales: Vec<f32> = (0..groups).map(|g| 0.5 + g as f32 * 0.25).collect();
            let group_bytes = per_group * dtype.size_bytes();
            let mut want = vec![0u8; x.len()];
            silu_scale_host(
                dtype,
                &x,
                Scale::PerGroup {
                    scales: &scales,
                    group_bytes,
                },
                &mut want,
                config,
                HostExecutor::Vectorized,
            )
            .unwrap();
            let dx = stream.clone_htod(&x).unwrap();
            let ds = stream.clone_htod(&scales).unwrap();
            let out = stream.clone_htod(&vec![0xa5u8; x.len()]).unwrap(); // poisoned
            let inputs = [dx.device_ptr(&stream).0];
            let bufs = DeviceBuffers {
                sms: 0,
                inputs: &inputs,
                output: out.device_ptr(&stream).0,
                bytes: x.len() as u64,
                scales: Some(GroupScales {
                    addr: ds.device_ptr(&stream).0,
                    group_bytes: group_bytes as u64,
                }),
                ragged: None,
            };
            for variant in [Variant::WarpSpecialized, Variant::Plain] {
                let launch = Launch {
                    kernels: &kernels,
                    stream: &stream,
                    op: ElementwiseOp::SiluScale,
                    dtype,
                    variant,
                    config,
                };
                // The scale 99 is ignored with grouped scales.
                // SAFETY: allocations of x.len() bytes and `groups` scales.
                let got = unsafe { launch.run(&bufs, 99.0, &out) };
                let what = format!("{dtype} {variant:?} {config:?} {groups} x {per_group}");
                assert_silu_close(dtype, &got, &want, &what);
            }
        }
    }
}

/// Ragged groups on both kernels against the Host executor on the same
/// data (the Host with the counts the kernel takes: negative as 0, cut at
/// the segment's end), poisoned outputs; rows past the groups keep the
/// poison. The MoE layout: one segment per sender, one group per expert.
/// Grids capped at a few SMs write the same.
#[test]
fn ragged_groups_equal_the_host_executor() {
    use xcall_warpspec::ops::{ragged_pieces, silu_scale_pieces_host, RaggedGroups};
    if hopper().is_none() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let kernels = WsKernels::new();
    let configs = [
        OpConfig::default(),
        OpConfig {
            stages: 2,
            tile_bytes: 8192,
            compute_warpgroups: 1,
        },
    ];
    // (dtype, row elements, rows per segment, segments, groups, count seed)
    let cases = [
        (DType::Bf16, 7168usize, 64usize, 1usize, 256usize, 1u64),
        (DType::Bf16, 4096, 300, 2, 4, 2),
        (DType::F32, 2048, 40, 3, 33, 3),
        (DType::F32, 4, 1000, 4, 2, 4),
        // More segments than a block has warps: every warp builds tables.
        (DType::Bf16, 1024, 20, 13, 3, 5),
    ];
    for (dtype, row, seg_rows, segments, groups, seed) in cases {
        let row_bytes = row * dtype.size_bytes();
        let bytes = segments * seg_rows * row_bytes;
        let x = random_bytes(dtype, bytes / dtype.size_bytes(), 1000 + seed);
        // Counts summing to about 3/4 of a segment, one negative, one
        // segment whose counts pass its end.
        let mut g = xcall_core::testing::XorShift::new(seed);
        let mut rows: Vec<i64> = (0..segments * groups)
            .map(|_| (g.next_u64() % (seg_rows * 3 / 2 / groups + 1) as u64) as i64)
            .collect();
        rows[groups / 2] = -5;
        rows[segments * groups - 1] += seg_rows as i64;
        let taken: Vec<i64> = rows
            .chunks(groups)
            .flat_map(|seg| {
                let mut left = seg_rows as i64;
                seg.iter()
                    .map(|&c| {
                        let n = c.max(0).min(left);
                        left -= n;
                        n
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let scales: Vec<f32> = (0..rows.len()).map(|i| 0.5 + i as f32 / 16.0).collect();
        let host_ragged = RaggedGroups {
            scales: 0,
            rows: 0,
            segments: segments as u64,
            groups: groups as u64,
            segment_bytes: (seg_rows * row_bytes) as u64,
            row_bytes: row_bytes as u64,
        };
        let pieces = ragged_pieces(&host_ragged, &taken, &scales).unwrap();
        let dx = stream.clone_htod(&x).unwrap();
        let ds = stream.clone_htod(&scales).unwrap();
        let dr = stream.clone_htod(&rows).unwrap();
        for config in &configs {
            let mut want = vec![0xa5u8; bytes];
            silu_scale_pieces_host(
                dtype,
                &x,
                &pieces,
                &mut want,
                config,
                HostExecutor::Vectorized,
            )
            .unwrap();
            // Every SM, and grids capped at 1 and 7 SMs (the persistent
            // blocks take more tiles each).
            let runs = [Variant::WarpSpecialized, Variant::Plain]
                .into_iter()
                .flat_map(|v| [0u32, 1, 7].map(|sms| (v, sms)));
            for (variant, sms) in runs {
                let out = stream.clone_htod(&vec![0xa5u8; bytes]).unwrap(); // poisoned
                let inputs = [dx.device_ptr(&stream).0];
                let bufs = DeviceBuffers {
                    sms,
                    inputs: &inputs,
                    output: out.device_ptr(&stream).0,
                    bytes: bytes as u64,
                    scales: None,
                    ragged: Some(RaggedGroups {
                        scales: ds.device_ptr(&stream).0,
                        rows: dr.device_ptr(&stream).0,
                        ..host_ragged
                    }),
                };
                let launch = Launch {
                    kernels: &kernels,
                    stream: &stream,
                    op: ElementwiseOp::SiluScale,
                    dtype,
                    variant,
                    config,
                };
                // SAFETY: allocations of `bytes` bytes and of every count
                // and scale.
                let got = unsafe { launch.run(&bufs, 99.0, &out) };
                let what = format!("{dtype} {variant:?} on {sms} SMs {config:?} {segments} x {groups} groups of {row}-element rows");
                assert_silu_close(dtype, &got, &want, &what);
            }
        }
    }
}

#[test]
fn bad_buffers_are_refused() {
    if hopper().is_none() {
        return;
    }
    let kernels = WsKernels::new();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let c = OpConfig::default();
    let run = |inputs: &[u64], output: u64, bytes: u64, dtype: DType| {
        let b = DeviceBuffers {
            sms: 0,
            inputs,
            output,
            bytes,
            scales: None,
            ragged: None,
        };
        // SAFETY: every call below is refused before anything launches.
        unsafe {
            kernels.launch(
                Device::cuda(0),
                stream.cu_stream(),
                ElementwiseOp::Mul,
                dtype,
                Variant::WarpSpecialized,
                &c,
                &b,
                1.0,
            )
        }
        .unwrap_err()
    };
    assert_eq!(
        run(&[0x1000, 0x2008], 0x3000, 64, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000], 0x3000, 64, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000, 0x2000], 0x1010, 64, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000, 0x2000], 0x3000, 6, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000, 0x2000], 0x3000, 64, DType::I32).status(),
        Status::Unsupported
    );
}
