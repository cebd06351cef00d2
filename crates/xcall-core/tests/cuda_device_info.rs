//! `device_info` of every visible GPU: its PCI address has the form
//! `dddd:bb:dd.0`, no two GPUs share one, and each is one that nvidia-smi
//! lists (where nvidia-smi runs). Skips without a GPU unless
//! XCALL_REQUIRE_CUDA=1.

use xcall_core::testing::cuda_devices_or_skip;
use xcall_core::{cuda, Device};

/// nvidia-smi's PCI addresses (`00000000:19:00.0`) in `device_info`'s
/// form, or `None` where nvidia-smi does not run.
fn smi_addresses() -> Option<Vec<String>> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=pci.bus_id", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let (domain, rest) = l.trim().split_once(':')?;
            let domain = u32::from_str_radix(domain, 16).ok()?;
            Some(format!("{domain:04x}:{}", rest.to_ascii_lowercase()))
        })
        .collect()
}

#[test]
fn every_gpu_has_its_own_pci_address() {
    let Some(n) = cuda_devices_or_skip("cuda device info") else {
        return;
    };
    let addresses: Vec<String> = (0..n as u32)
        .map(|o| cuda::device_info(Device::cuda(o)).unwrap().pci_address)
        .collect();
    for a in &addresses {
        let parts: Vec<&str> = a.split([':', '.']).collect();
        assert!(
            parts.len() == 4
                && [4, 2, 2, 1] == [0, 1, 2, 3].map(|i| parts[i].len())
                && parts[3] == "0"
                && a.chars()
                    .all(|c| c == ':' || c == '.' || c.is_ascii_hexdigit())
                && !a.chars().any(|c| c.is_ascii_uppercase()),
            "{a}"
        );
    }
    for (i, a) in addresses.iter().enumerate() {
        assert!(!addresses[..i].contains(a), "cuda:{i} repeats {a}");
    }
    match smi_addresses() {
        Some(smi) => {
            for (i, a) in addresses.iter().enumerate() {
                assert!(smi.contains(a), "cuda:{i} at {a}: nvidia-smi lists {smi:?}");
            }
        }
        None => {
            eprintln!("note: cuda device info: nvidia-smi did not run; its addresses not compared")
        }
    }
}
