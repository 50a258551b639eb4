"""Every ```python block of README.md and of each page under docs/ runs as written, in
order, one namespace per page.

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

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# The pages with code to run: the README and the docs pages that hold a python block.
PAGES = [p for p in (README, *sorted((ROOT / "docs").rglob("*.md"))) if _FENCE.search(p.read_text())]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """`(line number, code)` of every ```python block, in order."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _FENCE.finditer(text)]


def _needs_cuda(code: str) -> bool:
    return code.lstrip().startswith("# needs CUDA")


def _run_blocks(page: Path, tmp_path, monkeypatch, *, with_cuda: bool) -> int:
    monkeypatch.chdir(tmp_path)  # the examples write runs/ and checkpoints/ into the working directory
    module = types.ModuleType("doc_examples")  # a real module: torch.compile looks its globals up by name
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    ran = 0
    name = page.relative_to(ROOT)
    for line, code in python_blocks(page.read_text()):
        if _needs_cuda(code) and not with_cuda:
            continue
        try:
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"the python block at {name}:{line} failed: {type(error).__name__}: {error}") from error
        ran += 1
    return ran


def test_python_blocks_are_found():
    assert len(python_blocks(README.read_text())) >= 4
    assert sum(len(python_blocks(p.read_text())) for p in PAGES) >= 15
    assert python_blocks("x\n```python\na = 1\n```\n```bash\nls\n```\n") == [(3, "a = 1\n")]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_python_examples_run_in_order(page, tmp_path, monkeypatch):
    blocks = python_blocks(page.read_text())
    ran = _run_blocks(page, tmp_path, monkeypatch, with_cuda=False)
    assert ran == sum(not _needs_cuda(code) for _, code in blocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA blocks need CUDA")
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_python_examples_run_in_order_with_the_cuda_blocks(page, tmp_path, monkeypatch):
    assert _run_blocks(page, tmp_path, monkeypatch, with_cuda=True) == len(python_blocks(page.read_text()))
