"""xcall's MoE permutation ops as JAX functions, through XLA FFI.

Two levels:

- **token_dispatch / token_combine**: what an MoE layer calls. Inputs of
  shape ``[T, H]`` or ``[B, S, H]``; routing as a 0/1 map ``[T, E]`` or as
  top-k expert ids ``[T, K]`` (with ``num_experts``); probs ``[T, E]`` or
  ``[T, K]``; ``align`` padding and expert ``capacity``; differentiable in
  the input and the probs. ``num_groups=G`` dispatches each of G equal
  blocks of tokens on its own: with tokens sharded over G devices, every
  device runs its block with no communication.
- **The ops**: ``make_row_id_map``, ``permute``, ``unpermute``,
  ``unpermute_backward``, ``make_chunk_sort_map``, ``sort_chunks_by_map``,
  one XLA custom call each.

No global switch is needed: counts, offsets and maps are int32 by default
(``index_dtype=jnp.int64`` where ``jax_enable_x64`` is on). Every op works
under ``jax.jit``, ``jax.grad`` (the differentiable ones), ``jax.vmap``,
``shard_map`` and ``pmap``, and has a partitioning rule for ``jit`` over a
mesh: its group dim and its hidden dim may be sharded, and each shard then
runs its own call with no collective; a sharded token or row dim is
gathered first, as the op's result depends on every token. Every xcall
error reaches Python as an exception carrying xcall's message.

Expert parallelism across this process's devices (``ep_dispatch``,
``ep_combine``, ``ep_group``) lives in :mod:`xcall.jax_ep` and is
re-exported here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

import xcall as _xcall

__all__ = [
    "Dispatch",
    "token_dispatch",
    "token_combine",
    "make_row_id_map",
    "permute",
    "unpermute",
    "unpermute_backward",
    "make_chunk_sort_map",
    "sort_chunks_by_map",
    "load",
    "graph_stats",
    "clear_graphs",
    "alias_table",
    "EpDispatch",
    "EpGroup",
    "ep_group",
    "ep_dispatch",
    "ep_combine",
    "ep_close_all",
]

# ------------------------------------------------------------------ the ops

# Op code (xcall_permute_op), operands and results in the handler's order
# (include/xcall.h, xcall_xla_*), each with the dims of one group of one
# call: the factors of its partitioning rule. "h" (hidden) may be sharded;
# the rest are gathered. Every operand and result gets a leading group
# factor "g", which may be sharded too.
_OPS = {
    "make_row_id_map": (
        0,
        {"routing": "t e"},
        {"row_id_map": "t w", "tokens_per_expert": "e", "expert_offsets": "f"},
    ),
    "permute": (
        1,
        {
            "input": "t h",
            "row_id_map": "t w",
            "tokens_per_expert": "e",
            "expert_offsets": "f",
            "probs": "t e",
            "scales": "t s",
        },
        {"output": "n h", "permuted_probs": "n", "permuted_scales": "n s"},
    ),
    "unpermute": (
        2,
        {"input": "n h", "row_id_map": "t w", "merging_probs": "t e", "permuted_probs": "n"},
        {"output": "t h", "unpermuted_probs": "t e"},
    ),
    "unpermute_backward": (
        3,
        {
            "grad": "t h",
            "fwd_input": "n h",
            "row_id_map": "t w",
            "tokens_per_expert": "e",
            "expert_offsets": "f",
            "merging_probs": "t e",
        },
        {"act_grad": "n h", "probs_grad": "t e"},
    ),
    "sort_chunks_by_map": (
        4,
        {"input": "t h", "map": "t", "probs": "t"},
        {"output": "t h", "permuted_probs": "t"},
    ),
    "make_chunk_sort_map": (5, {"split_sizes": "s", "sorted_indices": "s"}, {"map": "t"}),
}

# Operands and results holding 64-bit integers. Without jax_enable_x64
# they travel as int32 pairs [..., 2] (low word, then the sign word),
# which the handlers read as the s64 values.
_INT64 = ("tokens_per_expert", "expert_offsets", "split_sizes", "sorted_indices", "map")

_SHARDABLE = ("g", "h")
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


_registered: Optional[ctypes.CDLL] = None


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads libxcall (see ``xcall.library_path``) and registers every
    handler for "cpu" and "CUDA", once. Called by the first op; call it
    first to pick the library."""
    global _registered
    if _registered is not None:
        return _registered
    lib = _xcall.load_library(path)
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
            jax.ffi.register_ffi_target(f"xcall_{op}", jax.ffi.pycapsule(handler), platform=platform)
    _registered = lib
    return lib


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        message = lib.xcall_last_error_message().decode()
        raise RuntimeError(f"xcall.jax: {what}: {message} (status {status})")


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


# ------------------------------------------------------ 64-bit integers


def _index_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype == np.int32:
        return dtype
    if dtype == np.int64:
        if not jax.config.jax_enable_x64:
            raise ValueError(
                "xcall.jax: index_dtype=int64 needs jax_enable_x64; the default int32 "
                "needs no switch"
            )
        return dtype
    raise ValueError(f"xcall.jax: index_dtype must be int32 or int64, not {dtype}")


def _wide(a):
    """An integer array as the handler's 64-bit operand: int64 as is,
    anything else as int32 pairs (value, sign word)."""
    a = jnp.asarray(a)
    if a.dtype == jnp.int64:
        return a
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise TypeError(f"xcall.jax: expected an integer array, got {a.dtype}")
    a = a.astype(jnp.int32)
    return jnp.stack([a, a >> 31], axis=-1)


def _narrow(a, dtype):
    """A 64-bit result back in ``dtype``: pairs give their low word, which
    holds the value (xcall bounds every row, count and offset by int32)."""
    if a.dtype == jnp.int64:
        return a if dtype == np.int64 else a.astype(dtype)
    return a[..., 0]


def _wide_spec(shape, index_dtype):
    if index_dtype == np.int64:
        return jax.ShapeDtypeStruct(tuple(shape), jnp.int64)
    return jax.ShapeDtypeStruct(tuple(shape) + (2,), jnp.int32)


# ------------------------------------------------- one call, then groups


def _attr(v):
    return np.bool_(v) if isinstance(v, (bool, np.bool_)) else np.int64(v)


def _single(op, arg_names, ret_names, attrs, result_specs):
    """One custom call over one group: operands by name in the handler's
    order, results given as ``result_specs(args) -> {name: spec}``."""

    def call(*arrays):
        load()
        args = dict(zip(arg_names, arrays))
        specs = result_specs(args)
        ffi = jax.ffi.ffi_call(
            f"xcall_{op}",
            [specs[n] for n in ret_names],
            vmap_method="sequential",
            input_output_aliases={
                arg_names.index(i): ret_names.index(o)
                for i, o in alias_table(op)
                if i in arg_names and o in ret_names
            },
        )
        return tuple(ffi(*arrays, **{k: _attr(v) for k, v in attrs}))

    return call


def _grouped(single):
    """``single`` over arrays with a leading group dim: one call per group
    (a shard holds few groups: one when they follow the devices)."""

    def run(*arrays):
        calls = [single(*[a[i] for a in arrays]) for i in range(arrays[0].shape[0])]
        return tuple(jnp.stack(results) for results in zip(*calls))

    return run


def _factors(op, names, rets, wide_names):
    def dims(table, n):
        f = "g " + table[n]
        return f + " p" if n in wide_names else f

    return [dims(_OPS[op][1], n) for n in names], [dims(_OPS[op][2], n) for n in rets]


def _mesh_axes(ins, shardings):
    """{factor: mesh axes} of the shardable factors, from the operands'
    shardings (the first operand that shards a factor names its axes; the
    hidden dim gives way to the group dim on a shared axis)."""
    found = {}
    for factors, sharding in zip(ins, shardings):
        spec = tuple(getattr(sharding, "spec", ()) or ())
        for i, f in enumerate(factors.split()):
            if f in _SHARDABLE and f not in found and i < len(spec) and spec[i] is not None:
                found[f] = spec[i]
    if "h" in found and "g" in found:
        g = found["g"] if isinstance(found["g"], tuple) else (found["g"],)
        h = found["h"] if isinstance(found["h"], tuple) else (found["h"],)
        if set(g) & set(h):
            del found["h"]
    return found


def _specs(table, found):
    return tuple(PartitionSpec(*[found.get(f) for f in factors.split()]) for factors in table)


def _partitioned(run, ins, outs):
    """``run`` with a partitioning rule: the factors "g" and "h" keep the
    operands' sharding (each shard runs its own groups, its slice of the
    hidden dim), every other factor is replicated."""
    fn = custom_partitioning(run)

    def shardings(mesh, table, found):
        return tuple(NamedSharding(mesh, spec) for spec in _specs(table, found))

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, outs, _mesh_axes(ins, [a.sharding for a in arg_shapes]))

    def local(*arrays):
        # Each shard's calls are traced while XLA partitions the program,
        # after its sharding constraints were resolved: traced under a
        # context mesh (`jax.sharding.set_mesh`), Explicit axes would add
        # constraints no later pass removes.
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return run(*arrays)

    def partition(mesh, arg_shapes, result_shape):
        found = _mesh_axes(ins, [a.sharding for a in arg_shapes])
        return mesh, local, shardings(mesh, outs, found), shardings(mesh, ins, found)

    # Factors in the order the rule names them (Shardy numbers them so).
    every = list(dict.fromkeys(f for t in ins + outs for f in t.split()))
    fn.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=", ".join(ins) + " -> " + ", ".join(outs),
        need_replication_factors=tuple(f for f in every if f not in _SHARDABLE),
    )
    return fn


def _batched(fn, count):
    """``fn`` (over a leading group dim) under ``jax.vmap``: the mapped
    dim joins the group dim, so a vmapped call stays one partitioned op."""

    @custom_batching.custom_vmap
    def call(*arrays):
        return fn(*arrays)

    @call.def_vmap
    def rule(axis_size, in_batched, *arrays):
        arrays = [
            a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, b in zip(arrays, in_batched)
        ]
        outs = call(*[a.reshape((-1,) + a.shape[2:]) for a in arrays])
        return (
            tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in outs),
            (True,) * count,
        )

    return call


def _explicit(fn, ins, outs):
    """``fn`` on operands that may carry Explicit mesh axes in their types:
    it runs with those axes made Auto (the partitioning rule then works as
    under an Auto mesh), its results typed with the shardings the rule
    gives them."""

    def call(*arrays):
        shardings = [getattr(jax.typeof(a), "sharding", None) for a in arrays]
        explicit = any(
            jax.sharding.AxisType.Explicit in tuple(getattr(s.mesh, "axis_types", ()) or ())
            for s in shardings
            if s is not None and getattr(s, "mesh", None) is not None and not s.mesh.empty
        )
        if not explicit:
            return fn(*arrays)
        out = _specs(outs, _mesh_axes(ins, shardings))
        mesh = next(s.mesh for s in shardings if s is not None and not s.mesh.empty)
        # Explicit operands outside `jax.sharding.set_mesh`: their mesh.
        context = (
            jax.sharding.use_abstract_mesh(mesh)
            if jax.sharding.get_abstract_mesh().empty
            else contextlib.nullcontext()
        )
        with context:
            return jax.sharding.auto_axes(fn, out_sharding=out)(*arrays)

    return call


@functools.lru_cache(maxsize=None)
def _op(op, arg_names, ret_names, attrs, wide_names, specs, static):
    result_specs = functools.partial(specs, *static)
    single = _single(op, list(arg_names), list(ret_names), attrs, result_specs)
    ins, outs = _factors(op, arg_names, ret_names, wide_names)
    fn = _batched(_partitioned(_grouped(single), ins, outs), len(ret_names))
    return _explicit(fn, ins, outs)


def _call(op, args: dict, specs, rets, **attrs):
    """Runs ``op`` over grouped operands (leading group dim): the present
    operands and results by name, in the handler's order. ``specs`` is
    ``(function, static arguments)``: the function of (static..., one
    group's operands by name) that gives the results' shapes."""
    arg_names = tuple(n for n in _OPS[op][1] if n in args)
    ret_names = tuple(n for n in _OPS[op][2] if n in rets)
    wide = tuple(
        n
        for n in arg_names + ret_names
        if n in _INT64 and not (n in args and args[n].dtype == jnp.int64)
        and not (n in rets and rets[n] == np.int64)
    )
    fn = _op(op, arg_names, ret_names, tuple(sorted(attrs.items())), wide, specs[0], specs[1])
    out = fn(*[args[n] for n in arg_names])
    return dict(zip(ret_names, out))


# Result shapes of one group, from its static parameters and its operands
# (passed apart, so equal calls share one op).


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


def _row_id_map_results(index_dtype, args):
    t, e = args["routing"].shape
    return {
        "row_id_map": _sds((t, 2 * e + 1), jnp.int32),
        "tokens_per_expert": _wide_spec((e,), index_dtype),
        "expert_offsets": _wide_spec((e + 1,), index_dtype),
    }


def _permute_results(rows, args):
    x = args["input"]
    return {"output": _sds((rows, x.shape[1]), x.dtype), "permuted_probs": _sds((rows,), jnp.float32)}


def _unpermute_results(args):
    y, m = args["input"], args["row_id_map"]
    t, e = m.shape[0], (m.shape[1] - 1) // 2
    return {"output": _sds((t, y.shape[1]), y.dtype), "unpermuted_probs": _sds((t, e), jnp.float32)}


def _unpermute_backward_results(args):
    return {
        "act_grad": _sds(args["fwd_input"].shape, args["fwd_input"].dtype),
        "probs_grad": _sds(args["merging_probs"].shape, jnp.float32),
    }


def _chunk_map_results(tokens, index_dtype, args):
    return {"map": _wide_spec((tokens,), index_dtype)}


def _sort_results(args):
    x = args["input"]
    out = {"output": _sds(x.shape, x.dtype)}
    if "probs" in args:
        out["permuted_probs"] = _sds(args["probs"].shape, jnp.float32)
    return out


# ------------------------------------------- grouped ops (leading G dim)


def _g_make_row_id_map(routing, num_out_tokens, align, capacity, index_dtype, graph_cache):
    index_dtype = _index_dtype(index_dtype)
    rets = {"row_id_map": None, "tokens_per_expert": index_dtype, "expert_offsets": index_dtype}
    out = _call(
        "make_row_id_map",
        {"routing": routing},
        (_row_id_map_results, (index_dtype,)),
        rets,
        num_out_tokens=num_out_tokens,
        align=align,
        capacity=capacity,
        graph_cache=graph_cache,
    )
    return (
        out["row_id_map"],
        _narrow(out["tokens_per_expert"], index_dtype),
        _narrow(out["expert_offsets"], index_dtype),
    )


def _optional(args, rets, operand, value, result=None):
    """Adds ``value`` as ``operand`` (and ``result`` to the results) when
    it is given."""
    if value is not None:
        args[operand] = value
        if result is not None:
            rets[result] = None


def _g_permute(x, row_id_map, tpe, offsets, probs, rows, graph_cache):
    args = {
        "input": x,
        "row_id_map": row_id_map,
        "tokens_per_expert": _wide(tpe),
        "expert_offsets": _wide(offsets),
    }
    rets = {"output": None}
    _optional(args, rets, "probs", probs, "permuted_probs")
    out = _call(
        "permute",
        args,
        (_permute_results, (rows,)),
        rets,
        has_probs=probs is not None,
        graph_cache=graph_cache,
    )
    return out["output"], out.get("permuted_probs")


def _g_unpermute(y, row_id_map, merging_probs, permuted_probs, graph_cache):
    args = {"input": y, "row_id_map": row_id_map}
    rets = {"output": None}
    _optional(args, rets, "merging_probs", merging_probs)
    _optional(args, rets, "permuted_probs", permuted_probs, "unpermuted_probs")
    out = _call(
        "unpermute",
        args,
        (_unpermute_results, ()),
        rets,
        has_merging_probs=merging_probs is not None,
        has_permuted_probs=permuted_probs is not None,
        graph_cache=graph_cache,
    )
    return out["output"], out.get("unpermuted_probs")


def _g_unpermute_backward(grad, fwd_input, row_id_map, tpe, offsets, merging_probs, graph_cache):
    out = _call(
        "unpermute_backward",
        {
            "grad": grad,
            "fwd_input": fwd_input,
            "row_id_map": row_id_map,
            "tokens_per_expert": _wide(tpe),
            "expert_offsets": _wide(offsets),
            "merging_probs": merging_probs,
        },
        (_unpermute_backward_results, ()),
        {"act_grad": None, "probs_grad": None},
        graph_cache=graph_cache,
    )
    return out["act_grad"], out["probs_grad"]


def _g_sort(x, sort_map, probs, backward, graph_cache):
    args = {"input": x, "map": _wide(sort_map)}
    rets = {"output": None}
    _optional(args, rets, "probs", probs, "permuted_probs")
    out = _call(
        "sort_chunks_by_map",
        args,
        (_sort_results, ()),
        rets,
        has_probs=probs is not None,
        backward=backward,
        graph_cache=graph_cache,
    )
    return out["output"], out.get("permuted_probs")


# permute: d input = unpermute of the output cotangent (each token sums its
# routes' rows); d probs = the permuted-probs cotangent scattered back,
# which the same unpermute call returns as its unpermuted_probs.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _permute(x, row_id_map, tpe, offsets, probs, rows, graph_cache):
    return _g_permute(x, row_id_map, tpe, offsets, probs, rows, graph_cache)


def _permute_fwd(x, row_id_map, tpe, offsets, probs, rows, graph_cache):
    out = _g_permute(x, row_id_map, tpe, offsets, probs, rows, graph_cache)
    return out, (row_id_map, tpe, offsets, probs is not None)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros_like(a)


def _permute_bwd(rows, graph_cache, res, cotangents):
    row_id_map, tpe, offsets, has_probs = res
    g_out, g_probs = cotangents
    if has_probs and g_probs is None:
        g_probs = jnp.zeros(g_out.shape[:2], jnp.float32)
    dx, dprobs = _g_unpermute(g_out, row_id_map, None, g_probs if has_probs else None, graph_cache)
    return (
        dx,
        _zero_cotangent(row_id_map),
        _zero_cotangent(tpe),
        _zero_cotangent(offsets),
        dprobs,
    )


_permute.defvjp(_permute_fwd, _permute_bwd)


# unpermute: with merging probs the backward is xcall's unpermute_backward;
# without, it is permute of the cotangent into the forward's rows.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _unpermute(y, row_id_map, tpe, offsets, merging_probs, graph_cache):
    return _g_unpermute(y, row_id_map, merging_probs, None, graph_cache)[0]


def _unpermute_fwd(y, row_id_map, tpe, offsets, merging_probs, graph_cache):
    out = _g_unpermute(y, row_id_map, merging_probs, None, graph_cache)[0]
    return out, (y, row_id_map, tpe, offsets, merging_probs)


def _unpermute_bwd(graph_cache, res, g):
    y, row_id_map, tpe, offsets, merging_probs = res
    zeros = (_zero_cotangent(row_id_map), _zero_cotangent(tpe), _zero_cotangent(offsets))
    if merging_probs is None:
        dy, _ = _g_permute(g, row_id_map, tpe, offsets, None, y.shape[1], graph_cache)
        return (dy,) + zeros + (None,)
    dy, dprobs = _g_unpermute_backward(g, y, row_id_map, tpe, offsets, merging_probs, graph_cache)
    return (dy,) + zeros + (dprobs,)


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


# A scatter by a permutation is undone by the gather with the same map.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _sort(x, sort_map, probs, backward, graph_cache):
    return _g_sort(x, sort_map, probs, backward, graph_cache)


def _sort_fwd(x, sort_map, probs, backward, graph_cache):
    return _g_sort(x, sort_map, probs, backward, graph_cache), (sort_map, probs is not None)


def _sort_bwd(backward, graph_cache, res, cotangents):
    sort_map, has_probs = res
    g_out, g_probs = cotangents
    if has_probs and g_probs is None:
        g_probs = jnp.zeros(sort_map.shape[:2], jnp.float32)
    dx, dprobs = _g_sort(g_out, sort_map, g_probs if has_probs else None, not backward, graph_cache)
    return dx, _zero_cotangent(sort_map), dprobs


_sort.defvjp(_sort_fwd, _sort_bwd)


# ------------------------------------------------ the ops, one group each


def _tokens(a, trailing, what):
    """``a`` with its leading dims flattened to one: ``[T, ...]`` or
    ``[B, S, ...]`` -> ``[T, ...]``."""
    a = jnp.asarray(a)
    if a.ndim not in (trailing + 1, trailing + 2):
        raise ValueError(
            f"xcall.jax: {what} must have {trailing + 1} or {trailing + 2} dims "
            f"([T, ...] or [B, S, ...]), has shape {a.shape}"
        )
    return a.reshape((-1,) + a.shape[a.ndim - trailing :])


def make_row_id_map(
    routing,
    *,
    num_out_tokens: int = -1,
    align: int = 0,
    capacity: int = 0,
    index_dtype=jnp.int32,
    graph_cache: bool = False,
):
    """Row-id map of a ``[T, E]`` (or ``[B, S, E]``) bool/uint8 routing map:
    ``(row_id_map [T, 2E+1] int32, tokens_per_expert [E], expert_offsets
    [E+1])``, the last two in ``index_dtype``. ``num_out_tokens`` >= 0 drops
    routes past that row; ``align`` pads every expert chunk to a multiple;
    ``capacity`` gives every expert exactly that many rows (``E * capacity``
    output rows)."""
    r = _tokens(routing, 1, "routing")
    m, tpe, off = _g_make_row_id_map(
        r[None], int(num_out_tokens), int(align), int(capacity), index_dtype, bool(graph_cache)
    )
    return m[0], tpe[0], off[0]


def permute(x, row_id_map, tokens_per_expert, expert_offsets, probs=None, *,
            num_out_rows: int, graph_cache: bool = False):
    """Groups the rows of ``x`` ``[T, H]`` (or ``[B, S, H]``) by expert into
    ``num_out_rows`` rows (rows no route writes are zero). With ``probs``
    ``[T, E]`` float32 also returns each row's prob. Returns ``(output
    [num_out_rows, H], permuted_probs [num_out_rows] or None)``;
    differentiable in ``x`` and ``probs``."""
    x = _tokens(x, 1, "x")
    p = None if probs is None else _tokens(probs, 1, "probs")[None]
    y, yp = _permute(x[None], row_id_map[None], tokens_per_expert[None], expert_offsets[None], p,
                     int(num_out_rows), bool(graph_cache))
    return y[0], None if yp is None else yp[0]


def unpermute(y, row_id_map, tokens_per_expert, expert_offsets, merging_probs=None, *,
              graph_cache: bool = False):
    """Restores token order: ``out[t] = sum_k y[dst_k] * merging_probs[t,
    e_k]`` (weight 1 without merging probs), ``[T, H]``, accumulated in
    float32; differentiable in ``y`` and ``merging_probs``."""
    p = None if merging_probs is None else _tokens(merging_probs, 1, "merging_probs")[None]
    out = _unpermute(y[None], row_id_map[None], tokens_per_expert[None], expert_offsets[None], p,
                     bool(graph_cache))
    return out[0]


def unpermute_backward(grad, fwd_input, row_id_map, tokens_per_expert, expert_offsets,
                       merging_probs, *, graph_cache: bool = False):
    """Backward of ``unpermute`` with merging probs: ``(act_grad [N, H],
    probs_grad [T, E] float32)``."""
    a, p = _g_unpermute_backward(grad[None], fwd_input[None], row_id_map[None],
                                 tokens_per_expert[None], expert_offsets[None],
                                 merging_probs[None], bool(graph_cache))
    return a[0], p[0]


def make_chunk_sort_map(split_sizes, sorted_indices, num_tokens: int, *,
                        index_dtype=jnp.int32, graph_cache: bool = False):
    """Chunk-sort map ``[num_tokens]`` (``index_dtype``) of ``split_sizes``
    ``[S]`` and ``sorted_indices`` ``[S]`` (any integer type)."""
    index_dtype = _index_dtype(index_dtype)
    out = _call(
        "make_chunk_sort_map",
        {"split_sizes": _wide(split_sizes)[None], "sorted_indices": _wide(sorted_indices)[None]},
        (_chunk_map_results, (int(num_tokens), index_dtype)),
        {"map": index_dtype},
        graph_cache=bool(graph_cache),
    )
    return _narrow(out["map"], index_dtype)[0]


def sort_chunks_by_map(x, sort_map, probs=None, *, backward: bool = False,
                       graph_cache: bool = False):
    """Reorders the rows of ``x`` ``[T, H]`` by a chunk-sort map: scatter
    (``out[map[t]] = x[t]``) or, with ``backward``, gather. Returns
    ``(output, permuted_probs or None)``; differentiable in ``x`` and
    ``probs``."""
    p = None if probs is None else probs[None]
    out, op = _sort(x[None], sort_map[None], p, bool(backward), bool(graph_cache))
    return out[0], None if op is None else op[0]


# --------------------------------------------------------- the MoE layer


class Dispatch(NamedTuple):
    """What :func:`token_dispatch` returns."""

    permuted: jax.Array
    """``[G * rows, H]``: each group's rows grouped by expert (rows no
    route fills are zero)."""
    permuted_probs: Optional[jax.Array]
    """``[G * rows]`` float32: each row's prob (None without probs)."""
    row_id_map: jax.Array
    """``[T, 2E + 1]`` int32: where each token's routes went, for
    :func:`token_combine`."""
    tokens_per_expert: jax.Array
    """Rows of each expert's chunk, ``[E]`` (``[G, E]`` with groups),
    int32: the routes it got, padded to ``align``, or ``capacity``."""


def _routing(routing, probs, num_experts, t, what):
    """(routing map [T, E] bool, probs [T, E] float32 or None) from either
    routing form."""
    if num_experts is None:
        r = _tokens(routing, 1, what)
        if r.shape[0] != t:
            raise ValueError(f"xcall.jax: {what} has {r.shape[0]} tokens, the input {t}")
        p = None
        if probs is not None:
            p = _tokens(probs, 1, "probs").astype(jnp.float32)
            if p.shape != r.shape:
                raise ValueError(f"xcall.jax: probs has shape {p.shape}, the routing map {r.shape}")
        return r, p
    ids = _tokens(routing, 1, what)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"xcall.jax: top-k expert ids must be integers, got {ids.dtype}")
    if ids.shape[0] != t:
        raise ValueError(f"xcall.jax: {what} has {ids.shape[0]} tokens, the input {t}")
    onehot = ids[:, :, None] == jnp.arange(int(num_experts), dtype=ids.dtype)
    p = None
    if probs is not None:
        pk = _tokens(probs, 1, "probs").astype(jnp.float32)
        if pk.shape != ids.shape:
            raise ValueError(f"xcall.jax: probs has shape {pk.shape}, the top-k ids {ids.shape}")
        p = jnp.sum(jnp.where(onehot, pk[:, :, None], 0.0), axis=1)
    return jnp.any(onehot, axis=1), p


def _chunks(row_id_map, align, capacity):
    """(tokens_per_expert [G, E], expert_offsets [G, E + 1]) int32 of
    grouped row-id maps, as make_row_id_map gave them: the routes each
    expert kept, its chunks packed in expert order, padded to ``align`` or
    ``capacity`` rows. The backward passes zero the rows past them."""
    e = (row_id_map.shape[-1] - 1) // 2

    def one(m):
        ids = m[:, e : 2 * e]
        valid = jnp.arange(e, dtype=jnp.int32)[None, :] < m[:, 2 * e :]
        kept = jnp.zeros((e + 1,), jnp.int32).at[jnp.where(valid, ids, e)].add(1)[:e]
        if capacity:
            size = jnp.full((e,), capacity, jnp.int32)
        elif align:
            size = (kept + align - 1) // align * align
        else:
            size = kept
        return kept, jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(size)])

    return _explicit(lambda m: tuple(jax.vmap(one)(m)), ["g t w"], ["g e", "g f"])(row_id_map)


def _split(a, groups, what):
    if a.shape[0] % groups:
        raise ValueError(
            f"xcall.jax: {what} has {a.shape[0]} rows, not a multiple of num_groups={groups}"
        )
    return a.reshape((groups, a.shape[0] // groups) + a.shape[1:])


def token_dispatch(
    x,
    routing,
    probs=None,
    *,
    num_experts: Optional[int] = None,
    num_out_tokens: Optional[int] = None,
    align: int = 0,
    capacity: int = 0,
    num_groups: int = 1,
    graph_cache: bool = False,
) -> Dispatch:
    """Sends every token's row to the experts it is routed to.

    ``x``: ``[T, H]`` or ``[B, S, H]``. ``routing``: a 0/1 (bool or
    integer) map ``[T, E]`` (or ``[B, S, E]``), or, with ``num_experts=E``,
    top-k expert ids ``[T, K]`` (distinct per token). ``probs``: ``[T, E]``
    for a map, ``[T, K]`` for ids (any float type; used as float32).

    Rows per group: with ``capacity``, ``E * capacity`` (routes past an
    expert's capacity are dropped); else ``num_out_tokens`` routes (by
    default ``T/G * K`` for ids; required with a map), plus ``E * (align -
    1)`` rows of padding with ``align``. Without ``align`` or ``capacity``,
    routes past ``num_out_tokens`` are dropped.

    ``num_groups=G`` splits the tokens into G equal consecutive blocks and
    dispatches each on its own: ``permuted`` is G blocks of ``rows``.
    With the tokens sharded over G devices along their first dim, each
    device dispatches its own block with no communication.

    Returns :class:`Dispatch` ``(permuted, permuted_probs, row_id_map,
    tokens_per_expert)``; differentiable in ``x`` and ``probs``.
    """
    g = int(num_groups)
    if g < 1:
        raise ValueError(f"xcall.jax: num_groups must be >= 1, got {num_groups}")
    xt = _tokens(x, 1, "x")
    t = xt.shape[0]
    r, p = _routing(routing, probs, num_experts, t, "routing")
    e = r.shape[1]
    if capacity:
        if num_out_tokens is not None:
            raise ValueError("xcall.jax: capacity fixes the rows; leave num_out_tokens out")
        rows, cap_tokens = e * int(capacity), -1
    else:
        if num_out_tokens is None:
            if num_experts is None:
                raise ValueError(
                    "xcall.jax: a routing map needs num_out_tokens (the routes per group, "
                    "e.g. T * topk); top-k ids need none"
                )
            num_out_tokens = (t // g) * routing.shape[-1]
        routes = int(num_out_tokens)
        rows = routes + (e * (int(align) - 1) if align else 0)
        cap_tokens = -1 if align else routes
    xg = _split(xt, g, "x")
    rg = _split(r, g, "routing")
    pg = None if p is None else _split(p, g, "probs")
    m, tpe, off = _g_make_row_id_map(
        rg, cap_tokens, int(align), int(capacity), jnp.int32, bool(graph_cache)
    )
    y, yp = _permute(xg, m, tpe, off, pg, rows, bool(graph_cache))
    sizes = off[:, 1:] - off[:, :-1]
    return Dispatch(
        permuted=y.reshape((-1,) + y.shape[2:]),
        permuted_probs=None if yp is None else yp.reshape(-1),
        row_id_map=m.reshape((-1, m.shape[2])),
        tokens_per_expert=sizes[0] if g == 1 else sizes,
    )


def token_combine(
    y,
    row_id_map,
    probs=None,
    *,
    routing=None,
    align: int = 0,
    capacity: int = 0,
    num_groups: int = 1,
    graph_cache: bool = False,
):
    """Brings the experts' rows back to token order and sums each token's
    routes, weighted by ``probs`` (weight 1 without): the inverse of
    :func:`token_dispatch`, with the ``align``, ``capacity`` and
    ``num_groups`` given to it.

    ``y``: ``[G * rows, H]`` as ``permuted`` was. ``probs``: ``[T, E]``, or
    top-k probs ``[T, K]`` with ``routing=`` the ``[T, K]`` ids given to
    dispatch; ``[B, S, ...]`` forms give a ``[B, S, H]`` result, ``[T, H]``
    otherwise. Accumulates in float32; returns ``y``'s dtype;
    differentiable in ``y`` and ``probs``.
    """
    g = int(num_groups)
    if g < 1:
        raise ValueError(f"xcall.jax: num_groups must be >= 1, got {num_groups}")
    t, w = row_id_map.shape
    e = (w - 1) // 2
    p = None
    lead = None
    if probs is not None:
        lead = jnp.shape(probs)[:-1]
        if routing is None:
            _, p = _routing(jnp.ones((t, e), bool), probs, None, t, "routing")
        else:
            _, p = _routing(routing, probs, e, t, "routing")
    yg = _split(jnp.asarray(y), g, "y")
    mg = _split(row_id_map, g, "row_id_map")
    pg = None if p is None else _split(p, g, "probs")
    tpe, off = _chunks(mg, int(align), int(capacity))
    out = _unpermute(yg, mg, tpe, off, pg, bool(graph_cache))
    out = out.reshape((t,) + out.shape[2:])
    if lead is not None and len(lead) > 1:
        out = out.reshape(tuple(lead) + out.shape[1:])
    return out


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


# Expert parallelism across this process's devices (xcall.jax_ep), here
# too: imported last, as it builds on this module's loader.
from xcall.jax_ep import (  # noqa: E402
    EpDispatch,
    EpGroup,
    ep_close_all,
    ep_combine,
    ep_dispatch,
    ep_group,
)
