"""MkDocs hooks: lay the package out for mkdocstrings as it is installed, and publish the
benchmark plots.

The checkout keeps `core/` and `api/` beside `purestep/` (pyproject maps them to
`purestep.core` and `purestep.api`); griffe reads a package from one folder, so the build
first links them into `.docs_src/purestep/`, the folder the handler searches. The plots
committed under `benchmarks/results/` become `plots/<name>.png` of the site."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def on_startup(**kwargs: object) -> None:
    package = ROOT / ".docs_src" / "purestep"
    package.mkdir(parents=True, exist_ok=True)
    for name, target in (("__init__.py", ROOT / "purestep" / "__init__.py"), ("core", ROOT / "core"), ("api", ROOT / "api")):
        link = package / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        files.append(File.generated(config, f"plots/{png.name}", abs_src_path=str(png)))
    return files
