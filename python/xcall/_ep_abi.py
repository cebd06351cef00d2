"""ctypes mirrors of the expert-parallel C ABI's structs (include/xcall.h),
shared by xcall.jax_ep and xcall.torch."""

import ctypes


class EpConfig(ctypes.Structure):
    """``xcall_ep_config``."""

    _fields_ = [
        (n, ctypes.c_uint64) for n in ("tokens", "hidden", "topk", "experts", "align", "capacity")
    ] + [("precision", ctypes.c_uint32), ("num_sms", ctypes.c_uint32)]


class EpSizes(ctypes.Structure):
    """``xcall_ep_sizes``."""

    _fields_ = [
        (n, ctypes.c_uint64)
        for n in (
            "heap_bytes",
            "local_experts",
            "expert_rows",
            "token_rows_bytes",
            "routing_bytes",
            "rows_bytes",
            "scales_bytes",
            "rows_bf16_bytes",
            "expert_out_bytes",
            "tokens_per_expert_bytes",
            "offsets_bytes",
        )
    ]
