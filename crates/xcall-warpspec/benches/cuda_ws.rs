//! Two tables, each side by side in one run with a device-to-device copy
//! of the same bytes:
//! - `mul` f32 on 256 MiB per operand: the warp-specialized kernel with
//!   1..4 stages, the plain vectorized kernel;
//! - `silu(x) * scale_e` at the MoE layer's shapes (rows = E x capacity,
//!   one scale per expert's block of rows, H in {2048, 4096, 7168}, bf16
//!   and f32): the plain kernel and the warp-specialized one with several
//!   stage, tile and compute-warpgroup counts.
//!
//! GB/s count bytes read plus bytes written; times are CUDA-event medians
//! of interleaved rounds after warm-up.

use cudarc::driver::{CudaContext, DevicePtr};
use xcall_core::cuda::Stream;
use xcall_core::{cuda, DType, Device};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::{DeviceBuffers, Variant, WsKernels};
use xcall_warpspec::ops::{GroupScales, OpConfig};

const BYTES: u64 = 256 << 20;
const ROUNDS: usize = 100;

fn main() {
    if xcall_core::testing::cuda_devices_or_skip("bench cuda_ws").is_none() {
        return;
    }
    let device = Device::cuda(0);
    let info = cuda::device_info(device).unwrap();
    if info.compute_capability.0 != 9 {
        xcall_core::testing::skip("bench cuda_ws", &format!("{} is not Hopper", info.name));
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: this bench orders its own work on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let n = (BYTES / 4) as usize;
    let fill: Vec<f32> = (0..n).map(|i| 1.0 + (i % 1000) as f32 * 1e-3).collect();
    let a = stream.clone_htod(&fill).unwrap();
    let b = stream.clone_htod(&fill).unwrap();
    let out = stream.clone_htod(&fill).unwrap();
    let (pa, pb, po) = (
        a.device_ptr(&stream).0,
        b.device_ptr(&stream).0,
        out.device_ptr(&stream).0,
    );
    let kernels = WsKernels::new();
    let inputs = [pa, pb];
    let bufs = DeviceBuffers {
        sms: 0,
        inputs: &inputs,
        output: po,
        bytes: BYTES,
        scales: None,
        ragged: None,
    };
    let s = stream.cu_stream();
    // SAFETY: the bench's live stream of `device`.
    let on = unsafe { Stream::from_raw(device, s) };
    let run = |variant: Variant, config: &OpConfig| {
        // SAFETY: a live stream of cuda:0; three allocations of BYTES bytes.
        unsafe {
            kernels.launch(
                device,
                s,
                ElementwiseOp::Mul,
                DType::F32,
                variant,
                config,
                &bufs,
                1.0,
            )
        }
        .unwrap();
    };
    let mut names = vec![
        "device-to-device copy (read+write)".to_string(),
        "plain vectorized (16 B loads/stores)".to_string(),
    ];
    let mut variants: Vec<Box<dyn FnMut() + '_>> = vec![
        Box::new(|| {
            // SAFETY: copies between two live allocations of BYTES bytes.
            unsafe { on.copy_dtod(po, pa, BYTES as usize) }.unwrap();
        }),
        Box::new(|| run(Variant::Plain, &OpConfig::default())),
    ];
    for stages in 1..=4 {
        for tile_bytes in [16384u32, 32768] {
            let config = OpConfig {
                stages,
                tile_bytes,
                compute_warpgroups: 2,
            };
            if config.plan(2).is_err() {
                continue;
            }
            names.push(format!(
                "warp-specialized, {stages} stage(s), {} KiB tiles",
                tile_bytes / 1024
            ));
            variants.push(Box::new(move || run(Variant::WarpSpecialized, &config)));
        }
    }
    let ms = xcall_core::testing::interleaved_medians(&ctx, &stream, ROUNDS, &mut variants);
    let copy_gbs = 2.0 * BYTES as f64 / ms[0] / 1e6;
    println!(
        "device: {} ({}), mul f32, {} MiB per operand, CUDA-event medians of {ROUNDS} interleaved rounds",
        info.name,
        info.arch(),
        BYTES >> 20
    );
    println!(
        "{:<44} {:>9} {:>9} {:>8}",
        "kernel", "ms", "GB/s", "vs copy"
    );
    for (i, (name, t)) in names.iter().zip(&ms).enumerate() {
        let gbs = if i == 0 {
            copy_gbs
        } else {
            3.0 * BYTES as f64 / t / 1e6
        };
        println!("{name:<44} {t:>9.3} {gbs:>9.1} {:>8.3}", gbs / copy_gbs);
    }
    drop((a, b, out));
    silu_tables(&ctx, &stream);
}

/// The expert op's configs the second table tries.
const SILU_CONFIGS: [(u32, u32, u32); 6] = [
    (4, 16384, 2),
    (4, 16384, 3),
    (4, 16384, 4),
    (2, 32768, 4),
    (6, 8192, 4),
    (3, 32768, 3),
];

/// `silu(x) * scale_e` over E experts' blocks of C rows of H elements.
fn silu_tables(
    ctx: &std::sync::Arc<CudaContext>,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) {
    let device = Device::cuda(0);
    let (experts, capacity) = (8usize, 2048usize);
    println!(
        "\nsilu(x) * scale_e, {experts} experts x {capacity} rows, one scale per expert; ratio over a copy of the same bytes"
    );
    println!(
        "{:<6} {:>5} {:>9} {:>9} {:>7} {}",
        "dtype",
        "H",
        "copy us",
        "copy GB/s",
        "plain",
        SILU_CONFIGS
            .iter()
            .map(|(s, t, w)| format!("{:>12}", format!("{s}x{}K,{w}wg", t / 1024)))
            .collect::<String>()
    );
    let kernels = WsKernels::new();
    for dtype in [DType::Bf16, DType::F32] {
        for hidden in [2048usize, 4096, 7168] {
            let rows = experts * capacity;
            let elems = rows * hidden;
            let bytes = (elems * dtype.size_bytes()) as u64;
            let fill: Vec<u8> = match dtype {
                DType::F32 => xcall_core::testing::random_f32(elems, 5)
                    .iter()
                    .flat_map(|v| (v * 4.0).to_le_bytes())
                    .collect(),
                _ => xcall_core::testing::random_f32(elems, 5)
                    .iter()
                    .flat_map(|v| ((((v * 4.0).to_bits()) >> 16) as u16).to_le_bytes())
                    .collect(),
            };
            let x = stream.clone_htod(&fill).unwrap();
            let y = stream.clone_htod(&fill).unwrap();
            let scales: Vec<f32> = (0..experts).map(|e| 0.5 + e as f32 * 0.125).collect();
            let ds = stream.clone_htod(&scales).unwrap();
            let (px, py) = (x.device_ptr(stream).0, y.device_ptr(stream).0);
            let inputs = [px];
            let bufs = DeviceBuffers {
                sms: 0,
                inputs: &inputs,
                output: py,
                bytes,
                scales: Some(GroupScales {
                    addr: ds.device_ptr(stream).0,
                    group_bytes: bytes / experts as u64,
                }),
                ragged: None,
            };
            let s = stream.cu_stream();
            // SAFETY: the bench's live stream of `device`.
            let on = unsafe { Stream::from_raw(device, s) };
            let run = |variant: Variant, config: &OpConfig| {
                // SAFETY: a live stream of cuda:0; two allocations of
                // `bytes` bytes and one of `experts` scales.
                unsafe {
                    kernels.launch(
                        device,
                        s,
                        ElementwiseOp::SiluScale,
                        dtype,
                        variant,
                        config,
                        &bufs,
                        0.0,
                    )
                }
                .unwrap();
            };
            let mut variants: Vec<Box<dyn FnMut() + '_>> = vec![
                Box::new(|| {
                    // SAFETY: copies between two live allocations of `bytes` bytes.
                    unsafe { on.copy_dtod(py, px, bytes as usize) }.unwrap();
                }),
                Box::new(|| run(Variant::Plain, &OpConfig::default())),
            ];
            for (stages, tile_bytes, compute_warpgroups) in SILU_CONFIGS {
                let config = OpConfig {
                    stages,
                    tile_bytes,
                    compute_warpgroups,
                };
                variants.push(Box::new(move || run(Variant::WarpSpecialized, &config)));
            }
            let ms = xcall_core::testing::interleaved_medians(ctx, stream, 30, &mut variants);
            drop(variants);
            let copy_gbs = 2.0 * bytes as f64 / ms[0] / 1e6;
            println!(
                "{:<6} {hidden:>5} {:>9.1} {copy_gbs:>9.1} {}",
                dtype.to_string(),
                ms[0] * 1e3,
                ms[1..]
                    .iter()
                    .enumerate()
                    .map(|(i, t)| format!("{:>w$.3}", ms[0] / t, w = if i == 0 { 7 } else { 12 }))
                    .collect::<Vec<_>>()
                    .join("")
            );
        }
    }
}
