"""The supported torch releases (issue 39): pyproject's floor is a release on which the whole
suite passed in the committed matrix run, that run covers the floor, 2.13 and a newer release,
the docs page shows it, and no code reads torch's version string (`core/_compat.py` probes)."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]


def _latest_matrix() -> Path:
    runs = sorted((ROOT / "benchmarks" / "results").glob("*-torch-matrix-cpu.md"))
    assert runs, "no committed run of tools/torch_matrix.sh in benchmarks/results/"
    return runs[-1]


def _rows(path: Path) -> dict[str, dict[str, int]]:
    rows = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\| (\d+\.\d+\.\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", line.strip())
        if m:
            v, *counts = m.groups()
            rows[v] = dict(zip(["passed", "failed", "errors", "skipped", "xfailed"], map(int, counts)))
    return rows


def test_pyprojects_floor_passed_the_whole_suite_in_the_committed_matrix_run():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(re.fullmatch(r"torch>=(\d+\.\d+)", d).group(1) for d in deps if d.startswith("torch"))
    rows = _rows(_latest_matrix())
    tested = {".".join(v.split(".")[:2]): r for v, r in rows.items()}
    assert floor in tested, f"the floor torch {floor} is not in {_latest_matrix().name}"
    newest = max(tuple(map(int, v.split("."))) for v in tested)
    assert "2.13" in tested and newest > (2, 13), sorted(tested)
    for version, r in tested.items():
        assert r["failed"] == r["errors"] == 0 and r["passed"] > 2000, (version, r)


def test_the_docs_page_shows_the_latest_matrix_run():
    page = (ROOT / "docs" / "torch-releases.md").read_text()
    assert f'--8<-- "benchmarks/results/{_latest_matrix().name}"' in page


def test_no_code_compares_torchs_version_string():
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for d in ("core", "api")
        for p in (ROOT / d).rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"TorchVersion|__version__\s*[<>]|version\.parse|torch\.version\.__version__", line)
    ]
    assert not offenders, f"read a capability in core/_compat.py instead: {offenders}"
