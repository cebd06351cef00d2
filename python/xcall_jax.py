"""JAX bindings of xcall's MoE permutation ops, through XLA FFI.

Loads ``libxcall.so`` with ctypes, registers xcall's ready XLA FFI handlers
for the "cpu" and "CUDA" platforms and exposes the ops as JAX functions
(``jax.jit``, ``jax.grad`` through ``jax.custom_vjp``, ``jax.pmap`` and
``shard_map``: every device runs its own call on its own stream).

    import jax
    jax.config.update("jax_enable_x64", True)   # the ops exchange int64 tensors
    import xcall_jax as xj

    row_id_map, tokens_per_expert, expert_offsets = xj.make_row_id_map(routing)
    y, y_probs = xj.permute(x, row_id_map, tokens_per_expert, expert_offsets,
                            probs=probs, num_out_rows=T * topk)
    out = xj.unpermute(y, row_id_map, tokens_per_expert, expert_offsets,
                       merging_probs=probs)

The library is found at ``$XCALL_LIB``, else in this repository's
``target/release`` or ``target/debug`` (the newer), else by the dynamic loader.
Input/output aliases come from the library's alias table
(``xcall_permute_alias_table``); every xcall error reaches Python as an
exception carrying xcall's message (``jax.errors.JaxRuntimeError``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "load",
    "make_row_id_map",
    "permute",
    "unpermute",
    "unpermute_backward",
    "make_chunk_sort_map",
    "sort_chunks_by_map",
    "graph_stats",
    "clear_graphs",
    "alias_table",
]

# Op code (xcall_permute_op), handler symbol stem, operand names, result
# names, in the handlers' order (see include/xcall.h, xcall_xla_*).
_OPS = {
    "make_row_id_map": (
        0,
        ["routing"],
        ["row_id_map", "tokens_per_expert", "expert_offsets"],
    ),
    "permute": (
        1,
        ["input", "row_id_map", "tokens_per_expert", "expert_offsets", "probs", "scales"],
        ["output", "permuted_probs", "permuted_scales"],
    ),
    "unpermute": (
        2,
        ["input", "row_id_map", "merging_probs", "permuted_probs"],
        ["output", "unpermuted_probs"],
    ),
    "unpermute_backward": (
        3,
        ["grad", "fwd_input", "row_id_map", "tokens_per_expert", "expert_offsets", "merging_probs"],
        ["act_grad", "probs_grad"],
    ),
    "sort_chunks_by_map": (4, ["input", "map", "probs"], ["output", "permuted_probs"]),
    "make_chunk_sort_map": (5, ["split_sizes", "sorted_indices"], ["map"]),
}

_PLATFORM_CUDA = 1


class _Stats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "hits",
            "captures",
            "updates",
            "update_refusals",
            "instantiations",
            "evictions",
            "invalidations",
            "eager_host",
            "eager_disabled",
            "eager_caller_capturing",
            "eager_capture_in_progress",
            "eager_not_capturable",
            "eager_capture_failed",
            "entries",
            "nodes",
            "patches",
        )
    ]


class _AliasPair(ctypes.Structure):
    _fields_ = [("input", ctypes.c_char_p), ("output", ctypes.c_char_p)]


class _Target(ctypes.Structure):
    """``xcall_target``: platform, ordinal, stream."""

    _fields_ = [
        ("platform", ctypes.c_uint32),
        ("ordinal", ctypes.c_uint32),
        ("stream", ctypes.c_void_p),
    ]


_lib: Optional[ctypes.CDLL] = None


def _library_path() -> str:
    env = os.environ.get("XCALL_LIB")
    if env:
        return env
    root = pathlib.Path(__file__).resolve().parent.parent
    built = [root / "target" / p / "libxcall.so" for p in ("release", "debug")]
    built = [c for c in built if c.exists()]
    if built:
        # The most recent build, so a stale profile is never picked.
        return str(max(built, key=lambda c: c.stat().st_mtime))
    found = ctypes.util.find_library("xcall")
    if found:
        return found
    raise OSError(
        "xcall_jax: libxcall.so not found; build it (cargo build --release -p xcall-ffi) "
        "or point XCALL_LIB at it"
    )


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads libxcall.so (once) and registers every handler for "cpu" and
    "CUDA". Called by the first op; call it first to pick the library."""
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(path or _library_path())
    lib.xcall_xla_graph_cache.restype = ctypes.c_void_p
    lib.xcall_graph_cache_stats.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(_Target),
        ctypes.POINTER(_Stats),
    ]
    lib.xcall_graph_cache_clear.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(_Target),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    lib.xcall_permute_alias_table.argtypes = [
        ctypes.c_uint32,
        ctypes.POINTER(_AliasPair),
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t),
    ]
    lib.xcall_last_error_message.restype = ctypes.c_char_p
    for op in _OPS:
        for platform, suffix in (("cpu", "host"), ("CUDA", "cuda")):
            handler = getattr(lib, f"xcall_xla_{op}_{suffix}")
            jax.ffi.register_ffi_target(
                f"xcall_{op}", jax.ffi.pycapsule(handler), platform=platform
            )
    _lib = lib
    return lib


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        message = lib.xcall_last_error_message().decode()
        raise RuntimeError(f"xcall_jax: {what}: {message} (status {status})")


@functools.lru_cache(maxsize=None)
def alias_table(op: str) -> tuple:
    """(input, output) name pairs of ``op`` that may share memory, from the
    library (empty for every op of this family: no output may alias)."""
    lib = load()
    code = _OPS[op][0]
    count = ctypes.c_size_t(0)
    _check(lib, lib.xcall_permute_alias_table(code, None, 0, ctypes.byref(count)), "alias table")
    if count.value == 0:
        return ()
    pairs = (_AliasPair * count.value)()
    _check(
        lib,
        lib.xcall_permute_alias_table(code, pairs, count.value, ctypes.byref(count)),
        "alias table",
    )
    return tuple((p.input.decode(), p.output.decode()) for p in pairs)


def _aliases(op: str, args: list, rets: list) -> dict:
    """input_output_aliases for a call with these operand and result names."""
    return {
        args.index(i): rets.index(o) for i, o in alias_table(op) if i in args and o in rets
    }


def _require_x64() -> None:
    if not jax.config.jax_enable_x64:
        raise ValueError(
            "xcall_jax: the permutation ops exchange int64 tensors (tokens_per_expert, "
            "expert_offsets, chunk maps); enable 64-bit types first with "
            "jax.config.update('jax_enable_x64', True)"
        )


def _call(op: str, args: dict, results: dict, **attrs):
    """Calls handler ``op`` with the present operands and results (by name,
    in the handler's order) and integer attributes."""
    load()
    _require_x64()
    arg_names = [n for n in _OPS[op][1] if n in args]
    ret_names = [n for n in _OPS[op][2] if n in results]
    call = jax.ffi.ffi_call(
        f"xcall_{op}",
        [results[n] for n in ret_names],
        vmap_method="sequential",
        input_output_aliases=_aliases(op, arg_names, ret_names),
    )
    encoded = {
        k: (np.bool_(v) if isinstance(v, (bool, np.bool_)) else np.int64(v))
        for k, v in attrs.items()
    }
    return call(*[args[n] for n in arg_names], **encoded)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


def make_row_id_map(
    routing, *, num_out_tokens: int = -1, align: int = 0, capacity: int = 0, graph_cache=False
):
    """Row-id map of a ``[T, E]`` bool/uint8 routing map: ``(row_id_map
    [T, 2E+1] int32, tokens_per_expert [E] int64, expert_offsets [E+1]
    int64)``. ``num_out_tokens`` >= 0 drops routes past that row;
    ``align`` pads every expert chunk to a multiple; ``capacity`` gives
    every expert exactly that many rows (``E * capacity`` output rows)."""
    t, e = routing.shape
    return tuple(
        _call(
            "make_row_id_map",
            {"routing": routing},
            {
                "row_id_map": _sds((t, 2 * e + 1), jnp.int32),
                "tokens_per_expert": _sds((e,), jnp.int64),
                "expert_offsets": _sds((e + 1,), jnp.int64),
            },
            num_out_tokens=num_out_tokens,
            align=align,
            capacity=capacity,
            graph_cache=graph_cache,
        )
    )


def _permute_raw(x, row_id_map, tpe, offsets, probs, num_out_rows, graph_cache):
    args = {"input": x, "row_id_map": row_id_map, "tokens_per_expert": tpe, "expert_offsets": offsets}
    results = {"output": _sds((num_out_rows, x.shape[1]), x.dtype)}
    if probs is not None:
        args["probs"] = probs
        results["permuted_probs"] = _sds((num_out_rows,), jnp.float32)
    out = _call(
        "permute", args, results, has_probs=probs is not None, graph_cache=graph_cache
    )
    return (out[0], out[1]) if probs is not None else (out[0], None)


def _unpermute_raw(y, row_id_map, merging_probs, permuted_probs, graph_cache):
    t = row_id_map.shape[0]
    e = (row_id_map.shape[1] - 1) // 2
    args = {"input": y, "row_id_map": row_id_map}
    results = {"output": _sds((t, y.shape[1]), y.dtype)}
    if merging_probs is not None:
        args["merging_probs"] = merging_probs
    if permuted_probs is not None:
        args["permuted_probs"] = permuted_probs
        results["unpermuted_probs"] = _sds((t, e), jnp.float32)
    out = _call(
        "unpermute",
        args,
        results,
        has_merging_probs=merging_probs is not None,
        has_permuted_probs=permuted_probs is not None,
        graph_cache=graph_cache,
    )
    return (out[0], out[1]) if permuted_probs is not None else (out[0], None)


def unpermute_backward(grad, fwd_input, row_id_map, tokens_per_expert, expert_offsets,
                       merging_probs, *, graph_cache=False):
    """Backward of ``unpermute`` with merging probs: ``(act_grad [N, H],
    probs_grad [T, E] float32)``."""
    return tuple(
        _call(
            "unpermute_backward",
            {
                "grad": grad,
                "fwd_input": fwd_input,
                "row_id_map": row_id_map,
                "tokens_per_expert": tokens_per_expert,
                "expert_offsets": expert_offsets,
                "merging_probs": merging_probs,
            },
            {
                "act_grad": _sds(fwd_input.shape, fwd_input.dtype),
                "probs_grad": _sds(merging_probs.shape, jnp.float32),
            },
            graph_cache=graph_cache,
        )
    )


# permute: d input = unpermute of the output cotangent (each token sums its
# routes' rows); d probs = the permuted-probs cotangent scattered back,
# which the same unpermute call returns as its unpermuted_probs.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _permute(x, row_id_map, tpe, offsets, probs, num_out_rows, graph_cache):
    return _permute_raw(x, row_id_map, tpe, offsets, probs, num_out_rows, graph_cache)


def _permute_fwd(x, row_id_map, tpe, offsets, probs, num_out_rows, graph_cache):
    out = _permute_raw(x, row_id_map, tpe, offsets, probs, num_out_rows, graph_cache)
    return out, (row_id_map, probs is not None)


def _permute_bwd(num_out_rows, graph_cache, res, cotangents):
    row_id_map, has_probs = res
    g_out, g_probs = cotangents
    if has_probs and g_probs is None:
        g_probs = jnp.zeros((num_out_rows,), jnp.float32)
    dx, dprobs = _unpermute_raw(
        g_out, row_id_map, None, g_probs if has_probs else None, graph_cache
    )
    return dx, None, None, None, dprobs


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x, row_id_map, tokens_per_expert, expert_offsets, probs=None, *,
            num_out_rows: int, graph_cache=False):
    """Groups the rows of ``x`` ``[T, H]`` by expert into ``num_out_rows``
    rows (rows no route writes are zero). With ``probs`` ``[T, E]`` float32
    also returns each row's prob. Returns ``(output, permuted_probs or
    None)``; differentiable in ``x`` and ``probs``."""
    return _permute(x, row_id_map, tokens_per_expert, expert_offsets, probs,
                    int(num_out_rows), bool(graph_cache))


# unpermute: with merging probs the backward is xcall's unpermute_backward;
# without, it is permute of the cotangent into the forward's rows.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _unpermute(y, row_id_map, tpe, offsets, merging_probs, graph_cache):
    return _unpermute_raw(y, row_id_map, merging_probs, None, graph_cache)[0]


def _unpermute_fwd(y, row_id_map, tpe, offsets, merging_probs, graph_cache):
    out = _unpermute_raw(y, row_id_map, merging_probs, None, graph_cache)[0]
    return out, (y, row_id_map, tpe, offsets, merging_probs)


def _unpermute_bwd(graph_cache, res, g):
    y, row_id_map, tpe, offsets, merging_probs = res
    if merging_probs is None:
        dy, _ = _permute_raw(g, row_id_map, tpe, offsets, None, y.shape[0], graph_cache)
        return dy, None, None, None, None
    dy, dprobs = unpermute_backward(g, y, row_id_map, tpe, offsets, merging_probs,
                                    graph_cache=graph_cache)
    return dy, None, None, None, dprobs


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute(y, row_id_map, tokens_per_expert, expert_offsets, merging_probs=None, *,
              graph_cache=False):
    """Restores token order: ``out[t] = sum_k y[dst_k] * merging_probs[t,
    e_k]`` (weight 1 without merging probs), ``[T, H]``, accumulated in
    float32; differentiable in ``y`` and ``merging_probs``."""
    return _unpermute(y, row_id_map, tokens_per_expert, expert_offsets, merging_probs,
                      bool(graph_cache))


def make_chunk_sort_map(split_sizes, sorted_indices, num_tokens: int, *, graph_cache=False):
    """Chunk-sort map ``[num_tokens]`` int64 of ``split_sizes`` ``[S]`` and
    ``sorted_indices`` ``[S]`` (both int64)."""
    return _call(
        "make_chunk_sort_map",
        {"split_sizes": split_sizes, "sorted_indices": sorted_indices},
        {"map": _sds((num_tokens,), jnp.int64)},
        graph_cache=graph_cache,
    )[0]


def _sort_raw(x, sort_map, probs, backward, graph_cache):
    args = {"input": x, "map": sort_map}
    results = {"output": _sds(x.shape, x.dtype)}
    if probs is not None:
        args["probs"] = probs
        results["permuted_probs"] = _sds(probs.shape, jnp.float32)
    out = _call(
        "sort_chunks_by_map",
        args,
        results,
        has_probs=probs is not None,
        backward=backward,
        graph_cache=graph_cache,
    )
    return (out[0], out[1]) if probs is not None else (out[0], None)


# A scatter by a permutation is undone by the gather with the same map.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _sort(x, sort_map, probs, backward, graph_cache):
    return _sort_raw(x, sort_map, probs, backward, graph_cache)


def _sort_fwd(x, sort_map, probs, backward, graph_cache):
    return _sort_raw(x, sort_map, probs, backward, graph_cache), (sort_map, probs is not None)


def _sort_bwd(backward, graph_cache, res, cotangents):
    sort_map, has_probs = res
    g_out, g_probs = cotangents
    if has_probs and g_probs is None:
        g_probs = jnp.zeros(sort_map.shape, jnp.float32)
    dx, dprobs = _sort_raw(g_out, sort_map, g_probs if has_probs else None, not backward,
                           graph_cache)
    return dx, None, dprobs


_sort.defvjp(_sort_fwd, _sort_bwd)


def sort_chunks_by_map(x, sort_map, probs=None, *, backward=False, graph_cache=False):
    """Reorders the rows of ``x`` ``[T, H]`` by a chunk-sort map: scatter
    (``out[map[t]] = x[t]``) or, with ``backward``, gather. Returns
    ``(output, permuted_probs or None)``; differentiable in ``x`` and
    ``probs``."""
    return _sort(x, sort_map, probs, bool(backward), bool(graph_cache))


def graph_stats(device_ordinal: int) -> dict:
    """Counters of the handlers' graph cache for CUDA device
    ``device_ordinal`` (calls made with ``graph_cache=True``)."""
    lib = load()
    stats = _Stats()
    _check(
        lib,
        lib.xcall_graph_cache_stats(
            lib.xcall_xla_graph_cache(),
            ctypes.byref(_Target(_PLATFORM_CUDA, device_ordinal, None)),
            ctypes.byref(stats),
        ),
        "graph cache stats",
    )
    return {name: getattr(stats, name) for name, _ in _Stats._fields_}


def clear_graphs(device_ordinal: int) -> int:
    """Evicts the handlers' cached graphs of one CUDA device; returns how
    many."""
    lib = load()
    evicted = ctypes.c_size_t(0)
    _check(
        lib,
        lib.xcall_graph_cache_clear(
            lib.xcall_xla_graph_cache(),
            ctypes.byref(_Target(_PLATFORM_CUDA, device_ordinal, None)),
            ctypes.byref(evicted),
        ),
        "graph cache clear",
    )
    return evicted.value
