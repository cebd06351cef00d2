//! `xcall doctor`: what this machine offers xcall, as text or as a JSON
//! report (`--json`).

use std::io::{self, Write};
use std::path::PathBuf;

use clap::Args;
use serde_json::json;
use xcall_core::{cuda, Device};

use crate::report::{envelope, Failure, JsonOut};

/// Flags of `xcall doctor`.
#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {
    /// Write the report as JSON instead of text: to PATH, or to stdout
    /// when no PATH (or `-`) is given.
    #[arg(long, value_name = "PATH", num_args = 0..=1, default_missing_value = "-")]
    json: Option<PathBuf>,
}

/// What doctor found: every field of both renderings.
struct Found {
    /// Why CUDA is unavailable, or the device count.
    cuda: Result<usize, String>,
    /// (major, minor) of the CUDA version the driver supports.
    driver: Result<(i32, i32), String>,
    nvrtc: Result<(i32, i32), String>,
    devices: Vec<Device>,
    /// `peer[from][to]`: `Some(can access)`, `None` when the query failed.
    peer: Vec<Vec<Option<bool>>>,
    /// The NCCL a world would load: (version, path, one-sided
    /// operations), or why none loads.
    nccl: Result<(String, String, bool), String>,
}

fn find() -> Found {
    let cuda = cuda::device_count().map_err(|e| e.to_string());
    let count = *cuda.as_ref().unwrap_or(&0);
    let devices: Vec<Device> = (0..count as u32).map(Device::cuda).collect();
    let peer = devices
        .iter()
        .map(|&from| {
            devices
                .iter()
                .map(|&to| cuda::can_access_peer(from, to).ok())
                .collect()
        })
        .collect();
    let (driver, nvrtc) = if cuda.is_ok() {
        (
            cuda::driver_version().map_err(|e| e.to_string()),
            cuda::nvrtc_version().map_err(|e| e.to_string()),
        )
    } else {
        let why = "CUDA is unavailable".to_string();
        (Err(why.clone()), Err(why))
    };
    let nccl = xcall_shmem::nccl::library()
        .map(|l| {
            (
                l.version().to_string(),
                l.path().display().to_string(),
                l.one_sided(),
            )
        })
        .map_err(|e| e.to_string());
    Found {
        cuda,
        driver,
        nvrtc,
        devices,
        peer,
        nccl,
    }
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Runs `xcall doctor`. Only a failure to write is an error: a machine
/// without CUDA is reported, not refused.
pub fn run(args: &DoctorArgs) -> Result<bool, Failure> {
    let to_file = match args.json.as_deref() {
        Some(p) if p.as_os_str() != "-" => Some(JsonOut::open(p)?),
        _ => None,
    };
    let found = find();
    let mut all = vec![Device::HOST];
    all.extend(&found.devices);
    match (&args.json, to_file) {
        (_, Some(out)) => out.write("doctor", &all, body(&found))?,
        (Some(_), None) => {
            let doc = envelope("doctor", &all, body(&found));
            let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
            println!("{text}");
        }
        (None, None) => text(&mut io::stdout().lock(), &found).map_err(|e| e.to_string())?,
    }
    Ok(true)
}

fn body(f: &Found) -> serde_json::Value {
    let version = |v: &Result<(i32, i32), String>| match v {
        Ok((major, minor)) => json!(format!("{major}.{minor}")),
        Err(_) => json!(null),
    };
    json!({
        "platforms": {
            "host": {"available": true, "devices": 1},
            "cuda": {
                "available": f.cuda.is_ok(),
                "devices": f.cuda.as_ref().map_or(0, |n| *n),
                "error": f.cuda.as_ref().err(),
                "driver_cuda_version": version(&f.driver),
                "nvrtc_version": version(&f.nvrtc),
                "nvrtc_error": f.cuda.is_ok().then(|| f.nvrtc.as_ref().err()).flatten(),
            },
        },
        "peer_access": f.peer,
        "nccl": match &f.nccl {
            Ok((version, path, one_sided)) => json!({
                "found": true, "version": version, "path": path, "one_sided": one_sided,
                "error": null,
            }),
            Err(e) => json!({
                "found": false, "version": null, "path": null, "one_sided": null, "error": e,
            }),
        },
    })
}

fn text(out: &mut impl Write, f: &Found) -> io::Result<()> {
    writeln!(out, "xcall {}", env!("CARGO_PKG_VERSION"))?;
    writeln!(out, "platforms:")?;
    writeln!(out, "  host  available, 1 device")?;
    let nccl = match &f.nccl {
        Ok((version, path, true)) => {
            format!("nccl {version} at {path} (one-sided put/signal: yes)")
        }
        Ok((version, path, false)) => {
            format!("nccl {version} at {path} (send/receive; one-sided put/signal needs NCCL 2.29)")
        }
        Err(e) => format!("nccl unavailable: {e} (needed only by CUDA worlds across hosts)"),
    };
    let count = match &f.cuda {
        Ok(count) => *count,
        Err(e) => {
            writeln!(out, "  cuda  unavailable: {e}")?;
            writeln!(out, "{nccl}")?;
            writeln!(
                out,
                "Host only: every xcall capability runs on the Host platform."
            )?;
            return Ok(());
        }
    };
    let driver = match f.driver {
        Ok((major, minor)) => format!("driver supports CUDA {major}.{minor}"),
        Err(ref e) => format!("driver version unknown: {e}"),
    };
    writeln!(out, "  cuda  available, {count} device(s), {driver}")?;
    match &f.nvrtc {
        Ok((major, minor)) => writeln!(out, "nvrtc {major}.{minor}")?,
        Err(e) => writeln!(
            out,
            "nvrtc unavailable: {e} (CUDA kernels cannot be compiled)"
        )?,
    }
    writeln!(out, "{nccl}")?;
    writeln!(out, "cuda devices:")?;
    for &device in &f.devices {
        match cuda::device_info(device) {
            Ok(info) => writeln!(
                out,
                "  {device}  {}  {}  {} SMs  {:.1} GiB  PCI {}",
                info.name,
                info.arch(),
                info.multiprocessors,
                gib(info.total_memory),
                info.pci_address
            )?,
            Err(e) => writeln!(out, "  {device}  error: {e}")?,
        }
    }
    writeln!(out, "peer access (row can map column's memory directly):")?;
    write!(out, "       ")?;
    for to in &f.devices {
        write!(out, "{:>4}", to.ordinal)?;
    }
    writeln!(out)?;
    for (i, from) in f.devices.iter().enumerate() {
        write!(out, "  {:>4} ", from.ordinal)?;
        for (j, cell) in f.peer[i].iter().enumerate() {
            let cell = match cell {
                Some(_) if i == j => "-",
                Some(true) => "yes",
                Some(false) => "no",
                None => "err",
            };
            write!(out, "{cell:>4}")?;
        }
        writeln!(out)?;
    }
    Ok(())
}
