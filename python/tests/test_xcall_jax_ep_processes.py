"""Expert parallelism over several processes under jax.distributed (each
process opening its own devices' part of one group): two processes of
one CPU device each (dropless) and of two each (with a capacity) run an
MoE layer and its gradient (jax_ep_worker.py), under a watchdog; their
shards equal, bit for bit, the same program run here in one process over
as many devices, and the layer's values match the numpy loop. The GPU
suite runs the same with a GPU per process."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax_ep_worker as worker
import numpy as np
import pytest
import xcall.jax_ep as xe
from jax.sharding import Mesh
from test_xcall_jax_ep import ref_layer

WATCHDOG_S = 180


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes, per, platform, capacity):
    """Runs the worker in `processes` processes; the global results they
    saved: {"y", "gx", "gp": [P*T, ..], "dropped": [P]}."""
    out = tempfile.mkdtemp(prefix="xcall-jax-ep-")
    port = free_port()
    env = dict(os.environ)
    # GPUs: each process allocates as it goes (this process's JAX may hold
    # most of a GPU already).
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    procs = [
        subprocess.Popen(
            [sys.executable, worker.__file__, str(i), str(processes), str(port), str(per),
             platform, str(capacity), out],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        for i in range(processes)
    ]
    deadline = time.monotonic() + WATCHDOG_S
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        text = "".join(o + e for o, e in (p.communicate() for p in procs))
        pytest.fail(f"{processes} processes: killed by the watchdog after {WATCHDOG_S} s\n{text}")
    for i, (p, (o, e)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}\n{o}{e}"
    pes = processes * per
    got = {"dropped": np.full(pes, -1, np.int64)}
    for i in range(processes):
        saved = np.load(os.path.join(out, f"process-{i}.npz"))
        got["dropped"][saved["ranks"]] = saved["dropped"]
        for key in saved.files:
            if "@" in key:
                name, start = key.split("@")
                part = saved[key]
                whole = got.setdefault(name, np.full((pes * worker.T,) + part.shape[1:], np.nan,
                                                     part.dtype))
                whole[int(start):int(start) + part.shape[0]] = part
    return got


def in_one_process(pes, capacity, devices):
    """The worker's program over `pes` devices of this process."""
    mesh = Mesh(np.array(devices[:pes]), (worker.AXIS,))
    x, ids, probs, w, e = worker.inputs(pes)
    f, g = worker.layer(mesh, e, capacity)
    y = np.asarray(f(x, ids, probs))
    gx, gp = (np.asarray(a) for a in g(x, ids, probs, w))
    group = next(g for g in xe._groups.values() if g.pes == pes)
    return {"y": y, "gx": gx, "gp": gp, "dropped": np.array(group.dropped_routes())}


@pytest.mark.parametrize("processes,per,capacity", [(2, 1, 0), (2, 2, 2)])
def test_processes_equal_one_process_bit_for_bit(processes, per, capacity):
    pes = processes * per
    cpus = jax.devices("cpu")
    if len(cpus) < pes:
        pytest.skip(f"needs {pes} CPU devices here, JAX has {len(cpus)}")
    got = launch(processes, per, "cpu", capacity)
    xe.ep_close_all()
    with jax.default_device(cpus[0]):
        want = in_one_process(pes, capacity, cpus)
    xe.ep_close_all()
    for name in ("y", "gx", "gp", "dropped"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    x, ids, probs, _, e = worker.inputs(pes)
    np.testing.assert_allclose(got["y"], ref_layer(x, ids, probs, np.arange(1, e + 1), pes, e,
                                                   capacity), rtol=1e-5, atol=1e-5)
    assert (got["dropped"].sum() > 0) == (capacity > 0)

