//! The kernel catalogue: every kernel of `kernels.cu` as a [`Kernel`]
//! value, with its name, its template arguments by name and the parameter
//! struct it takes. The modules' `extern "C"` instantiations are generated
//! from [`Kernel::of`], and the launches and the tuner name kernels by
//! value, so a new variant is one entry here.

use xcall_core::cuda::device::{BULK_COPY, CONVERT, MBARRIER};
use xcall_core::cuda::KernelRecord;
use xcall_core::{DType, Fp8};

use super::params::{
    self, ChunkMapParams, MapCheckParams, PermuteParams, RowIdMapParams, SortParams,
    UnpermuteParams,
};

/// The kernels' CUDA source: the bodies, and the kernels written out whole.
pub(super) const SOURCE: &str = include_str!("../kernels.cu");

/// Vector widths (bytes) of the movement kernels, widest first.
pub(super) const MOVE_WIDTHS: [usize; 5] = [16, 8, 4, 2, 1];
/// Vectors in flight per thread of the movement and unpermute kernels.
pub(super) const UNROLLS: [u32; 3] = [1, 2, 4];
/// Stages of the bulk-copy permute kernels (`permute_bulk_4`, `_8`).
pub(super) const BULK_STAGES: [u32; 2] = [4, 8];
/// Stages of unpermute's async kernels (`unpermute_a2_w_16_1`, ...).
pub(super) const ASYNC_STAGES: [u32; 2] = [2, 3];
/// The row-holding `unpermute_backward` kernels: (groups held per thread,
/// routes per batch).
pub(super) const HELD: [(u32, u32); 3] = [(4, 1), (4, 2), (8, 1)];
/// The kernel name infix of the warp-per-row variants (`permute_w_16_2`).
pub(super) const WARP_INFIX: &str = "w_";
/// Dot slots per thread of the warp-per-token backward (all 256 of a
/// token's slots in one warp).
pub(super) const BWD_WARP_SLOTS: u32 = 8;

/// Which module a kernel lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Family {
    /// Row-id map, chunk map, permute, zero fill, chunk sort.
    Movement,
    /// unpermute and its backward for one float dtype.
    Arith(DType),
}

/// The families every module is built for.
#[cfg(test)]
pub(super) const FAMILIES: [Family; 6] = [
    Family::Movement,
    Family::Arith(DType::Bf16),
    Family::Arith(DType::F16),
    Family::Arith(DType::F32),
    Family::Arith(DType::F8E4M3),
    Family::Arith(DType::F8E5M2),
];

/// How a movement or summing kernel lays its threads over rows: the
/// bodies' `V`, `U` and `WARP` template arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Lanes {
    /// Bytes per vector (`V`).
    pub width: usize,
    /// Vectors in flight per thread (`U`).
    pub unroll: u32,
    /// A warp per row rather than a block (`WARP`; the `w_` kernels).
    pub warp: bool,
}

impl Lanes {
    fn infix(self) -> &'static str {
        if self.warp {
            WARP_INFIX
        } else {
            ""
        }
    }
}

/// `unpermute_body`'s template arguments after `WARP` (see `kernels.cu`);
/// [`SUMMING`] is the plain summing path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct UnpermutePath {
    /// fp8 without probs: 1 maps a lone route's bytes (`one_`), 2 also sums
    /// two routes in f16 (`two_`); 0 otherwise (`FEW`).
    pub few: u32,
    /// Routes whose loads go out together: 1, or 2 (`l2_`; `LOADS`).
    pub loads: u32,
    /// Shared-memory stages of the async path, 0 without (`a{S}_`; `ASYNC`).
    pub async_stages: u32,
    /// Streaming loads of the routes' rows (`s_`; `STREAM`).
    pub stream: bool,
}

/// The plain summing path: every template argument after `WARP` at its
/// default.
pub(super) const SUMMING: UnpermutePath = UnpermutePath {
    few: 0,
    loads: 1,
    async_stages: 0,
    stream: false,
};

impl UnpermutePath {
    /// fp8's few-route paths (`one_`, `two_`).
    pub(super) const fn few(few: u32) -> Self {
        UnpermutePath { few, ..SUMMING }
    }
    /// The two-route-load path (`l2_`; float types, 16-byte vectors).
    pub(super) const LOADS2: Self = UnpermutePath {
        loads: 2,
        ..SUMMING
    };
    /// fp8's streaming-load path (`s_`; 16-byte vectors).
    pub(super) const STREAM: Self = UnpermutePath {
        stream: true,
        ..SUMMING
    };
    /// The async path with `stages` stages (`a{S}_`; a warp per token,
    /// 16-byte vectors, unroll 1).
    pub(super) const fn async_stages(stages: u32) -> Self {
        UnpermutePath {
            async_stages: stages,
            ..SUMMING
        }
    }

    /// The kernel name infix.
    fn infix(self) -> String {
        match self {
            UnpermutePath { few: 1, .. } => "one_".into(),
            UnpermutePath { few: 2, .. } => "two_".into(),
            UnpermutePath { loads: 2, .. } => "l2_".into(),
            UnpermutePath { stream: true, .. } => "s_".into(),
            UnpermutePath {
                async_stages: s @ 1..,
                ..
            } => format!("a{s}_"),
            _ => String::new(),
        }
    }

    /// The template arguments after `WARP`, positional, trailing defaults
    /// left out (`", 0, 2"` for [`Self::LOADS2`]).
    fn template_args(self) -> String {
        let args = [
            self.few.to_string(),
            self.loads.to_string(),
            self.async_stages.to_string(),
            self.stream.to_string(),
        ];
        let defaults = ["0", "1", "0", "false"];
        let kept = (0..args.len())
            .rev()
            .find(|&i| args[i] != defaults[i])
            .map_or(0, |i| i + 1);
        args[..kept].iter().map(|a| format!(", {a}")).collect()
    }
}

/// A kernel of `kernels.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Kernel {
    /// Row-id map pass 1: routes per expert per block of tokens.
    RimCount,
    /// Row-id map pass 2: block prefix sums per expert.
    RimScanBlocks,
    /// Row-id map pass 3: chunk starts.
    RimOffsets,
    /// Row-id map pass 4: the map.
    RimWrite,
    /// Checked mode's map check.
    RimCheck,
    /// Checked mode's route counts against the chunks.
    RimCheckCounts,
    /// The chunk sort's map.
    ChunkMap,
    /// Zero fill of the rows no route writes (`zero_V`).
    Zero {
        /// Bytes per vector.
        width: usize,
    },
    /// `permute_[w_]V_U`.
    Permute(Lanes),
    /// The bulk-copy permute (`permute_bulk_S`; sm_90 or newer).
    PermuteBulk {
        /// Shared-memory stages.
        stages: u32,
    },
    /// `sort_[w_]V_U`.
    Sort(Lanes),
    /// `unpermute_{path}[w_]V_U` for the element type `dtype`.
    Unpermute {
        /// The element type (the module's).
        dtype: DType,
        /// Threads over rows.
        lanes: Lanes,
        /// The summing path.
        path: UnpermutePath,
    },
    /// The block-per-token backward (`unpermute_bwd_V_U`; `U`: dot slots
    /// per thread).
    UnpermuteBwd {
        /// The element type.
        dtype: DType,
        /// Bytes per vector.
        width: usize,
        /// Dot slots per thread.
        unroll: u32,
    },
    /// The warp-per-token backward holding all 256 dot slots
    /// (`unpermute_bwd_w_V_8`).
    UnpermuteBwdWarp {
        /// The element type.
        dtype: DType,
        /// Bytes per vector.
        width: usize,
    },
    /// The row-holding backward (`unpermute_bwd_hG_R`; 16-byte groups).
    UnpermuteBwdHeld {
        /// The element type.
        dtype: DType,
        /// 16-byte groups each thread holds.
        held: u32,
        /// Routes per batch.
        routes: u32,
    },
}

/// The CUDA codec struct of a float type (`kernels.cu`).
fn codec_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::F8E4M3 => "F8E4M3",
        DType::F8E5M2 => "F8E5M2",
        _ => "BF16",
    }
}

/// The vector widths of an arithmetic module: 16 bytes and one element.
fn arith_widths(dtype: DType) -> [usize; 2] {
    [16, dtype.size_bytes()]
}

impl Kernel {
    /// The module the kernel lives in.
    pub(super) fn family(self) -> Family {
        match self {
            Kernel::Unpermute { dtype, .. }
            | Kernel::UnpermuteBwd { dtype, .. }
            | Kernel::UnpermuteBwdWarp { dtype, .. }
            | Kernel::UnpermuteBwdHeld { dtype, .. } => Family::Arith(dtype),
            _ => Family::Movement,
        }
    }

    /// The kernel's `extern "C"` name.
    pub(super) fn name(self) -> String {
        match self {
            Kernel::RimCount => "rim_count".into(),
            Kernel::RimScanBlocks => "rim_scan_blocks".into(),
            Kernel::RimOffsets => "rim_offsets".into(),
            Kernel::RimWrite => "rim_write".into(),
            Kernel::RimCheck => "rim_check".into(),
            Kernel::RimCheckCounts => "rim_check_counts".into(),
            Kernel::ChunkMap => "chunk_map".into(),
            Kernel::Zero { width } => format!("zero_{width}"),
            Kernel::Permute(l) => format!("permute_{}{}_{}", l.infix(), l.width, l.unroll),
            Kernel::PermuteBulk { stages } => format!("permute_bulk_{stages}"),
            Kernel::Sort(l) => format!("sort_{}{}_{}", l.infix(), l.width, l.unroll),
            Kernel::Unpermute { lanes: l, path, .. } => format!(
                "unpermute_{}{}{}_{}",
                path.infix(),
                l.infix(),
                l.width,
                l.unroll
            ),
            Kernel::UnpermuteBwd { width, unroll, .. } => {
                format!("unpermute_bwd_{width}_{unroll}")
            }
            Kernel::UnpermuteBwdWarp { width, .. } => {
                format!("unpermute_bwd_{WARP_INFIX}{width}_{BWD_WARP_SLOTS}")
            }
            Kernel::UnpermuteBwdHeld { held, routes, .. } => {
                format!("unpermute_bwd_h{held}_{routes}")
            }
        }
    }

    /// The body template instantiation the kernel calls, or `None` for a
    /// kernel `kernels.cu` writes out whole.
    fn body(self) -> Option<String> {
        Some(match self {
            Kernel::RimCount
            | Kernel::RimScanBlocks
            | Kernel::RimOffsets
            | Kernel::RimWrite
            | Kernel::RimCheck
            | Kernel::RimCheckCounts
            | Kernel::ChunkMap => return None,
            Kernel::Zero { width } => format!("zero_body<{width}>"),
            Kernel::Permute(l) => format!("permute_body<{}, {}, {}>", l.width, l.unroll, l.warp),
            Kernel::PermuteBulk { stages } => format!("permute_bulk_body<{stages}>"),
            Kernel::Sort(l) => format!("sort_body<{}, {}, {}>", l.width, l.unroll, l.warp),
            Kernel::Unpermute { dtype, lanes, path } => format!(
                "unpermute_body<{}, {}, {}, {}{}>",
                codec_name(dtype),
                lanes.width,
                lanes.unroll,
                lanes.warp,
                path.template_args()
            ),
            Kernel::UnpermuteBwd {
                dtype,
                width,
                unroll,
            } => format!(
                "unpermute_bwd_body<{}, {width}, {unroll}>",
                codec_name(dtype)
            ),
            Kernel::UnpermuteBwdWarp { dtype, width } => {
                format!("unpermute_bwd_warp_body<{}, {width}>", codec_name(dtype))
            }
            Kernel::UnpermuteBwdHeld {
                dtype,
                held,
                routes,
            } => format!(
                "unpermute_bwd_held_body<{}, {held}, {routes}>",
                codec_name(dtype)
            ),
        })
    }

    /// The name of the parameter struct the kernel takes (see `params.rs`).
    pub(super) fn params(self) -> &'static str {
        match self {
            Kernel::RimCount | Kernel::RimScanBlocks | Kernel::RimOffsets | Kernel::RimWrite => {
                RowIdMapParams::NAME
            }
            Kernel::RimCheck | Kernel::RimCheckCounts => MapCheckParams::NAME,
            Kernel::ChunkMap => ChunkMapParams::NAME,
            Kernel::Zero { .. } | Kernel::Permute(_) | Kernel::PermuteBulk { .. } => {
                PermuteParams::NAME
            }
            Kernel::Sort(_) => SortParams::NAME,
            Kernel::Unpermute { .. }
            | Kernel::UnpermuteBwd { .. }
            | Kernel::UnpermuteBwdWarp { .. }
            | Kernel::UnpermuteBwdHeld { .. } => UnpermuteParams::NAME,
        }
    }

    /// Every kernel of `family`'s module, in the order of its source.
    pub(super) fn of(family: Family) -> Vec<Kernel> {
        let mut k = Vec::new();
        let lanes = |width, unroll| {
            [false, true].map(|warp| Lanes {
                width,
                unroll,
                warp,
            })
        };
        match family {
            Family::Movement => {
                k.extend([
                    Kernel::RimCheck,
                    Kernel::RimCheckCounts,
                    Kernel::RimCount,
                    Kernel::RimScanBlocks,
                    Kernel::RimOffsets,
                    Kernel::RimWrite,
                    Kernel::ChunkMap,
                ]);
                for width in MOVE_WIDTHS {
                    for unroll in UNROLLS {
                        for l in lanes(width, unroll) {
                            k.extend([Kernel::Permute(l), Kernel::Sort(l)]);
                        }
                    }
                    k.push(Kernel::Zero { width });
                }
                k.extend(BULK_STAGES.map(|stages| Kernel::PermuteBulk { stages }));
            }
            Family::Arith(dtype) => {
                let fp8 = Fp8::of(dtype).is_some();
                let unpermute = |lanes, path| Kernel::Unpermute { dtype, lanes, path };
                for width in arith_widths(dtype) {
                    for unroll in UNROLLS {
                        for l in lanes(width, unroll) {
                            k.push(unpermute(l, SUMMING));
                            if !fp8 && width == 16 {
                                k.push(unpermute(l, UnpermutePath::LOADS2));
                            }
                        }
                        if fp8 {
                            // fp8: unpermute without probs only, and its
                            // paths for one or two routes per token and,
                            // with streaming loads, for three or more.
                            if width % 4 == 0 {
                                let paths = [
                                    UnpermutePath::few(1),
                                    UnpermutePath::few(2),
                                    UnpermutePath::STREAM,
                                ];
                                for path in paths {
                                    for l in lanes(width, unroll) {
                                        k.push(unpermute(l, path));
                                    }
                                }
                            }
                            continue;
                        }
                        k.push(Kernel::UnpermuteBwd {
                            dtype,
                            width,
                            unroll,
                        });
                    }
                    if width == 16 {
                        for stages in ASYNC_STAGES {
                            let l = Lanes {
                                width: 16,
                                unroll: 1,
                                warp: true,
                            };
                            k.push(unpermute(l, UnpermutePath::async_stages(stages)));
                        }
                    }
                    if !fp8 {
                        k.push(Kernel::UnpermuteBwdWarp { dtype, width });
                    }
                }
                if !fp8 {
                    // Row-holding backwards: 16-byte groups whatever the width.
                    for (held, routes) in HELD {
                        k.push(Kernel::UnpermuteBwdHeld {
                            dtype,
                            held,
                            routes,
                        });
                    }
                }
            }
        }
        k
    }
}

/// The `extern "C"` kernels of a module: each takes its parameter struct
/// and calls its body template.
fn instantiations(family: Family) -> String {
    Kernel::of(family)
        .into_iter()
        .filter_map(|k| {
            let body = k.body()?;
            Some(format!(
                "extern \"C\" __global__ void {}(const {} p) {{ {body}(p); }}\n",
                k.name(),
                k.params()
            ))
        })
        .collect()
}

/// The CUDA source of `family`'s module: the parameter structs, core's
/// barrier, bulk-copy and conversion helpers, the kernels and the family's
/// instantiations.
pub(super) fn module_source(family: Family) -> String {
    format!(
        "{}{MBARRIER}{BULK_COPY}{CONVERT}{SOURCE}\n{}",
        params::prelude(),
        instantiations(family)
    )
}

/// The NVRTC program name of `family`'s module.
pub(super) fn program_name(family: Family) -> String {
    match family {
        Family::Movement => "xcall_permute_movement.cu".to_string(),
        Family::Arith(d) => format!("xcall_permute_{d}.cu"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instantiations of every module, as the kernel list before the
    /// catalogue wrote them: the same kernels, names, structs and template
    /// arguments, byte for byte.
    const KNOWN: &str = include_str!("catalogue.known");

    #[test]
    fn the_instantiations_are_the_known_ones_byte_for_byte() {
        let mut text = String::new();
        for family in FAMILIES {
            text += &format!("// {family:?}\n{}", instantiations(family));
        }
        assert_eq!(text.lines().count(), 230);
        for (got, want) in text.lines().zip(KNOWN.lines()) {
            assert_eq!(got, want);
        }
        assert_eq!(text, KNOWN);
    }

    /// Every `extern "C"` kernel of `source` with the struct its signature
    /// takes.
    fn signatures(source: &str) -> Vec<(String, String)> {
        source
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .map(|rest| {
                let (name, after) = rest.split_once('(').expect("a parameter list");
                let params = after
                    .strip_prefix("const ")
                    .and_then(|a| a.split_once(' '))
                    .map_or("", |(t, _)| t);
                (name.to_string(), params.to_string())
            })
            .collect()
    }

    /// Each module's catalogue is the kernels its source defines, each
    /// once, with the struct its signature takes; the kernels written out
    /// whole are the Movement module's.
    #[test]
    fn each_catalogue_entry_is_a_kernel_of_its_module_with_its_struct() {
        let whole = signatures(SOURCE);
        assert_eq!(whole.len(), 7, "{whole:?}");
        for family in FAMILIES {
            let mut defined = signatures(&instantiations(family));
            if family == Family::Movement {
                defined.extend(whole.iter().cloned());
            }
            let mut listed: Vec<(String, String)> = Kernel::of(family)
                .into_iter()
                .inspect(|k| assert_eq!(k.family(), family, "{k:?}"))
                .map(|k| (k.name(), k.params().to_string()))
                .collect();
            defined.sort();
            listed.sort();
            let n = listed.len();
            listed.dedup();
            assert_eq!(listed.len(), n, "a name twice in {family:?}");
            assert_eq!(listed, defined, "{family:?}");
        }
    }

    #[test]
    fn named_template_arguments_render_positionally() {
        let l = Lanes {
            width: 16,
            unroll: 2,
            warp: true,
        };
        let k = |path| Kernel::Unpermute {
            dtype: DType::F8E4M3,
            lanes: l,
            path,
        };
        let cases = [
            (SUMMING, "unpermute_w_16_2", "<F8E4M3, 16, 2, true>"),
            (
                UnpermutePath::few(1),
                "unpermute_one_w_16_2",
                "<F8E4M3, 16, 2, true, 1>",
            ),
            (
                UnpermutePath::few(2),
                "unpermute_two_w_16_2",
                "<F8E4M3, 16, 2, true, 2>",
            ),
            (
                UnpermutePath::LOADS2,
                "unpermute_l2_w_16_2",
                "<F8E4M3, 16, 2, true, 0, 2>",
            ),
            (
                UnpermutePath::STREAM,
                "unpermute_s_w_16_2",
                "<F8E4M3, 16, 2, true, 0, 1, 0, true>",
            ),
            (
                UnpermutePath::async_stages(3),
                "unpermute_a3_w_16_2",
                "<F8E4M3, 16, 2, true, 0, 1, 3>",
            ),
        ];
        for (path, name, args) in cases {
            assert_eq!(k(path).name(), name);
            assert_eq!(k(path).body().unwrap(), format!("unpermute_body{args}"));
        }
        assert_eq!(
            Kernel::UnpermuteBwdWarp {
                dtype: DType::Bf16,
                width: 2
            }
            .name(),
            "unpermute_bwd_w_2_8"
        );
        assert_eq!(Kernel::RimCheck.body(), None);
    }
}
