//! The CUDA side: the steps of `kernels.cu`, compiled with NVRTC once per
//! device, launched on the caller's stream, and the group's words read
//! back.

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use xcall_core::cuda::{self, CudaFunction, KernelRecord, Launch, Params, RawStream};
use xcall_core::kernel_cache::LoadedModule;
use xcall_core::{Device, DeviceMap, KernelCache, KernelSource};

use crate::error::Result;
use crate::params::EpParams;

const SOURCE: &str = include_str!("kernels.cu");

/// The kernels' source: CONVERT, the parameter record's C definition,
/// then `kernels.cu`.
pub(crate) fn source() -> String {
    format!(
        "// Generated from xcall-ep's cuda.rs.\ntypedef unsigned long long u64;\n{}\n{}{SOURCE}",
        xcall_core::cuda::device::CONVERT,
        EpParams::c_definition(),
    )
}

/// One step: which kernel, and how it is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Publish,
    Push,
    Signal,
    Wait,
    Count,
    Scan,
    Assign,
    Copy,
    Reduce,
    GatherSum,
    ScatterGrad,
    GatherProbs,
    /// A whole dispatch (the low-latency kernels).
    LlDispatch,
    /// A whole combine (the low-latency kernels).
    LlCombine,
}

impl Step {
    const ALL: [Step; 14] = [
        Step::Publish,
        Step::Push,
        Step::Signal,
        Step::Wait,
        Step::Count,
        Step::Scan,
        Step::Assign,
        Step::Copy,
        Step::Reduce,
        Step::GatherSum,
        Step::ScatterGrad,
        Step::GatherProbs,
        Step::LlDispatch,
        Step::LlCombine,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Step::Publish => "ep_publish",
            Step::Push => "ep_push",
            Step::Signal => "ep_signal",
            Step::Wait => "ep_wait",
            Step::Count => "ep_count",
            Step::Scan => "ep_scan",
            Step::Assign => "ep_assign",
            Step::Copy => "ep_copy",
            Step::Reduce => "ep_reduce",
            Step::GatherSum => "ep_gather_sum",
            Step::ScatterGrad => "ep_scatter_grad",
            Step::GatherProbs => "ep_gather_probs",
            Step::LlDispatch => "ep_ll_dispatch",
            Step::LlCombine => "ep_ll_combine",
        }
    }

    /// Whether the kernel begins with the phase's wait (`ep_await`): it
    /// reads what peers wrote in the phase, so the wait step before it
    /// needs no kernel of its own.
    pub(crate) fn awaits(self) -> bool {
        matches!(
            self,
            Step::Count | Step::GatherSum | Step::ScatterGrad | Step::GatherProbs
        )
    }

    /// Whether the kernel runs one block per SM, every block resident at
    /// once (it meets at grid-wide barriers).
    #[cfg(test)]
    fn one_block_per_sm(self) -> bool {
        matches!(self, Step::LlDispatch | Step::LlCombine)
    }

    /// (blocks, threads) for the parameters `p` on a device of `sms` SMs.
    fn shape(self, p: &EpParams, sms: u32) -> (u32, u32) {
        let warps_for = |items: i64, threads: u32| {
            let per = (threads / 32) as i64;
            (((items + per - 1) / per).clamp(1, 65535) as u32, threads)
        };
        match self {
            Step::Publish => (p.n.clamp(1, 8 * sms as i64) as u32, 256),
            Step::Signal | Step::Wait => (1, 64),
            Step::Scan => (p.local_experts.clamp(1, 65535) as u32, 256),
            Step::Count | Step::Assign => warps_for(p.pes * p.tiles_per_pe, 256),
            // The steps that move rows to or from peers keep to the SM
            // budget (copy where it pulls).
            Step::Push | Step::Reduce | Step::ScatterGrad => (p.exchange_blocks as u32, 512),
            Step::Copy if p.pull != 0 => (p.exchange_blocks as u32, 512),
            Step::Copy | Step::GatherSum => (2 * sms, 512),
            Step::GatherProbs => (
                ((p.n * p.topk + 255) / 256).clamp(1, 4 * sms as i64) as u32,
                256,
            ),
            // One block per SM of the budget (exchange_blocks is two per
            // SM), each alone on its SM (`__launch_bounds__(512, 1)`), so
            // every block is resident at once for the grid-wide barriers.
            Step::LlDispatch | Step::LlCombine => {
                ((p.exchange_blocks / 2).clamp(1, sms as i64) as u32, 512)
            }
        }
    }
}

/// The kernels of one device.
pub(crate) struct Kernels {
    functions: Vec<CudaFunction>,
    /// Streaming multiprocessors of the device.
    pub sms: u32,
    /// Compute capability.
    pub capability: (i32, i32),
    _module: Arc<LoadedModule>,
}

struct State {
    cache: KernelCache,
    kernels: DeviceMap<Arc<Kernels>>,
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| State {
        cache: KernelCache::new(),
        kernels: DeviceMap::new(),
    })
}

/// The kernels of `device`, compiled once per device.
pub(crate) fn kernels(device: Device) -> Result<Arc<Kernels>> {
    let k = state().kernels.get_or_try_init(device, || {
        let info = cuda::device_info(device)?;
        let module = state().cache.module(
            device,
            &KernelSource {
                name: "xcall_ep.cu",
                code: &source(),
                options: &[],
            },
        )?;
        let functions = Step::ALL
            .iter()
            .map(|s| module.function(s.name()))
            .collect::<xcall_core::Result<Vec<_>>>()?;
        Ok::<_, xcall_core::Error>(Arc::new(Kernels {
            functions,
            sms: info.multiprocessors.max(1) as u32,
            capability: info.compute_capability,
            _module: module,
        }))
    })?;
    Ok(k.clone())
}

/// Enqueues `step` with `p` on `stream`.
///
/// # Safety
/// Every address in `p` is valid for what the step does with it while the
/// stream runs it (the group's contract, see `crate::host`).
pub(crate) unsafe fn launch(
    device: Device,
    k: &Kernels,
    step: Step,
    p: &EpParams,
    stream: *mut c_void,
) -> Result<()> {
    let at = Step::ALL
        .iter()
        .position(|s| *s == step)
        .expect("every step is listed");
    let (blocks, threads) = step.shape(p, k.sms);
    let mut params = Params::new().record(p);
    let config = Launch::linear(blocks, threads, stream as RawStream);
    // SAFETY: the kernel takes EpParams by value; the caller's contract.
    unsafe { cuda::launch(device, &k.functions[at], config, &mut params) }?;
    Ok(())
}

/// Reads `words` u64s at `addr` of `device` (after the caller's stream
/// finished what wrote them).
///
/// # Safety
/// `addr` holds `words.len()` readable u64s of `device`.
pub(crate) unsafe fn read_words(device: Device, addr: u64, words: &mut [u64]) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { cuda::copy_dtoh_sync(device, words, addr) }?;
    Ok(())
}

/// Writes `words` to `addr` of `device`, waiting for the copy.
///
/// # Safety
/// `addr` holds `words.len()` writable u64s of `device`.
pub(crate) unsafe fn write_words(device: Device, addr: u64, words: &[u64]) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { cuda::copy_htod_sync(device, addr, words) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module compiles with NVRTC for sm_90 and sm_80 (no FP8 there),
    /// no GPU needed.
    #[test]
    fn the_module_compiles_with_nvrtc() {
        if xcall_core::testing::nvrtc_or_skip("ep module with NVRTC").is_none() {
            return;
        }
        for arch in ["sm_90", "sm_80"] {
            xcall_core::testing::nvrtc_compiles("xcall_ep.cu", &source(), arch, &[]);
        }
    }

    #[test]
    fn the_kernels_that_await_the_phase_begin_with_its_wait_and_no_other_does() {
        for s in Step::ALL {
            let head = format!(") {}(EpParams p) {{\n    ep_await(p);", s.name());
            assert_eq!(SOURCE.contains(&head), s.awaits(), "{}", s.name());
        }
    }

    /// The words' indices in `kernels.cu` are [`crate::config::word`]'s.
    #[test]
    fn the_kernels_name_the_words_where_the_group_keeps_them() {
        use crate::config::word;
        for (name, at) in [
            ("TOKENS", word::TOKENS),
            ("EPOCH", word::EPOCH),
            ("ERROR", word::ERROR),
            ("DROPPED", word::DROPPED),
            ("BAR", word::BAR),
            ("PULL", word::PULL),
        ] {
            assert!(
                SOURCE.contains(&format!("#define EP_WORD_{name} {at}\n")),
                "EP_WORD_{name}"
            );
        }
        assert_eq!(word::COUNT, 6);
        assert!(SOURCE.contains(&format!("#define EP_MAX_PES {}\n", crate::MAX_PES)));
    }

    #[test]
    fn each_kernel_takes_the_record_and_reads_only_its_fields() {
        assert_eq!(EpParams::check_reads(SOURCE), Ok(()));
    }

    /// Each kernel declares the threads of its launches as its bound, so
    /// the compiler keeps its registers within what a block of them may
    /// hold (else the launch fails for lack of resources); the low-latency
    /// kernels also one block per SM.
    #[test]
    fn each_kernel_is_bounded_by_the_threads_it_is_launched_with() {
        let p = EpParams::default();
        for s in Step::ALL {
            let threads = s.shape(&p, 132).1;
            let bound = match s.one_block_per_sm() {
                true => format!("{threads}, 1"),
                false => threads.to_string(),
            };
            let want = format!(
                "__global__ void __launch_bounds__({bound}) {}(EpParams p)",
                s.name()
            );
            assert!(SOURCE.contains(&want), "{want}");
        }
    }

    /// The steps that move rows to or from peers run on the SM budget's
    /// blocks (copy only where it pulls), the low-latency kernels on one
    /// block per SM of it, the local ones on every SM.
    #[test]
    fn the_steps_that_move_rows_between_peers_keep_to_the_sm_budget() {
        let p = EpParams {
            exchange_blocks: 48,
            pes: 2,
            tiles_per_pe: 256,
            local_experts: 128,
            n: 8192,
            topk: 8,
            ..EpParams::default()
        };
        let pulled = EpParams { pull: 1, ..p };
        let few = EpParams { n: 100, ..p };
        let odd = EpParams {
            tiles_per_pe: 257,
            ..p
        };
        for (step, params, shape) in [
            (Step::Push, &p, (48, 512)),
            (Step::Reduce, &p, (48, 512)),
            (Step::ScatterGrad, &p, (48, 512)),
            (Step::Copy, &pulled, (48, 512)),
            (Step::Copy, &p, (264, 512)),
            (Step::GatherSum, &p, (264, 512)),
            (Step::LlDispatch, &p, (24, 512)),
            (Step::LlCombine, &p, (24, 512)),
            // A block per token, eight per SM at most.
            (Step::Publish, &p, (1056, 256)),
            (Step::Publish, &few, (100, 256)),
            (Step::Signal, &p, (1, 64)),
            (Step::Wait, &p, (1, 64)),
            (Step::Scan, &p, (128, 256)),
            // A warp per tile, 8 warps a block: 512 tiles, then 514.
            (Step::Count, &p, (64, 256)),
            (Step::Assign, &p, (64, 256)),
            (Step::Count, &odd, (65, 256)),
            // A thread per route, four blocks per SM at most.
            (Step::GatherProbs, &p, (256, 256)),
            (Step::GatherProbs, &few, (4, 256)),
        ] {
            assert_eq!(step.shape(params, 132), shape, "{}", step.name());
        }
    }
}
