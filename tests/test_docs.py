"""The documentation covers the public API: every name of `purestep.core.__all__`,
`purestep.api.__all__` and the testing kit has an entry in docs/api/, under its public
path, and the nav lists every page (the site itself is built by the README's docs command)."""

from __future__ import annotations

import re
from pathlib import Path

import purestep.api
import purestep.core
import purestep.core.testing

ROOT = Path(__file__).resolve().parents[1]


def _entries() -> set[str]:
    text = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    return set(re.findall(r"^::: (purestep\.[\w.]+)$", text, re.M))


def test_every_public_name_has_an_api_entry_under_its_public_path():
    entries = _entries()
    for module in (purestep.core, purestep.api, purestep.core.testing):
        missing = [n for n in module.__all__ if f"{module.__name__}.{n}" not in entries]
        assert not missing, f"no docs/api entry for {module.__name__}: {missing}"
    public = {f"{m.__name__}.{n}" for m in (purestep.core, purestep.api, purestep.core.testing) for n in m.__all__}
    public |= {"purestep.core.engine.ops"}  # the engine's protocol, documented as a module (what transforms call)
    assert entries <= public, f"entries that are no public name: {sorted(entries - public)}"


def test_the_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    missing = [p for p in sorted(pages) if f": {p}" not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_version_and_module_entry_points():
    import subprocess
    import sys

    import purestep

    assert re.fullmatch(r"\d+\.\d+\.\d+", purestep.__version__)
    out = subprocess.run([sys.executable, "-m", "purestep", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"purestep {purestep.__version__}", out.stdout + out.stderr
    for package in ("purestep", "purestep.core", "purestep.api"):
        assert (Path(__import__(package, fromlist=["x"]).__file__).parent / "py.typed").is_file(), package


_PATH = re.compile(r"(?<![\w/.-])((?:core|api|tests|benchmarks|docs|tools|property_tests|examples)/[\w/.-]*\w\.(?:py|md|sh|toml|yml))")
_SECTION = re.compile(r"""the README's ["“]([^"”]+)["”]""")
_HERE = re.compile(r'"([^"]{3,80})" (?:below|above)')
_CORE_NAME = re.compile(r"(?<![\w.])ps\.([A-Za-z_]\w*)")


def _texts() -> list[Path]:
    pages = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "core" / "README.md"]
    return pages + [ROOT / "benchmarks" / "README.md", *(ROOT / "core").rglob("*.py"), *(ROOT / "api").rglob("*.py")]


def test_every_file_and_readme_section_the_docs_and_docstrings_name_exists():
    missing = [
        f"{page.relative_to(ROOT)}:{i}: {m.group(1)}"
        for page in _texts()
        for i, line in enumerate(page.read_text().splitlines(), 1)
        for m in _PATH.finditer(line)
        if not (ROOT / m.group(1)).exists()
    ]
    headings = set(re.findall(r"^#+ (.+)$", (ROOT / "README.md").read_text(), re.M))
    missing += [
        f"{page.relative_to(ROOT)}:{i}: the README's section {m.group(1)!r}"
        for page in _texts()
        for i, line in enumerate(page.read_text().splitlines(), 1)
        for m in _SECTION.finditer(line)
        if m.group(1) not in headings
    ]
    for page in _texts():  # a section of the same page, "X" below / above
        text = page.read_text()
        here = set(re.findall(r"^#+ (.+)$", text, re.M))
        missing += [
            f"{page.relative_to(ROOT)}:{i}: the section {m.group(1)!r}"
            for i, line in enumerate(text.splitlines(), 1)
            for m in _HERE.finditer(line)
            if m.group(1) not in here
        ]
    missing += [  # `ps.name`: a name of purestep.core
        f"{page.relative_to(ROOT)}:{i}: ps.{m.group(1)}"
        for page in _texts()
        for i, line in enumerate(page.read_text().splitlines(), 1)
        for m in _CORE_NAME.finditer(line)
        if not hasattr(purestep.core, m.group(1))
    ]
    assert not missing, "named but missing:\n" + "\n".join(missing)


def test_the_layout_page_names_every_module():
    layout = (ROOT / "docs" / "layout.md").read_text()
    missing = [
        str(f.relative_to(ROOT))
        for package in ("core", "api")
        for f in (ROOT / package).rglob("*.py")
        if f.stem != "__init__" and not re.search(rf"`{re.escape(f.stem)}(\.py)?`", layout)
    ]
    assert not missing, f"modules docs/layout.md does not name: {missing}"


def test_the_diloco_guides_example_runs(capsys):
    """The guide opens with a runnable example: it must run as written."""
    text = (ROOT / "docs" / "guides" / "diloco.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)
    assert code, "the guide has no python example"
    exec(compile(code[0], "docs/guides/diloco.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "torch.Size([8, 8])"


def _first_example(page: str) -> str:
    code = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "guides" / page).read_text(), re.S)
    assert code, f"{page} has no python example"
    return code[0]


def test_the_compiled_step_guides_example_runs(capsys):
    """The guide opens with a runnable example: the flat path, said before the first call."""
    exec(compile(_first_example("compiled-step.md"), "docs/guides/compiled-step.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("flat: compile=True, donate=True") and "group0" in out[1]


def test_the_distributed_guides_example_runs_on_two_ranks(tmp_path):
    """The guide opens with a runnable example; under torchrun on 2 ranks it takes the sharded path."""
    import os
    import subprocess
    import sys

    script = tmp_path / "fsdp_step.py"
    script.write_text(_first_example("distributed.md"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("sharded: DTensor params: this rank's blocks in place, eager; FSDP over 2 rank(s)") == 2
