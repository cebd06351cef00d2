"""Times xcall.torch's expert-parallel calls, one process per GPU:

    torchrun --nproc-per-node 4 python/bench_xcall_torch.py            # DeepSeek-V3-like
    torchrun --nproc-per-node 2 python/bench_xcall_torch.py --device cpu --tokens 64 \\
        --hidden 256 --experts 8 --topk 2                              # a smoke run on CPU

Each rank holds --tokens tokens routed top-k (random, distinct experts)
over --experts experts. Timed, each alone and as one layer step:
dispatch, the experts (silu(rows) * scale_e: on CUDA one Triton kernel
over the rows dispatch filled, else torch ops over every row), combine. Every
round starts with the ranks in step (a barrier, then each GPU idle); a
round's time is the slowest rank's (CUDA events on GPUs), so a call's
time includes its launches from Python. On CUDA, also "queued": rounds
of the three issued back to back with no wait on the host, each timed
with events around it on the device (the launches hidden behind the
GPU's work, as in a training loop), and queued dispatch with the tokens
written into the group's send rows (no copy of x). Prints the median and the best
round of each, in ms, on rank 0. --graph replays the step from a CUDA
graph, timed from idle GPUs and queued: replays issued back to back,
each after an untimed barrier of the ranks' streams (a one-element NCCL
all-reduce), the way `xcall moe` times its steps.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import xcall.torch as xt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--align", type=int, default=1)
    ap.add_argument("--num-sms", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--graph", action="store_true", help="replay the step from a CUDA graph")
    ap.add_argument(
        "--torch-experts",
        action="store_true",
        help="the experts in torch ops over every row (default on CUDA: one Triton kernel "
        "over the rows dispatch filled)",
    )
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    cuda = a.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    g = xt.EpGroup(T, H, K, E, dtype=dtype, align=a.align, num_sms=a.num_sms, device=device)
    torch.manual_seed(rank)
    x = torch.randn(T, H, device=device).to(dtype)
    ids = torch.rand(T, E, device=device).argsort(1)[:, :K].int().contiguous()
    probs = torch.rand(T, K, device=device)
    scale = torch.rand(g.local_experts, device=device).to(dtype) + 0.5
    state = {}

    def dispatch():
        state["d"] = xt.ep_dispatch(g, x, ids, probs, zero_unused=False)

    # The same tokens written where dispatch sends them from: no copy.
    x_sent = g.send_rows(T)
    x_sent.copy_(x)

    def dispatch_in_place():
        state["d"] = xt.ep_dispatch(g, x_sent, ids, probs, zero_unused=False)

    silu_rows = triton_silu_scale() if cuda and not a.torch_experts else None

    def experts():
        d = state["d"]
        if silu_rows is not None:
            # Only the rows dispatch filled (counted on the device): the
            # others are never read by combine.
            state["h"] = silu_rows(d, scale)
        else:
            e = d.row_experts().clamp(min=0)
            state["h"] = torch.nn.functional.silu(d.rows) * scale[e][:, None]

    def combine():
        state["y"] = xt.ep_combine(g, state["h"], probs)

    def step():
        dispatch()
        experts()
        combine()

    if silu_rows is not None:
        # The Triton experts against torch's ops on one step's filled rows.
        with torch.no_grad():
            dispatch()
            d = state["d"]
            e = d.row_experts()
            want = torch.nn.functional.silu(d.rows.float()) * scale.float()[e.clamp(min=0)][:, None]
            state["h"] = silu_rows(d, scale)
            filled = e >= 0
            torch.testing.assert_close(
                state["h"][filled].float(), want[filled], rtol=2e-2, atol=2e-2
            )
            combine()

    if a.graph:
        if not cuda:
            raise SystemExit("--graph needs --device cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        timed = {"step (graph)": graph.replay}
    else:
        timed = {"step": step}
    results = {}
    with torch.no_grad():
        for name, fn in timed.items():
            results[name] = rounds(a, cuda, None, fn, None)
        # Alone, each within a whole step: every rank makes the same calls
        # in the same order, and combine needs the dispatch before it.
        results["dispatch"] = rounds(a, cuda, None, dispatch, lambda: (experts(), combine()))
        results["combine"] = rounds(a, cuda, lambda: (dispatch(), experts()), combine, None)
        if a.graph:
            # Every rank's stream reaches the barrier before its replay's
            # clock starts, so a rank whose host enqueued late adds no
            # wait to its peers' times.
            nccl = dist.new_group(backend="nccl")
            one = torch.ones(1, device=device)
            results["step (graph, queued)"] = queued(
                a, [("step", graph.replay)], lambda: dist.all_reduce(one, group=nccl)
            )["step"]
        if cuda:
            for name, times in queued(
                a, [("dispatch", dispatch), ("experts", experts), ("combine", combine)]
            ).items():
                results[f"{name} (queued)"] = times
            results["dispatch, x in send_rows (queued)"] = queued(
                a, [("d", dispatch_in_place), ("e", experts), ("c", combine)]
            )["d"]
    if cuda:
        torch.cuda.synchronize()
    g.check()
    if rank == 0:
        shape = f"T={T} H={H} E={E} k={K} {a.dtype} align={a.align} num_sms={a.num_sms}"
        print(f"xcall.torch on {size} {'GPUs' if cuda else 'CPU ranks'}, {shape}:")
        for name, times in results.items():
            print(
                f"  {name:34s} median {statistics.median(times):8.3f} ms  best {min(times):8.3f} ms"
            )
    g.close()
    dist.destroy_process_group()


def triton_silu_scale():
    """`silu(rows) * scale[expert]` as one Triton kernel over the rows
    dispatch filled (their count read on the device: no wait on the host,
    CUDA-graph safe); None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # ROWS rows a program: a quarter of the programs, most of which find
    # only unfilled rows (0.244 against 0.286 ms over 131072 rows, 32768
    # filled, H=7168, on an H200).
    @triton.jit
    def kernel(rows, out, row_expert, scale, n, hidden, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        for j in range(ROWS):
            r = tl.program_id(0) * ROWS + j
            if r < n:
                e = tl.load(row_expert + r)
                if e >= 0:
                    s = tl.load(scale + e).to(tl.float32)
                    for c in range(0, hidden, BLOCK):
                        i = c + tl.arange(0, BLOCK)
                        m = i < hidden
                        x = tl.load(rows + r.to(tl.int64) * hidden + i, mask=m).to(tl.float32)
                        y = x / (1.0 + tl.exp(-x)) * s
                        tl.store(
                            out + r.to(tl.int64) * hidden + i, y.to(out.dtype.element_ty), mask=m
                        )

    def run(d, scale):
        out = torch.empty_like(d.rows)
        n, hidden = d.rows.shape
        kernel[(triton.cdiv(n, 4),)](
            d.rows, out, d.row_experts(), scale, n, hidden, ROWS=4, BLOCK=1024
        )
        return out

    return run


def queued(a, ops, align=None):
    """Each op's device time, in ms, over rounds of all `ops` issued back to
    back with no wait on the host between them (the GPU runs behind
    Python's launches, as in a training loop, so their cost is hidden),
    CUDA events around each op: per round and op, the slowest rank's.
    `align`, if given, is enqueued untimed before each round."""
    n = a.warmup + a.rounds
    events = [
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in ops]
        for _ in range(n)
    ]
    torch.cuda.synchronize()
    dist.barrier()
    for row in events:
        if align:
            align()
        for (start, end), (_, fn) in zip(row, ops):
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([[s.elapsed_time(e) for s, e in row] for row in events[a.warmup :]])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return {name: ms[:, j].tolist() for j, (name, _) in enumerate(ops)}


def rounds(a, cuda, before, fn, after):
    """The slowest rank's time of `fn` in each round, in ms."""
    times = []
    for i in range(a.warmup + a.rounds):
        if before:
            before()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if after:
            after()
        slowest = torch.tensor([ms])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i >= a.warmup:
            times.append(slowest.item())
    return times


if __name__ == "__main__":
    main()
