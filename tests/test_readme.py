"""Every ```python block of README.md runs as written, in order, in one namespace.

A block whose first line is `# needs CUDA` runs only where CUDA is available: without it
the CPU test runs every other block and the CUDA test is reported as skipped, so no block
is ever skipped silently.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """`(line number, code)` of every ```python block, in order."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _FENCE.finditer(text)]


def _needs_cuda(code: str) -> bool:
    return code.lstrip().startswith("# needs CUDA")


def _run_blocks(tmp_path, monkeypatch, *, with_cuda: bool) -> int:
    monkeypatch.chdir(tmp_path)  # the examples write runs/ and checkpoints/ into the working directory
    module = types.ModuleType("readme_examples")  # a real module: torch.compile looks its globals up by name
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    ran = 0
    for line, code in python_blocks(README.read_text()):
        if _needs_cuda(code) and not with_cuda:
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"the README's python block at line {line} failed: {type(error).__name__}: {error}") from error
        ran += 1
    return ran


def test_readme_python_blocks_are_found():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 6
    assert python_blocks("x\n```python\na = 1\n```\n```bash\nls\n```\n") == [(3, "a = 1\n")]


def test_readme_python_examples_run_in_order(tmp_path, monkeypatch):
    blocks = python_blocks(README.read_text())
    ran = _run_blocks(tmp_path, monkeypatch, with_cuda=False)
    assert ran == sum(not _needs_cuda(code) for _, code in blocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the README's CUDA blocks need CUDA")
def test_readme_python_examples_run_in_order_with_the_cuda_blocks(tmp_path, monkeypatch):
    assert _run_blocks(tmp_path, monkeypatch, with_cuda=True) == len(python_blocks(README.read_text()))
