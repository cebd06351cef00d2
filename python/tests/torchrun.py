"""torchrun under a watchdog, for the PyTorch suites: the launcher and its
workers run in a session of their own, and past the watchdog every one of
them is killed and the test fails with what they printed."""

import os
import signal
import subprocess
import sys

import pytest


def torchrun(nproc, args, env, watchdog_s, what):
    """`torchrun --standalone --nproc-per-node NPROC ARGS...` with `env`;
    its completed process (stdout and stderr as text)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *[str(a) for a in args],
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=watchdog_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what}: killed by the watchdog after {watchdog_s} s\n{stdout}{stderr}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
