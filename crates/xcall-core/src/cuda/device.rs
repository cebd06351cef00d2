//! Device-side helpers as CUDA C sources, prepended to a kernel's source
//! the way a parameter prelude is (`format!("{}{}{body}", MBARRIER,
//! BULK_COPY)`), so that no crate writes its own copy of them.
//!
//! Each source has an include guard: prepending one twice (for example
//! [`ALL`] and one of its parts) defines everything once. Typedefs `u32`
//! and `u64` (`unsigned int`, `unsigned long long`) come with them.

/// Shared-memory barriers, sm_90+: `smem_addr`, `mbar_init`, `mbar_inval`,
/// `mbar_arrive`, `mbar_arrive_expect_tx`, `mbar_try_wait` (parity, one
/// try), `mbar_wait` (parity), `fence_mbarrier_init`, `fence_proxy_async`.
pub const MBARRIER: &str = include_str!("device/mbarrier.cuh");

/// Bulk copies, sm_90+ (after [`MBARRIER`]): `bulk_load` (global ->
/// shared, completing on a barrier), `bulk_load_arrive` (expect_tx, then
/// the load), `bulk_store` (shared -> global), `bulk_commit`,
/// `bulk_wait_read<N>`, `bulk_wait<N>`.
pub const BULK_COPY: &str = include_str!("device/bulk_copy.cuh");

/// f32 <-> bf16 (`bf16_to_f32`, `f32_to_bf16`, `bf16x2_to_f32`,
/// `f32_to_bf16x2`; sm_80+) and fp8 (`fp8e5m2_to_f32` anywhere;
/// `fp8e4m3_to_f32`, `fp8e4m3x2_to_f32`, `f32_to_fp8e4m3`,
/// `f32x2_to_fp8e4m3x2`, `f32_to_fp8e5m2` on sm_89+),
/// rounding to nearest even.
pub const CONVERT: &str = include_str!("device/convert.cuh");

/// [`MBARRIER`], [`BULK_COPY`] and [`CONVERT`], in that order.
pub const ALL: &str = concat!(
    include_str!("device/mbarrier.cuh"),
    include_str!("device/bulk_copy.cuh"),
    include_str!("device/convert.cuh")
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every helper the docs name is defined in the source they name, and
    /// every source is guarded against a second inclusion.
    #[test]
    fn each_source_defines_what_its_doc_lists_under_a_guard() {
        let defines = |src: &str, name: &str| {
            src.lines().any(|l| {
                l.starts_with("__device__") && l.contains(&format!(" {name}("))
                    || l.starts_with("template") && l.contains(&format!(" {name}("))
            })
        };
        for name in [
            "smem_addr",
            "mbar_init",
            "mbar_inval",
            "mbar_arrive",
            "mbar_arrive_expect_tx",
            "mbar_try_wait",
            "mbar_wait",
            "fence_mbarrier_init",
            "fence_proxy_async",
        ] {
            assert!(defines(MBARRIER, name), "{name}");
        }
        for name in [
            "bulk_load",
            "bulk_load_arrive",
            "bulk_store",
            "bulk_commit",
            "bulk_wait_read",
            "bulk_wait",
        ] {
            assert!(defines(BULK_COPY, name), "{name}");
        }
        for name in [
            "bf16_to_f32",
            "f32_to_bf16",
            "bf16x2_to_f32",
            "f32_to_bf16x2",
            "fp8e5m2_to_f32",
            "fp8e4m3_to_f32",
            "fp8e4m3x2_to_f32",
            "f32_to_fp8e4m3",
            "f32x2_to_fp8e4m3x2",
            "f32_to_fp8e5m2",
        ] {
            assert!(defines(CONVERT, name), "{name}");
        }
        let mut guards = Vec::new();
        for src in [MBARRIER, BULK_COPY, CONVERT] {
            let guard = src
                .lines()
                .find_map(|l| l.strip_prefix("#ifndef "))
                .expect("an include guard");
            assert!(src.contains(&format!("#ifndef {guard}\n#define {guard}\n")));
            assert!(src.trim_end().ends_with("#endif"));
            guards.push(guard);
        }
        guards.dedup();
        assert_eq!(guards.len(), 3, "one guard per source");
        assert_eq!(ALL, format!("{MBARRIER}{BULK_COPY}{CONVERT}"));
    }
}
