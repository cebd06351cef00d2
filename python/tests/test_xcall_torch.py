"""xcall.torch on CPU: groups of 1 to 4 processes (Host PEs over a Unix
socket and shared memory), each a rank of torch_ep_worker.py, checked
against references there; and the PyTorch quickstart of python/README.md
under torchrun. Without torch the module skips, saying so on stderr."""

import os
import pathlib
import re
import subprocess
import sys
import uuid

import pytest

try:
    import torch  # noqa: F401
except ImportError:
    print(
        "SKIP xcall.torch tests: torch is not installed (pip install '.[torch]')", file=sys.stderr
    )
    pytest.skip("torch is not installed (pip install '.[torch]')", allow_module_level=True)

import xcall
from torchrun import torchrun

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "torch_ep_worker.py"
README = HERE.parent / "README.md"
BENCH = HERE.parent / "bench_xcall_torch.py"
# A whole run of one scenario on every rank; past it every rank is killed.
WATCHDOG_S = 240


def env_for(rank=None, size=None, port=None):
    """The environment of a rank: this xcall first on the path, no GPU,
    and the launcher's variables when given."""
    env = dict(os.environ)
    package_root = str(pathlib.Path(xcall.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    if rank is not None:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RUN_ID=uuid.uuid4().hex if rank == 0 else "",
        )
    return env


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args, size, cwd=None):
    """Runs `args` as `size` ranks; returns their outputs, or fails with
    every rank's output when one fails or the watchdog fires."""
    port = free_port()
    run_id = uuid.uuid4().hex
    procs = []
    for rank in range(size):
        env = env_for(rank, size, port)
        env["TORCHELASTIC_RUN_ID"] = run_id
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs, failed = [], []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=WATCHDOG_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failed.append(f"rank {rank}: killed by the watchdog after {WATCHDOG_S} s")
        outs.append(out)
        if p.returncode != 0:
            failed.append(f"rank {rank}: exit {p.returncode}")
    if failed:
        logs = "\n".join(f"--- rank {r}\n{o}" for r, o in enumerate(outs))
        pytest.fail("; ".join(failed) + "\n" + logs)
    return outs


@pytest.mark.parametrize("size", [1, 2, 4])
def test_layer_values_and_gradients(size):
    outs = run_ranks([str(WORKER), "values"], size)
    assert all(f"OK values rank {r}" in o for r, o in enumerate(outs))


def test_two_layers_in_one_world_values_and_gradients():
    outs = run_ranks([str(WORKER), "layers"], 2)
    assert all(f"OK layers rank {r}" in o for r, o in enumerate(outs))


def test_three_ranks_capacity_drops_routes_like_the_loop():
    outs = run_ranks([str(WORKER), "capacity"], 3)
    assert all(f"OK capacity rank {r}" in o for r, o in enumerate(outs))


def test_compile_fullgraph_with_a_process_group():
    outs = run_ranks([str(WORKER), "compile"], 2)
    assert all(f"OK compile rank {r}" in o for r, o in enumerate(outs))


def test_groups_of_a_given_process_group():
    outs = run_ranks([str(WORKER), "subgroups"], 4)
    assert all(f"OK subgroups rank {r}" in o for r, o in enumerate(outs))


@pytest.mark.parametrize("size", [1, 2])
def test_tokens_written_into_the_send_rows_are_sent_from_there(size):
    outs = run_ranks([str(WORKER), "send_rows"], size)
    assert all(f"OK send_rows rank {r}" in o for r, o in enumerate(outs))


def test_bad_input_raises_before_any_work():
    outs = run_ranks([str(WORKER), "bad_input"], 2)
    assert all(f"OK bad_input rank {r}" in o for r, o in enumerate(outs))


def test_groups_left_open_close_at_exit():
    outs = run_ranks([str(WORKER), "at_exit"], 2)
    for r, o in enumerate(outs):
        assert f"OK at_exit rank {r}" in o and "at exit" not in o, o
        assert "at-exit: 0 groups and worlds left open" in o, o


def test_no_launcher_no_group():
    code = (
        "import xcall.torch as xt, torch\n"
        "try:\n"
        "    xt.EpGroup(8, 16, 2, 4, dtype=torch.float32, device='cpu')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    env = env_for()
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=WATCHDOG_S,
    )
    assert "refused:" in out.stdout and "torchrun" in out.stdout, out.stdout + out.stderr


def test_readme_quickstart_runs_under_torchrun(tmp_path):
    """The PyTorch block of python/README.md, as written, under torchrun
    with 2 processes on CPU."""
    blocks = re.findall(r"```python torch\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) == 1, "python/README.md lost its PyTorch quickstart"
    lines = blocks[0].strip().splitlines()
    assert len(lines) <= 30, f"the PyTorch quickstart has {len(lines)} lines"
    script = tmp_path / "quickstart.py"
    script.write_text(blocks[0])
    out = torchrun(2, [script], env_for(), WATCHDOG_S, "the quickstart")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("quickstart: y right") == 2, out.stdout + out.stderr


def test_bench_runs_on_cpu_ranks():
    """python/bench_xcall_torch.py, small, under torchrun with 2 CPU ranks."""
    args = [BENCH, "--device", "cpu", "--tokens", "32", "--hidden", "64", "--experts", "4"]
    args += ["--topk", "2", "--rounds", "3", "--warmup", "1"]
    out = torchrun(2, args, env_for(), WATCHDOG_S, "the bench")
    stdout, stderr = out.stdout, out.stderr
    assert out.returncode == 0, stdout + stderr
    assert "xcall.torch on 2 CPU ranks" in stdout, stdout + stderr
    for name in ("step", "dispatch", "combine"):
        assert re.search(rf"^  {name} +median +[0-9.]+ ms", stdout, re.M), stdout
