//! A caller's buffer ([`Buf`]) and its checks: size, null, alignment.

use crate::error::{EpError, Result};

/// A caller's buffer: its address (Host memory on Host PEs, this PE's
/// device memory on CUDA) and its size in bytes. [`Buf::NONE`] for an
/// optional buffer left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Buf {
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes the caller owns from `addr`.
    pub bytes: usize,
}

impl Buf {
    /// No buffer.
    pub const NONE: Buf = Buf { addr: 0, bytes: 0 };

    /// `bytes` at `addr`.
    pub fn new(addr: u64, bytes: usize) -> Buf {
        Buf { addr, bytes }
    }
}

/// `b` holds at least `bytes` bytes (and is not null when it must hold
/// any) at an address aligned to `align`.
pub(crate) fn need(what: &str, b: Buf, bytes: usize, align: u64) -> Result<()> {
    if b.bytes < bytes {
        return Err(EpError::InvalidArgument(format!(
            "{what} holds {} bytes; this call needs {bytes}",
            b.bytes
        )));
    }
    if bytes > 0 && b.addr == 0 {
        return Err(EpError::InvalidArgument(format!("{what} is null")));
    }
    if b.addr % align != 0 {
        return Err(EpError::InvalidArgument(format!(
            "{what} at {:#x} is not {align}-byte aligned",
            b.addr
        )));
    }
    Ok(())
}

pub(crate) fn optional(what: &str, b: Buf, bytes: usize, align: u64) -> Result<()> {
    match b.addr {
        0 => Ok(()),
        _ => need(what, b, bytes, align),
    }
}
