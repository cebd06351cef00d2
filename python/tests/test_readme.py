"""Runs every Python block of python/README.md, in order, in one
namespace: the quickstart must work as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_code_runs():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3, "python/README.md lost its examples"
    namespace = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{README}:block{i}", "exec"), namespace)
    assert namespace["y"].shape == (256, 64)
    # The expert-parallel layer ran over every device, and its gradients.
    n = namespace["n"]
    assert namespace["out"].shape == (n * 64, 64)
    assert [g.shape for g in namespace["grads"]] == [(n * 64, 64), (64, 4 * n), (4 * n, 64, 64)]
