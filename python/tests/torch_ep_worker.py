"""One rank of the xcall.torch expert-parallel tests: run by
test_xcall_torch.py (several processes on CPU) and
test_xcall_torch_gpu.py (under torchrun, a process per rank, rank r on
GPU r mod the GPUs).

    python torch_ep_worker.py SCENARIO[,SCENARIO...] [cpu|cuda]

Every rank makes every rank's inputs from the same seeds, so each checks
its own results against references over the whole world: values against
a numpy loop in float64, gradients against the same layer written in
plain torch (every rank's tokens, every expert) under autograd. Runs the
scenarios in order in one process, printing "OK <scenario> rank <r>" or
"FAIL <scenario> rank <r>" (after its traceback) for each; exits 1 if any
failed.
"""

import atexit
import os
import sys
import traceback

import numpy as np
import torch


@atexit.register
def _report_left_open():
    # Registered before xcall.torch is imported: runs after its close_all.
    left = len(xt._groups) + len(xt._worlds)
    print(f"at-exit: {left} groups and worlds left open", flush=True)


import xcall.torch as xt

RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])


def inputs(seed, rank, tokens, hidden, topk, experts, dtype, no_route=0):
    """Rank `rank`'s x [tokens, H], ids [tokens, k] int32 (distinct experts
    per token; the last `no_route` slots of every third token -1) and
    probs [tokens, k] float32."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).int()
    if no_route:
        ids[::3, topk - no_route :] = -1
    probs = torch.rand(tokens, topk, generator=gen) + 0.1
    return x, ids, probs


def expert_weights(seed, experts, hidden, dtype):
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    return (torch.rand(experts, hidden, generator=gen) + 0.5).to(dtype)


def numpy_layer(xs, idss, probss, w, capacity=None):
    """y of every rank in float64: y[t] = sum_j p[t, j] * x[t] * w[e],
    with each expert keeping its first `capacity` routes in (sender rank,
    token, slot) order; and the routes each expert dropped."""
    experts = w.shape[0]
    taken = np.zeros(experts, np.int64)
    dropped = np.zeros(experts, np.int64)
    ys = []
    for x, ids, probs in zip(xs, idss, probss):
        x = x.double().numpy()
        y = np.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                if e < 0:
                    continue
                if capacity is not None and taken[e] >= capacity:
                    dropped[e] += 1
                    continue
                taken[e] += 1
                y[t] += float(probs[t, j]) * x[t] * w[e].double().numpy()
        ys.append(y)
    return ys, dropped


def torch_layer(xs, idss, probss, w):
    """The same layer in plain torch (differentiable in xs, probss, w)."""
    ys = []
    for x, ids, probs in zip(xs, idss, probss):
        routed = (ids >= 0).unsqueeze(-1)
        rows = x.float().unsqueeze(1) * w.float()[ids.long().clamp(min=0)]  # [T, k, H]
        ys.append((rows * probs.unsqueeze(-1) * routed).sum(1))
    return ys


def xcall_layer(group, x, ids, probs, w_local):
    d = xt.ep_dispatch(group, x, ids, probs)
    experts = d.row_experts()
    h = d.rows * w_local[experts.clamp(min=0)]
    return xt.ep_combine(group, h, probs), d


def close(a, b, tol, what):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    err = np.max(np.abs(a - b) / (1 + np.abs(b))) if a.size else 0.0
    assert a.shape == b.shape and err <= tol, (
        f"rank {RANK}: {what}: max error {err:.3g} > {tol} (shapes {a.shape} {b.shape})"
    )


def layer_case(
    device,
    dtype,
    tokens,
    hidden,
    topk,
    experts,
    align=1,
    capacity=None,
    calls=1,
    tokens_used=None,
    no_route=0,
    compiled=False,
    seed=1,
    **group_args,
):
    """A whole layer, forward and backward, `calls` times (new routing each
    time), against the references."""
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    local = experts // SIZE
    n = tokens_used or tokens
    with xt.EpGroup(
        tokens,
        hidden,
        topk,
        experts,
        dtype=dtype,
        align=align,
        capacity=capacity,
        device=device,
        timeout_s=30,
        **group_args,
    ) as group:
        assert group.local_experts == local
        w = expert_weights(seed, experts, hidden, dtype)
        w_local = w[RANK * local : (RANK + 1) * local].clone().to(device).requires_grad_()
        layer = xcall_layer
        if compiled:
            layer = torch.compile(xcall_layer, fullgraph=True)
        dropped_total = 0
        for call in range(calls):
            world = [
                inputs(seed + call, r, n, hidden, topk, experts, dtype, no_route)
                for r in range(SIZE)
            ]
            xs, idss, probss = zip(*world)
            x = xs[RANK].clone().to(device).requires_grad_()
            ids = idss[RANK].to(device)
            probs = probss[RANK].clone().to(device).requires_grad_()
            w_local.grad = None
            y, d = layer(group, x, ids, probs, w_local)
            assert y.shape == (n, hidden) and y.dtype == dtype
            assert d.rows.shape == (group.expert_rows, hidden)
            want, dropped = numpy_layer(xs, idss, probss, w, capacity)
            close(y.detach().float().cpu(), want[RANK], tol, f"y (call {call})")
            # Counts and layout: what each local expert received, from the loop.
            counts = np.zeros(experts, np.int64)
            for ids_r in idss:
                for e in ids_r.flatten().tolist():
                    if e >= 0:
                        counts[e] += 1
            if capacity is not None:
                counts = np.minimum(counts, capacity)
            mine = counts[RANK * local : (RANK + 1) * local]
            assert d.tokens_per_expert.cpu().tolist() == mine.tolist(), (d.tokens_per_expert, mine)
            offs = d.offsets.cpu().numpy()
            assert all(o % align == 0 for o in offs[:-1]), offs
            row_e = d.row_experts().cpu().numpy()
            assert (row_e >= 0).sum() == mine.sum()
            for l in range(local):
                assert (row_e[offs[l] : offs[l] + mine[l]] == l).all()
            dropped_total += int(dropped[RANK * local : (RANK + 1) * local].sum())

            # Gradients against plain torch over the whole world.
            gen = torch.Generator().manual_seed(seed * 31 + call)
            gys = [torch.randn(n, hidden, generator=gen).to(dtype) for _ in range(SIZE)]
            (y.float() * gys[RANK].to(device).float()).sum().backward()
            if capacity is None:
                rx = [a.float().clone().requires_grad_() for a in xs]
                rp = [a.clone().requires_grad_() for a in probss]
                rw = w.float().clone().requires_grad_()
                ref = torch_layer(rx, idss, rp, rw)
                sum((yr * g.float()).sum() for yr, g in zip(ref, gys)).backward()
                close(x.grad.float().cpu(), rx[RANK].grad, tol, f"grad x (call {call})")
                close(probs.grad.cpu(), rp[RANK].grad, tol * 4, f"grad probs (call {call})")
                close(
                    w_local.grad.float().cpu(),
                    rw.grad[RANK * local : (RANK + 1) * local],
                    tol * 4,
                    f"grad w (call {call})",
                )
            else:
                assert torch.isfinite(x.grad.float()).all() and torch.isfinite(probs.grad).all()
        assert group.dropped_routes() == dropped_total, (group.dropped_routes(), dropped_total)
        if capacity is not None:
            assert SIZE == 1 or dropped_total >= 0


def unused_rows_case(device, dtype, tokens, hidden, topk, experts, align):
    """Rows no route fills are zero in the rows and in their gradient,
    whatever the memory held before (NaN here)."""
    with xt.EpGroup(
        tokens, hidden, topk, experts, dtype=dtype, align=align, device=device, timeout_s=30
    ) as g:
        x, ids, probs = (
            a.to(device) for a in inputs(11, RANK, tokens, hidden, topk, experts, dtype, 1)
        )
        for _ in range(2):
            junk = [
                torch.full((g.expert_rows, hidden), float("nan"), dtype=dtype, device=device)
                for _ in range(4)
            ]
            del junk
            d = xt.ep_dispatch(g, x, ids, probs)
            unused = d.row_experts() < 0
            assert unused.any() and (~unused).any()
            assert (d.rows[unused] == 0).all(), "unused rows are not zero"
            out = d.rows.clone().requires_grad_()
            junk = [torch.full_like(out, float("nan")) for _ in range(4)]
            del junk
            y = xt.ep_combine(g, out, probs)
            (y.float() * 2).sum().backward()
            assert (out.grad[unused] == 0).all(), "the gradient of unused rows is not zero"
            assert (out.grad[~unused] != 0).any()
            assert torch.isfinite(out.grad).all()


def opcheck_case(device):
    """torch.library.opcheck on the four ops: schema, fake and autograd
    registrations agree with what the ops do (every rank runs the same
    checks in the same order: each op call is collective)."""
    T, H, K, E = 8, 16, 2, 2 * SIZE
    with xt.EpGroup(T, H, K, E, dtype=torch.float32, device=device, timeout_s=30) as g:
        x, ids, probs = (a.to(device) for a in inputs(8, RANK, T, H, K, E, torch.float32))
        x.requires_grad_()
        ops = torch.ops.xcall
        torch.library.opcheck(ops.ep_dispatch.default, (g.id, x, ids, probs, True))
        d = xt.ep_dispatch(g, x.detach(), ids, probs)
        out = d.rows.clone().requires_grad_()
        torch.library.opcheck(ops.ep_combine.default, (g.id, out, probs.clone().requires_grad_()))
        torch.library.opcheck(
            ops.ep_combine_backward.default, (g.id, torch.ones(T, H, device=device), out.detach())
        )
        torch.library.opcheck(ops.ep_dispatch_backward.default, (g.id, out.detach(), T))


def scenario_values(device):
    opcheck_case(device)
    unused_rows_case(device, torch.float32, tokens=16, hidden=32, topk=2, experts=2 * SIZE, align=4)
    layer_case(device, torch.float32, tokens=16, hidden=32, topk=2, experts=2 * SIZE, calls=2)
    layer_case(
        device,
        torch.bfloat16,
        tokens=24,
        hidden=64,
        topk=3,
        experts=4 * SIZE,
        align=4,
        tokens_used=17,
        no_route=1,
        seed=5,
    )


def scenario_capacity(device):
    layer_case(
        device,
        torch.float32,
        tokens=16,
        hidden=16,
        topk=2,
        experts=SIZE * 2,
        capacity=5,
        calls=2,
        seed=9,
    )


def scenario_compile(device):
    """torch.compile(fullgraph=True) of the layer, with the group's ranks
    from an initialized process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=RANK, world_size=SIZE)
    try:
        layer_case(
            device,
            torch.float32,
            tokens=8,
            hidden=16,
            topk=2,
            experts=2 * SIZE,
            calls=2,
            compiled=True,
            seed=3,
        )
    finally:
        dist.destroy_process_group()


def scenario_subgroups(device):
    """Four ranks in two process groups of two ({0, 1} and {2, 3}): each
    pair is an expert-parallel group of its own (ranks, size and socket
    from its process group), next to the other."""
    import torch.distributed as dist

    global RANK, SIZE
    dist.init_process_group("gloo", rank=RANK, world_size=SIZE)
    try:
        assert SIZE == 4
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pg = pairs[RANK // 2]
        RANK, SIZE = dist.get_rank(pg), dist.get_world_size(pg)
        layer_case(
            device,
            torch.float32,
            tokens=8,
            hidden=16,
            topk=2,
            experts=4,
            calls=2,
            seed=13,
            process_group=pg,
        )
        RANK, SIZE = dist.get_rank(), dist.get_world_size()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def raises(kind, text, fn):
    try:
        fn()
    except kind as e:
        assert text in str(e), f"rank {RANK}: {kind.__name__} without {text!r}: {e}"
        return e
    raise AssertionError(f"rank {RANK}: no {kind.__name__} ({text!r})")


def scenario_bad_input(device):
    T, H, K, E = 8, 16, 2, 2 * SIZE
    # A config xcall refuses: xcall's own message, before any rank waits.
    e = raises(
        xt.XcallError,
        "topk",
        lambda: xt.EpGroup(T, H, E + 1, E, dtype=torch.float32, device=device),
    )
    assert e.status == "XCALL_STATUS_INVALID_ARGUMENT", e.status
    raises(
        TypeError,
        "float32 or torch.bfloat16",
        lambda: xt.EpGroup(T, H, K, E, dtype=torch.float16, device=device),
    )
    with xt.EpGroup(T, H, K, E, dtype=torch.float32, device=device, timeout_s=30) as g:
        x, ids, probs = (a.to(device) for a in inputs(2, RANK, T, H, K, E, torch.float32))
        raises(
            TypeError,
            "x must be torch.float32",
            lambda: xt.ep_dispatch(g, x.bfloat16(), ids, probs),
        )
        raises(
            TypeError,
            "probs must be torch.float32",
            lambda: xt.ep_dispatch(g, x, ids, probs.double()),
        )
        raises(
            TypeError, "ids must be torch.int32", lambda: xt.ep_dispatch(g, x, ids.short(), probs)
        )
        raises(
            ValueError, "x must be [", lambda: xt.ep_dispatch(g, x[:, :8].contiguous(), ids, probs)
        )
        raises(ValueError, "at most 8", lambda: xt.ep_dispatch(g, torch.cat([x, x]), ids, probs))
        raises(
            ValueError,
            "ids must be [",
            lambda: xt.ep_dispatch(g, x, ids[:, :1].contiguous(), probs),
        )
        raises(
            ValueError, "contiguous", lambda: xt.ep_dispatch(g, x.t().contiguous().t(), ids, probs)
        )
        raises(ValueError, "probs must be [", lambda: xt.ep_dispatch(g, x, ids, probs[:4]))
        other = "cpu" if device != "cpu" else "meta"
        raises(ValueError, "the group on", lambda: xt.ep_dispatch(g, x.to(other), ids, probs))
        raises(TypeError, "EpGroup", lambda: xt.ep_dispatch(object(), x, ids, probs))
        # Nothing ran: the group still serves a layer, right.
        w = expert_weights(2, E, H, torch.float32)
        w_local = w[RANK * 2 : (RANK + 1) * 2].to(device)
        d = xt.ep_dispatch(g, x, ids, probs)
        raises(ValueError, "expert_out must be [", lambda: xt.ep_combine(g, d.rows[:-1], probs))
        raises(
            TypeError,
            "expert_out must be torch.float32",
            lambda: xt.ep_combine(g, d.rows.bfloat16(), probs),
        )
        y = xt.ep_combine(g, d.rows * w_local[d.row_experts().clamp(min=0)], probs)
        world = [inputs(2, r, T, H, K, E, torch.float32) for r in range(SIZE)]
        want, _ = numpy_layer(*zip(*world), w)
        close(y.cpu(), want[RANK], 1e-5, "y after refused calls")
        # An expert id past E on rank 0 only: the call completes everywhere,
        # rank 0 gets xcall's message (on a GPU at check()).
        bad = ids.clone()
        if RANK == 0:
            bad[0, 0] = E + 3

        def dispatch_bad():
            xt.ep_dispatch(g, x, bad, probs)
            g.check()

        if RANK == 0:
            e = raises(xt.XcallError, "XCALL_STATUS_INVALID_ARGUMENT", dispatch_bad)
            assert e.message, "xcall's message is empty"
        else:
            dispatch_bad()
    raises(ValueError, "closed", lambda: xt.ep_dispatch(g, x, ids, probs))


def scenario_send_rows(device):
    """Tokens written into the group's send rows (EpGroup.send_rows) and
    dispatched from there: the layer's values match the numpy loop, twice
    (new tokens written the second time); the view is the group's memory
    (a slice past its first row is refused as overlapping it, which a
    copy would not be); bad token counts raise; a closed group raises."""
    T, H, K, E = 16, 32, 2, 2 * SIZE
    local = 2
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        with xt.EpGroup(T, H, K, E, dtype=dtype, device=device, timeout_s=30) as g:
            w = expert_weights(6, E, H, dtype)
            w_local = w[RANK * local : (RANK + 1) * local].to(device)
            xs = g.send_rows()
            assert xs.shape == (T, H) and xs.dtype == dtype and xs.device == g.device, xs
            assert g.send_rows(5).shape == (5, H) and g.send_rows(5).data_ptr() == xs.data_ptr()
            assert g.send_rows(0).shape == (0, H)
            for call in range(2):
                world = [inputs(60 + call, r, T, H, K, E, dtype) for r in range(SIZE)]
                x, ids, probs = (a.to(device) for a in world[RANK])
                xs.copy_(x)
                y, _ = xcall_layer(g, xs, ids, probs, w_local)
                want, _ = numpy_layer(*zip(*world), w)
                close(y.float().cpu(), want[RANK], tol, f"y from the send rows, call {call}")
            raises(
                xt.XcallError,
                "overlaps the group's own memory",
                lambda: xt.ep_dispatch(g, xs[1:], ids[1:], probs[1:]),
            )
            for bad in (T + 1, -1, 2.0, True):
                raises(ValueError, "tokens must be an int", lambda: g.send_rows(bad))
        raises(ValueError, "closed", lambda: g.send_rows())


def scenario_cuda_graph(device):
    """The layer's forward captured in a CUDA graph, replayed with new
    routing and tokens copied into its inputs."""
    T, H, K, E = 32, 64, 2, 2 * SIZE
    local = 2
    with xt.EpGroup(T, H, K, E, dtype=torch.bfloat16, device=device, timeout_s=30) as g:
        w = expert_weights(4, E, H, torch.bfloat16)
        w_local = w[RANK * local : (RANK + 1) * local].to(device)
        x, ids, probs = (a.to(device) for a in inputs(4, RANK, T, H, K, E, torch.bfloat16))
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(2):
                y, _ = xcall_layer(g, x, ids, probs, w_local)
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, _ = xcall_layer(g, x, ids, probs, w_local)
        for call in range(3):
            world = [inputs(40 + call, r, T, H, K, E, torch.bfloat16) for r in range(SIZE)]
            x.copy_(world[RANK][0].to(device))
            ids.copy_(world[RANK][1].to(device))
            probs.copy_(world[RANK][2].to(device))
            graph.replay()
            g.check()
            want, _ = numpy_layer(*zip(*world), w)
            close(y.float().cpu(), want[RANK], 3e-2, f"y of replay {call}")
        del graph


def scenario_at_exit(device):
    """Two groups (two layers) in one world, sized by group_heap_bytes,
    each used; left open, they and the world are closed at exit, last
    made first (each a collective: a rank closing them in another order
    would hang its peers until the world's timeout)."""
    T, H, K, E = 8, 16, 2, 2 * SIZE
    heap = 2 * xt.group_heap_bytes(SIZE, T, H, K, E, dtype=torch.float32)
    world = xt.EpWorld(heap, device=device, timeout_s=20)
    groups = [xt.EpGroup(T, H, K, E, dtype=torch.float32, world=world) for _ in range(2)]
    w = expert_weights(6, E, H, torch.float32)
    w_local = w[RANK * 2 : (RANK + 1) * 2].to(device)
    world_inputs = [inputs(6, r, T, H, K, E, torch.float32) for r in range(SIZE)]
    x, ids, probs = (a.to(device) for a in world_inputs[RANK])
    y1, d1 = xcall_layer(groups[0], x, ids, probs, w_local)
    _, d2 = xcall_layer(groups[1], y1.detach(), ids, probs, w_local)
    y1_want, _ = numpy_layer(*zip(*world_inputs), w)
    close(y1.cpu(), y1_want[RANK], 1e-5, "layer 1")
    assert d1.rows.shape == d2.rows.shape
    assert not world.closed and not any(g.closed for g in groups)


def scenario_layers(device):
    """Two MoE layers stacked, each with its own group in one world; the
    backward runs layer 2's calls, then layer 1's, each on its own
    group's dispatch. Values and every gradient against plain torch."""
    T, H, K, E = 12, 32, 2, 2 * SIZE
    local = E // SIZE
    heap = 2 * xt.group_heap_bytes(SIZE, T, H, K, E, dtype=torch.float32)
    with xt.EpWorld(heap, device=device, timeout_s=30) as world:
        groups = [xt.EpGroup(T, H, K, E, dtype=torch.float32, world=world) for _ in range(2)]
        layers = [
            [inputs(20 + i, r, T, H, K, E, torch.float32) for r in range(SIZE)] for i in range(2)
        ]
        ws = [expert_weights(20 + i, E, H, torch.float32) for i in range(2)]
        x = layers[0][RANK][0].clone().to(device).requires_grad_()
        h, probs, w_locals = x, [], []
        for i in range(2):
            ids = layers[i][RANK][1].to(device)
            p = layers[i][RANK][2].clone().to(device).requires_grad_()
            w_local = ws[i][RANK * local : (RANK + 1) * local].clone().to(device).requires_grad_()
            h, _ = xcall_layer(groups[i], h, ids, p, w_local)
            probs.append(p)
            w_locals.append(w_local)
        gen = torch.Generator().manual_seed(77)
        gys = [torch.randn(T, H, generator=gen) for _ in range(SIZE)]
        (h * gys[RANK].to(device)).sum().backward()

        rx = [layers[0][r][0].clone().requires_grad_() for r in range(SIZE)]
        rp = [[layers[i][r][2].clone().requires_grad_() for r in range(SIZE)] for i in range(2)]
        rw = [w.clone().requires_grad_() for w in ws]
        hs = rx
        for i in range(2):
            hs = torch_layer(hs, [layers[i][r][1] for r in range(SIZE)], rp[i], rw[i])
        close(h.detach().cpu(), hs[RANK].detach(), 1e-5, "y of layer 2")
        sum((a * g).sum() for a, g in zip(hs, gys)).backward()
        close(x.grad.cpu(), rx[RANK].grad, 1e-5, "grad x")
        for i in range(2):
            close(probs[i].grad.cpu(), rp[i][RANK].grad, 4e-5, f"grad probs of layer {i + 1}")
            want = rw[i].grad[RANK * local : (RANK + 1) * local]
            close(w_locals[i].grad.cpu(), want, 4e-5, f"grad w of layer {i + 1}")


SCENARIOS = {
    "subgroups": scenario_subgroups,
    "layers": scenario_layers,
    "at_exit": scenario_at_exit,
    "values": scenario_values,
    "capacity": scenario_capacity,
    "compile": scenario_compile,
    "bad_input": scenario_bad_input,
    "send_rows": scenario_send_rows,
    "cuda_graph": scenario_cuda_graph,
}


def main():
    names = sys.argv[1].split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}: {sorted(SCENARIOS)}")
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    if device == "cuda":
        # More ranks than GPUs: ranks share a GPU, taking turns on it.
        local = int(os.environ.get("LOCAL_RANK", RANK))
        device = f"cuda:{local % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    failed = []
    for name in names:
        torch.manual_seed(0)
        try:
            SCENARIOS[name](device)
        except Exception:
            # The next scenarios still run (every rank fails the same
            # collective with a timeout at worst); the exit status says.
            traceback.print_exc()
            print(f"FAIL {name} rank {RANK}", flush=True)
            failed.append(name)
            continue
        print(f"OK {name} rank {RANK}", flush=True)
    if failed:
        raise SystemExit(f"rank {RANK}: failed {failed}")


if __name__ == "__main__":
    main()
