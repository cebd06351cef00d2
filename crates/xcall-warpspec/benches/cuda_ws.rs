//! `mul` on 256 MiB per operand, side by side in one run: the
//! warp-specialized kernel with 1..4 stages, the plain vectorized kernel of
//! the same op and a device-to-device copy. GB/s count bytes read plus
//! bytes written; times are CUDA-event medians of interleaved rounds after
//! warm-up.

use cudarc::driver::{sys, CudaContext, DevicePtr};
use xcall_core::{cuda, DType, Device};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::{DeviceBuffers, Variant, WsKernels};
use xcall_warpspec::ops::OpConfig;

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
        inputs: &inputs,
        output: po,
        bytes: BYTES,
    };
    let s = stream.cu_stream();
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
            unsafe { sys::cuMemcpyDtoDAsync_v2(po, pa, BYTES as usize, s) }
                .result()
                .unwrap();
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
}
