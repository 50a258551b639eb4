#!/usr/bin/env bash
# The whole test suite on each torch release given, each in a venv of its own:
#
#     bash tools/torch_matrix.sh 2.11.0 2.13.0 2.15.0
#     bash tools/torch_matrix.sh --summary 2.11.0 2.15.0   # only the table, from runs already made
#
# Per release: a venv under ${MATRIX_DIR:-.matrix}/torch-VERSION (kept: a second run reuses it),
# `torch==VERSION` and the test extras installed there with the torchvision that release pins
# (the test extras pin the one of the test command's torch), purestep installed editable from this
# checkout, then `pytest` on tests/, property_tests/ and the doctests. Each release's log and
# junit XML land in ${MATRIX_DIR}/; the summary (passed / failed / skipped per release, failures
# named) is printed and written to ${MATRIX_OUT:-benchmarks/results/DATE-torch-matrix-cpu.md}.
#
# A release that is not on this machine's disk comes from PyPI as a CUDA build (GBs, runs on the
# CPU): this machine's pip config, which caps torch at the local wheels, is turned off for these
# installs (PIP_CONFIG_FILE=/dev/null; PIP_FIND_LINKS, where set, still finds the local ones).
set -euo pipefail
cd "$(dirname "$0")/.."
summary_only=no
if [ "${1:-}" = "--summary" ]; then summary_only=yes; shift; fi
[ $# -gt 0 ] || { echo "usage: bash tools/torch_matrix.sh [--summary] VERSION..." >&2; exit 2; }
root=${MATRIX_DIR:-.matrix}
out=${MATRIX_OUT:-benchmarks/results/$(date +%F)-torch-matrix-cpu.md}
mkdir -p "$root"

# The test extras of pyproject.toml, torchvision unpinned (pip then takes the release this torch pins).
requirements() {
    python3 - <<'EOF'
import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]
print("\n".join("torchvision" if r.startswith("torchvision") else r for r in extras))
EOF
}

for version in "$@"; do
    [ "$summary_only" = yes ] && break
    venv="$root/torch-$version"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, pytest, purestep.core" 2>/dev/null; then
        python3 -m venv "$venv"
        requirements > "$venv/requirements.txt"
        PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q "torch==$version" -r "$venv/requirements.txt"
        PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q -e . "torch==$version"
    fi
    # This checkout, whichever one the venv was made from (an editable install points at one tree).
    PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q --no-deps -e .
    echo "== torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
    git rev-parse --short HEAD > "$root/torch-$version.commit"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -rfE --junitxml="$root/torch-$version.xml" \
        > "$root/torch-$version.log" 2>&1 || true
    tail -1 "$root/torch-$version.log"
done

python3 - "$out" "$root" "$@" <<'EOF'
import datetime, os, platform, subprocess, sys, xml.etree.ElementTree as ET
out, root, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
# Each run's own commit: the one whose checkout ran it (recorded beside its XML), else this one.
commits = {v: (open(f"{root}/torch-{v}.commit").read().strip() if os.path.exists(f"{root}/torch-{v}.commit") else commit)
           for v in versions}
lines = [f"# The test suite per torch release (CPU), {datetime.date.today()}", "",
         f"Machine: {platform.machine()}, {platform.system()}, 2 cores, Python {platform.python_version()}. "
         f"Command: `bash tools/torch_matrix.sh VERSION` per release, on CPU "
         f"(commit per release: {', '.join(f'{v} at {c}' for v, c in commits.items())}).", "",
         "| torch | passed | failed | errors | skipped | xfailed |", "|---|---|---|---|---|---|"]
failures = {}
for v in versions:
    suite = ET.parse(f"{root}/torch-{v}.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = suite.findall("testcase")
    failed, errors, skipped, xfailed = [], [], 0, 0
    for c in cases:
        name = f"{c.get('classname')}::{c.get('name')}"
        if c.find("failure") is not None:
            failed.append(name)
        elif c.find("error") is not None:
            errors.append(name)
        elif (s := c.find("skipped")) is not None:
            xfailed += s.get("type") == "pytest.xfail"
            skipped += s.get("type") != "pytest.xfail"
    passed = len(cases) - len(failed) - len(errors) - skipped - xfailed
    lines.append(f"| {v} | {passed} | {len(failed)} | {len(errors)} | {skipped} | {xfailed} |")
    failures[v] = failed + errors
for v, names in failures.items():
    if names:
        lines += ["", f"Failures on torch {v}:", ""] + [f"- `{n}`" for n in names]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
print(f"written to {out}")
EOF
