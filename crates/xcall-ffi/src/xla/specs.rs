//! The op table: what each handler decodes (operands, results, scalars,
//! flags) and the permute call it makes.

use super::*;

/// The platform a handler serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Host,
    Cuda,
}

/// One operand or result: its name, and the `has_*` attribute that
/// switches it on (`None`: always present).
pub(super) struct Slot {
    pub(super) name: &'static str,
    pub(super) when: Option<&'static str>,
}

pub(super) const fn always(name: &'static str) -> Slot {
    Slot { name, when: None }
}

pub(super) const fn with(name: &'static str, flag: &'static str) -> Slot {
    Slot {
        name,
        when: Some(flag),
    }
}

/// Attributes every handler accepts.
pub(super) const COMMON_ATTRS: [&str; 1] = ["graph_cache"];

/// Attributes that are 0 or 1 (besides the `has_*` flags).
pub(super) const BOOL_ATTRS: [&str; 2] = ["graph_cache", "backward"];

/// An op's handler: its signature and how it runs.
pub(super) struct Spec {
    /// The target name (error prefix; the name `xcall_jax` registers).
    pub(super) name: &'static str,
    pub(super) args: &'static [Slot],
    pub(super) rets: &'static [Slot],
    /// Integer attributes besides the `has_*` flags and [`COMMON_ATTRS`].
    pub(super) scalars: &'static [&'static str],
    /// Traits reported on CUDA.
    pub(super) cuda_traits: u32,
    pub(super) run: fn(&Target, &Decoded) -> Result<(), PermuteError>,
}

/// A decoded call: operands, results and attributes by name.
pub(super) struct Decoded {
    pub(super) args: Vec<(&'static str, Tensor)>,
    pub(super) rets: Vec<(&'static str, Tensor)>,
    pub(super) attrs: Vec<(String, i64)>,
}

impl Decoded {
    pub(super) fn find<'a>(list: &'a [(&'static str, Tensor)], name: &str) -> Option<&'a Tensor> {
        list.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
    }

    /// An operand or result the signature always has.
    pub(super) fn req(&self, name: &str) -> Tensor {
        self.opt(name)
            .unwrap_or_else(|| unreachable!("{name} is in the signature"))
    }

    /// An operand or result switched on by a flag.
    pub(super) fn opt(&self, name: &str) -> Option<Tensor> {
        Self::find(&self.args, name)
            .or_else(|| Self::find(&self.rets, name))
            .cloned()
    }

    pub(super) fn attr(&self, name: &str, default: i64) -> i64 {
        self.attrs
            .iter()
            .find(|(n, _)| n == name)
            .map_or(default, |(_, v)| *v)
    }

    pub(super) fn flag(&self, name: &str) -> bool {
        self.attr(name, 0) != 0
    }
}

pub(super) fn non_negative(d: &Decoded, name: &str) -> Result<Option<usize>, PermuteError> {
    match d.attr(name, 0) {
        0 => Ok(None),
        v if v < 0 => Err(PermuteError::Shape(format!(
            "attribute {name} is negative ({v})"
        ))),
        v => Ok(Some(v as usize)),
    }
}

pub(super) fn run_make_row_id_map(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let cap = d.attr("num_out_tokens", -1);
    let args = call::MakeRowIdMapArgs {
        routing: d.req("routing"),
        options: RowIdMapOptions {
            num_out_tokens: (cap >= 0).then_some(cap as usize),
            align: non_negative(d, "align")?,
            capacity: non_negative(d, "capacity")?,
        },
        row_id_map: d.req("row_id_map"),
        tokens_per_expert: d.req("tokens_per_expert"),
        expert_offsets: d.req("expert_offsets"),
    };
    // SAFETY: XLA's buffers are valid for their shapes on the call's device
    // until the call's stream work completes.
    unsafe { call::make_row_id_map(t, &args) }
}

pub(super) fn run_permute(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::PermuteArgs {
        input: d.req("input"),
        row_id_map: d.req("row_id_map"),
        tokens_per_expert: d.req("tokens_per_expert"),
        expert_offsets: d.req("expert_offsets"),
        probs: d.opt("probs"),
        scales: d.opt("scales"),
        output: d.req("output"),
        permuted_probs: d.opt("permuted_probs"),
        permuted_scales: d.opt("permuted_scales"),
        in_place: false,
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::permute(t, &args) }
}

pub(super) fn run_unpermute(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::UnpermuteArgs {
        input: d.req("input"),
        row_id_map: d.req("row_id_map"),
        merging_probs: d.opt("merging_probs"),
        permuted_probs: d.opt("permuted_probs"),
        output: d.req("output"),
        unpermuted_probs: d.opt("unpermuted_probs"),
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::unpermute(t, &args) }
}

pub(super) fn run_unpermute_backward(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::UnpermuteBackwardArgs {
        grad: d.req("grad"),
        fwd_input: d.req("fwd_input"),
        row_id_map: d.req("row_id_map"),
        tokens_per_expert: d.req("tokens_per_expert"),
        expert_offsets: d.req("expert_offsets"),
        merging_probs: d.req("merging_probs"),
        act_grad: d.req("act_grad"),
        probs_grad: d.req("probs_grad"),
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::unpermute_backward(t, &args) }
}

pub(super) fn run_make_chunk_sort_map(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::MakeChunkSortMapArgs {
        split_sizes: d.req("split_sizes"),
        sorted_indices: d.req("sorted_indices"),
        map: d.req("map"),
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::make_chunk_sort_map(t, &args) }
}

pub(super) fn run_sort_chunks_by_map(t: &Target, d: &Decoded) -> Result<(), PermuteError> {
    let args = call::SortChunksArgs {
        input: d.req("input"),
        map: d.req("map"),
        probs: d.opt("probs"),
        direction: if d.flag("backward") {
            Direction::Backward
        } else {
            Direction::Forward
        },
        output: d.req("output"),
        permuted_probs: d.opt("permuted_probs"),
        in_place: false,
    };
    // SAFETY: see run_make_row_id_map.
    unsafe { call::sort_chunks_by_map(t, &args) }
}

pub(super) const CBC: u32 = TRAIT_COMMAND_BUFFER_COMPATIBLE;

pub(super) static MAKE_ROW_ID_MAP: Spec = Spec {
    name: "xcall_make_row_id_map",
    args: &[always("routing")],
    rets: &[
        always("row_id_map"),
        always("tokens_per_expert"),
        always("expert_offsets"),
    ],
    scalars: &["num_out_tokens", "align", "capacity"],
    cuda_traits: CBC,
    run: run_make_row_id_map,
};

pub(super) static PERMUTE: Spec = Spec {
    name: "xcall_permute",
    args: &[
        always("input"),
        always("row_id_map"),
        always("tokens_per_expert"),
        always("expert_offsets"),
        with("probs", "has_probs"),
        with("scales", "has_scales"),
    ],
    rets: &[
        always("output"),
        with("permuted_probs", "has_probs"),
        with("permuted_scales", "has_scales"),
    ],
    scalars: &[],
    cuda_traits: CBC,
    run: run_permute,
};

pub(super) static UNPERMUTE: Spec = Spec {
    name: "xcall_unpermute",
    args: &[
        always("input"),
        always("row_id_map"),
        with("merging_probs", "has_merging_probs"),
        with("permuted_probs", "has_permuted_probs"),
    ],
    rets: &[
        always("output"),
        with("unpermuted_probs", "has_permuted_probs"),
    ],
    scalars: &[],
    cuda_traits: CBC,
    run: run_unpermute,
};

pub(super) static UNPERMUTE_BACKWARD: Spec = Spec {
    name: "xcall_unpermute_backward",
    args: &[
        always("grad"),
        always("fwd_input"),
        always("row_id_map"),
        always("tokens_per_expert"),
        always("expert_offsets"),
        always("merging_probs"),
    ],
    rets: &[always("act_grad"), always("probs_grad")],
    scalars: &[],
    cuda_traits: CBC,
    run: run_unpermute_backward,
};

pub(super) static MAKE_CHUNK_SORT_MAP: Spec = Spec {
    name: "xcall_make_chunk_sort_map",
    args: &[always("split_sizes"), always("sorted_indices")],
    rets: &[always("map")],
    scalars: &[],
    // Outside a capture it reads the split back and waits for the stream.
    cuda_traits: 0,
    run: run_make_chunk_sort_map,
};

pub(super) static SORT_CHUNKS_BY_MAP: Spec = Spec {
    name: "xcall_sort_chunks_by_map",
    args: &[always("input"), always("map"), with("probs", "has_probs")],
    rets: &[always("output"), with("permuted_probs", "has_probs")],
    scalars: &["backward"],
    cuda_traits: CBC,
    run: run_sort_chunks_by_map,
};
