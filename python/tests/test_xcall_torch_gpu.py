"""xcall.torch on GPUs: one process per GPU under torchrun (CUDA IPC
between the processes), on 2 GPUs, 4 and all of them (as many as this
machine has): every scenario of torch_ep_worker.py (values and gradients
against references, two layers in one world, capacity, torch.compile with
a process group, bad input, a CUDA graph of the layer replayed with new
routing, groups closed at exit). Skips, saying so on stderr, without
torch or with fewer than 2 GPUs.

    python -m pytest -q -rs python/tests/test_xcall_torch_gpu.py

One scenario by hand: torchrun --nproc-per-node 4
python/tests/torch_ep_worker.py values cuda (with PYTHONPATH=python).
"""

import os
import pathlib
import sys

import pytest

try:
    import torch
except ImportError:
    print(
        "SKIP xcall.torch GPU tests: torch is not installed (pip install '.[torch]')",
        file=sys.stderr,
    )
    pytest.skip("torch is not installed (pip install '.[torch]')", allow_module_level=True)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
if GPUS < 2:
    print(f"SKIP xcall.torch GPU tests: needs 2 GPUs, this machine has {GPUS}", file=sys.stderr)
    pytest.skip(f"needs 2 GPUs, this machine has {GPUS}", allow_module_level=True)

import xcall
from torchrun import torchrun

WORKER = pathlib.Path(__file__).resolve().parent / "torch_ep_worker.py"
# Every scenario in one torchrun per GPU count (torch imported once per
# rank, not once per scenario); at_exit last, as it leaves groups open.
SCENARIOS = ["values", "layers", "capacity", "compile", "bad_input", "cuda_graph", "at_exit"]
WATCHDOG_S = 400


@pytest.mark.parametrize("gpus", sorted({n for n in (2, 4, GPUS) if n <= GPUS}))
def test_torchrun_one_process_per_gpu(gpus):
    env = dict(os.environ)
    package_root = str(pathlib.Path(xcall.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("OMP_NUM_THREADS", "1")
    args = [WORKER, ",".join(SCENARIOS), "cuda"]
    out = torchrun(gpus, args, env, WATCHDOG_S, f"{gpus} GPUs")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    for scenario in SCENARIOS:
        for rank in range(gpus):
            assert f"OK {scenario} rank {rank}" in out.stdout, log
