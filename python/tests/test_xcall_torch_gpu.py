"""xcall.torch on GPUs: a process per rank under torchrun (CUDA IPC
between the processes), 2 ranks, 4 and one per GPU of this machine, rank
r on GPU r mod the GPUs (with fewer GPUs than ranks, ranks share a GPU
and take turns on it, so one GPU runs the 2- and 4-rank suites): every
scenario of torch_ep_worker.py (values and gradients against references,
two layers in one world, capacity, torch.compile with a process group,
bad input, a CUDA graph of the layer replayed with new routing, groups
closed at exit). Skips, saying so on stderr, without
torch or without a GPU.

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
if GPUS < 1:
    print("SKIP xcall.torch GPU tests: this machine has no GPU", file=sys.stderr)
    pytest.skip("this machine has no GPU", allow_module_level=True)

import xcall
from torchrun import torchrun

WORKER = pathlib.Path(__file__).resolve().parent / "torch_ep_worker.py"
# Every scenario in one torchrun per GPU count (torch imported once per
# rank, not once per scenario); at_exit last, as it leaves groups open.
SCENARIOS = [
    "values",
    "layers",
    "capacity",
    "compile",
    "bad_input",
    "send_rows",
    "cuda_graph",
    "at_exit",
]
WATCHDOG_S = 400


@pytest.mark.parametrize("ranks", sorted({n for n in (2, 4, GPUS) if n >= 2}))
def test_torchrun_a_process_per_rank(ranks):
    env = dict(os.environ)
    package_root = str(pathlib.Path(xcall.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("OMP_NUM_THREADS", "1")
    args = [WORKER, ",".join(SCENARIOS), "cuda"]
    out = torchrun(ranks, args, env, WATCHDOG_S, f"{ranks} ranks on {min(ranks, GPUS)} GPU(s)")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    for scenario in SCENARIOS:
        for rank in range(ranks):
            assert f"OK {scenario} rank {rank}" in out.stdout, log
