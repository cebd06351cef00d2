//! One way to launch a kernel: its parameters as [`KernelRecord`]s in 8-byte
//! slots (no positional lists that can drift from the kernel's signature),
//! the grid and block in a [`Launch`], the driver call checked.

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction};

use super::{check, ContextGuard, KernelRecord};
use crate::{Device, Result};

/// A kernel's parameters in order, each a [`KernelRecord`] starting at its
/// own 8-byte slot and spanning as many slots as it needs (the driver reads
/// a parameter's size from the kernel's signature at the slot's start).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Params {
    slots: Vec<u64>,
    /// The slot each parameter starts at.
    starts: Vec<usize>,
}

impl Params {
    /// No parameters yet.
    pub fn new() -> Params {
        Params::default()
    }

    /// A kernel parameter struct, passed by value (its bytes copied).
    pub fn record<R: KernelRecord>(mut self, value: &R) -> Params {
        let size = std::mem::size_of::<R>();
        // SAFETY: `KernelRecord` types have no padding, so all `size` bytes
        // of `value` are initialised; the slice lives as long as `value`.
        let bytes = unsafe { std::slice::from_raw_parts((value as *const R).cast::<u8>(), size) };
        self.starts.push(self.slots.len());
        self.slots.extend(bytes.chunks(8).map(|chunk| {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            u64::from_le_bytes(word)
        }));
        self
    }

    /// How many parameters there are.
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }
}

/// Where and how wide a kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
    /// The stream the launch is ordered on.
    pub stream: sys::CUstream,
}

impl Launch {
    /// `blocks` blocks of `threads` threads in one dimension, no dynamic
    /// shared memory.
    pub fn linear(blocks: u32, threads: u32, stream: sys::CUstream) -> Launch {
        Launch {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
            stream,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory per block.
    pub fn with_shared(self, bytes: u32) -> Launch {
        Launch {
            shared_bytes: bytes,
            ..self
        }
    }
}

/// Launches `function` on `device` (its primary context current for the
/// call, the caller's restored after it).
///
/// # Safety
/// `params` must match the kernel's signature (count, order, and each
/// parameter's size: at most 8 bytes, or a [`KernelRecord`] of the kernel's
/// parameter struct), every pointer in it must be valid for
/// what the kernel does with it, and the stream must belong to `device`.
pub unsafe fn launch(
    device: Device,
    function: &CudaFunction,
    config: Launch,
    params: &mut Params,
) -> Result<()> {
    let base = params.slots.as_mut_ptr();
    let mut pointers: Vec<*mut c_void> = params
        .starts
        .iter()
        // SAFETY: every start is an index into `slots` (pushed with it).
        .map(|&at| unsafe { base.add(at) }.cast())
        .collect();
    let guard = ContextGuard::primary(device)?;
    // SAFETY: the caller's contract on the parameters and the stream; every
    // slot outlives the call.
    let launched = unsafe {
        sys::cuLaunchKernel(
            function.cu_function(),
            config.grid.0,
            config.grid.1,
            config.grid.2,
            config.block.0,
            config.block.1,
            config.block.2,
            config.shared_bytes,
            config.stream,
            pointers.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    let restored = guard.restore();
    check("cuLaunchKernel", device, launched)?;
    restored
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::kernel_params! {
        /// Twelve bytes then eight: spans three slots.
        struct Three {
            /// First.
            a: u32 => "unsigned int",
            /// Second.
            b: i32 => "int",
            /// Third.
            c: f32 => "float",
            /// Fourth.
            d: i32 => "int",
            /// Fifth.
            e: u64 => "unsigned long long",
        }
    }

    crate::kernel_params! {
        /// One slot.
        struct One {
            /// The value.
            v: u64 => "unsigned long long",
        }
    }

    #[test]
    fn a_record_is_one_parameter_over_its_bytes() {
        let r = Three {
            a: 0x0102_0304,
            b: -1,
            c: 2.0,
            d: 7,
            e: 0xaabb_ccdd_eeff_0011,
        };
        let p = Params::new()
            .record(&One { v: 5 })
            .record(&r)
            .record(&One { v: 9 });
        assert_eq!(p.len(), 3);
        assert_eq!(p.starts, vec![0, 1, 4]);
        assert_eq!(
            p.slots,
            vec![
                5,
                0xffff_ffff_0102_0304,
                (7u64 << 32) | 2.0f32.to_bits() as u64,
                0xaabb_ccdd_eeff_0011,
                9
            ]
        );
    }

    #[test]
    fn linear_launches_fill_one_dimension() {
        let l = Launch::linear(5, 128, std::ptr::null_mut()).with_shared(1024);
        assert_eq!(l.grid, (5, 1, 1));
        assert_eq!(l.block, (128, 1, 1));
        assert_eq!(l.shared_bytes, 1024);
    }
}
