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
pub(super) const BOOL_ATTRS: [&str; 3] = ["graph_cache", "backward", "zero_unused"];

/// An op's handler: its signature and how it runs.
pub(super) struct Spec {
    /// The target name (error prefix; the name `xcall.jax` registers).
    pub(super) name: &'static str,
    pub(super) args: &'static [Slot],
    pub(super) rets: &'static [Slot],
    /// Integer attributes besides the `has_*` flags and [`COMMON_ATTRS`].
    pub(super) scalars: &'static [&'static str],
    /// Traits reported on CUDA.
    pub(super) cuda_traits: u32,
    /// Runs the op on a decoded call.
    ///
    /// # Safety
    /// The call's buffers are valid for their shapes on the target's
    /// device until the work enqueued on its stream completes.
    pub(super) run: unsafe fn(&Target, &Decoded) -> Result<(), FfiError>,
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

impl Source for Decoded {
    fn int_label(&self, name: &str) -> String {
        format!("attribute {name}")
    }

    fn tensor(&self, name: &'static str) -> Result<Option<Tensor>, FfiError> {
        Ok(self.opt(name))
    }

    fn int(&self, name: &'static str, default: i64) -> i64 {
        self.attr(name, default)
    }
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
    scalars: &[
        "num_out_tokens",
        "align",
        "capacity",
        "group_experts",
        "group_rows",
    ],
    cuda_traits: CBC,
    run: op_args::make_row_id_map,
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
    run: op_args::permute,
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
    run: op_args::unpermute,
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
    run: op_args::unpermute_backward,
};

pub(super) static MAKE_CHUNK_SORT_MAP: Spec = Spec {
    name: "xcall_make_chunk_sort_map",
    args: &[always("split_sizes"), always("sorted_indices")],
    rets: &[always("map")],
    scalars: &[],
    // Outside a capture it reads the split back and waits for the stream.
    cuda_traits: 0,
    run: op_args::make_chunk_sort_map,
};

pub(super) static SORT_CHUNKS_BY_MAP: Spec = Spec {
    name: "xcall_sort_chunks_by_map",
    args: &[always("input"), always("map"), with("probs", "has_probs")],
    rets: &[always("output"), with("permuted_probs", "has_probs")],
    scalars: &["backward"],
    cuda_traits: CBC,
    run: op_args::sort_chunks_by_map,
};
