//! The caller's buffers: one ([`Buf`]) and its checks (size, null,
//! alignment), and the expert-major buffers dispatch writes
//! ([`ExpertMajor`]).

use xcall_core::Device;

use crate::config::{EpConfig, Layout, Precision, FP8_BLOCK};
use crate::error::{EpError, Result};
use crate::params::EpParams;

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

/// Where dispatch writes what a PE's experts receive: rows grouped by
/// local expert (expert `l`'s from row `offsets[l]`, a multiple of the
/// group's `align`), in (sender rank, token, top-k slot) order within an
/// expert. Rows between one expert's last and the next one's first
/// (alignment padding) are not written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertMajor {
    /// `[expert_rows, H]`: f32 or bf16 rows, or FP8 e4m3 bytes. FP8
    /// dispatch writes these with `scales`, `rows_bf16`, or all three:
    /// leave `rows` and `scales` out ([`Buf::NONE`]) where the experts
    /// read bf16 (nothing then writes the FP8 rows).
    pub rows: Buf,
    /// FP8 only, with `rows`: `[expert_rows, H / 128]` f32 scales of `rows`.
    pub scales: Buf,
    /// FP8 only, optional: `[expert_rows, H]` bf16 rows dequantized from
    /// the FP8 rows and their scales.
    pub rows_bf16: Buf,
    /// `[L]` i64: routes each local expert received (after the capacity).
    pub tokens_per_expert: Buf,
    /// Optional `[L]` i64: rows each expert's group spans (its count
    /// rounded up to `align`).
    pub padded_per_expert: Buf,
    /// Optional `[L + 1]` i64: each expert's first row, then the end of
    /// the last group.
    pub offsets: Buf,
}

impl ExpertMajor {
    /// Checks these buffers against what a dispatch of a group of `c`
    /// and `layout` writes.
    pub(crate) fn check(&self, c: &EpConfig, layout: &Layout) -> Result<()> {
        let out = self;
        let (rows, l, h) = (layout.expert_rows, layout.local_experts, c.hidden);
        // Checked by the layout: rows * H * 4 fits (see Layout::new).
        let rows_bytes = rows * h * c.precision.wire_bytes();
        match c.precision {
            // The FP8 rows with their scales, the bf16 rows, or both.
            Precision::Fp8Dispatch => {
                match (out.rows.addr, out.scales.addr, out.rows_bf16.addr) {
                    (0, 0, 0) => {
                        return Err(EpError::InvalidArgument(
                            "out.rows and out.rows_bf16 are both null: FP8 dispatch writes the FP8 rows with their scales, the bf16 rows, or both".into(),
                        ))
                    }
                    (0, s, _) if s != 0 => {
                        return Err(EpError::InvalidArgument(
                            "out.scales given without out.rows: the scales go with the FP8 rows".into(),
                        ))
                    }
                    (r, 0, _) if r != 0 => {
                        return Err(EpError::InvalidArgument(
                            "out.rows given without out.scales: FP8 rows need their scales".into(),
                        ))
                    }
                    _ => {}
                }
                optional("out.rows", out.rows, rows_bytes, 16)?;
                optional("out.scales", out.scales, rows * (h / FP8_BLOCK) * 4, 4)?;
                optional("out.rows_bf16", out.rows_bf16, rows * h * 2, 16)?;
            }
            _ => {
                need("out.rows", out.rows, rows_bytes, 16)?;
                if out.scales.addr != 0 || out.rows_bf16.addr != 0 {
                    return Err(EpError::InvalidArgument(
                        "out.scales and out.rows_bf16 are for FP8 dispatch only".into(),
                    ));
                }
            }
        }
        need("out.tokens_per_expert", out.tokens_per_expert, l * 8, 8)?;
        optional("out.padded_per_expert", out.padded_per_expert, l * 8, 8)?;
        optional("out.offsets", out.offsets, (l + 1) * 8, 8)
    }

    /// `p` writing into these buffers.
    pub(crate) fn writing(&self, p: EpParams) -> EpParams {
        EpParams {
            out: self.rows.addr,
            out_scales: self.scales.addr,
            out_bf16: self.rows_bf16.addr,
            tokens_per_expert: self.tokens_per_expert.addr,
            padded_per_expert: self.padded_per_expert.addr,
            expert_offsets: self.offsets.addr,
            ..p
        }
    }
}

/// Whether the peers of a pulled dispatch read this PE's `x` (its first
/// `bytes`) where it is, with no copy into the send rows (at `send_rows`):
/// every PE a thread of this process (`peers`, their devices; empty
/// otherwise), f32 or bf16, and `x` memory of `device` that every peer
/// may read ([`xcall_core::cuda::peer_readable`]).
pub(crate) fn in_place(
    c: &EpConfig,
    device: Device,
    peers: &[Device],
    x: Buf,
    bytes: usize,
    send_rows: u64,
) -> Result<bool> {
    if peers.is_empty()
        || c.precision == Precision::Fp8Dispatch
        || bytes == 0
        || x.addr == send_rows
    {
        return Ok(false);
    }
    Ok(xcall_core::cuda::peer_readable(
        device, peers, x.addr, bytes,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Peers in other processes, FP8 (quantized into the send rows), no
    /// rows, or rows already in the send rows: no driver query, no
    /// in-place read (without a GPU, a query would fail the call).
    #[test]
    fn only_bf16_or_f32_rows_of_one_process_outside_the_send_rows_are_asked_about() {
        let (a, b) = (Device::cuda(0), Device::cuda(1));
        let bf16 = EpConfig {
            precision: Precision::Bf16,
            ..EpConfig::new(8, 64, 2, 4)
        };
        let fp8 = EpConfig {
            precision: Precision::Fp8Dispatch,
            ..bf16
        };
        let x = Buf::new(0x10000, 1024);
        for (what, c, peers, bytes, send) in [
            ("other processes", &bf16, &[][..], 1024, 0x90000),
            ("FP8", &fp8, &[a, b][..], 1024, 0x90000),
            ("no rows", &bf16, &[a, b][..], 0, 0x90000),
            ("the send rows", &bf16, &[a, b][..], 1024, 0x10000),
        ] {
            assert_eq!(
                in_place(c, a, peers, x, bytes, send).ok(),
                Some(false),
                "{what}"
            );
        }
    }
}
