//! `xcall doctor`: what this machine offers xcall.

use std::io::{self, Write};

use xcall_core::{cuda, Device, Platform};

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Writes the report. Only a failure to write is an error: a machine without
/// CUDA is reported, not refused.
pub fn run(out: &mut impl Write) -> io::Result<()> {
    writeln!(out, "xcall {}", env!("CARGO_PKG_VERSION"))?;
    writeln!(out, "platforms:")?;
    writeln!(out, "  host  available, 1 device")?;
    let count = match cuda::device_count() {
        Ok(count) => count,
        Err(e) => {
            writeln!(out, "  cuda  unavailable: {e}")?;
            writeln!(
                out,
                "Host only: every xcall capability runs on the Host platform."
            )?;
            return Ok(());
        }
    };
    let driver = cuda::driver_version()
        .map(|(major, minor)| format!("driver supports CUDA {major}.{minor}"))
        .unwrap_or_else(|e| format!("driver version unknown: {e}"));
    writeln!(out, "  cuda  available, {count} device(s), {driver}")?;
    match cuda::nvrtc_version() {
        Ok((major, minor)) => writeln!(out, "nvrtc {major}.{minor}")?,
        Err(e) => writeln!(
            out,
            "nvrtc unavailable: {e} (CUDA kernels cannot be compiled)"
        )?,
    }
    writeln!(out, "cuda devices:")?;
    let devices: Vec<Device> = (0..count as u32)
        .map(|o| Device::new(Platform::Cuda, o))
        .collect();
    for &device in &devices {
        match cuda::device_info(device) {
            Ok(info) => writeln!(
                out,
                "  {device}  {}  {}  {} SMs  {:.1} GiB",
                info.name,
                info.arch(),
                info.multiprocessors,
                gib(info.total_memory)
            )?,
            Err(e) => writeln!(out, "  {device}  error: {e}")?,
        }
    }
    writeln!(out, "peer access (row can map column's memory directly):")?;
    write!(out, "       ")?;
    for to in &devices {
        write!(out, "{:>4}", to.ordinal)?;
    }
    writeln!(out)?;
    for &from in &devices {
        write!(out, "  {:>4} ", from.ordinal)?;
        for &to in &devices {
            let cell = match cuda::can_access_peer(from, to) {
                Ok(_) if from == to => "-",
                Ok(true) => "yes",
                Ok(false) => "no",
                Err(_) => "err",
            };
            write!(out, "{cell:>4}")?;
        }
        writeln!(out)?;
    }
    Ok(())
}
