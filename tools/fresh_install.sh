#!/usr/bin/env bash
# A new user's first hour on their own torch: a fresh venv that already has torch VERSION,
# then `pip install .` (not editable) from this checkout. Fails when the install changes the
# torch or the CUDA packages the venv had, or when a ```python block of README.md fails there.
#
#     bash tools/fresh_install.sh 2.15.0
#
# The venv is made under ${FRESH_DIR:-.matrix}/fresh-VERSION (kept for a second run). torch
# comes from PyPI (a CUDA build of several GB, which runs on the CPU): this machine's pip
# config, which caps torch at the local wheels, is turned off (PIP_CONFIG_FILE=/dev/null).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: bash tools/fresh_install.sh TORCH_VERSION}
venv=${FRESH_DIR:-.matrix}/fresh-$version
export PIP_CONFIG_FILE=/dev/null
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==$version"
fi
"$venv/bin/python" -m pip uninstall -q -y purestep 2>/dev/null || true
before=$("$venv/bin/python" -m pip freeze | grep -iE "^(torch|nvidia|triton)" | sort)
"$venv/bin/python" -m pip install -q .
after=$("$venv/bin/python" -m pip freeze | grep -iE "^(torch|nvidia|triton)" | sort)
if [ "$before" != "$after" ]; then
    echo "pip install . changed the venv's torch or CUDA packages:" >&2
    diff <(echo "$before") <(echo "$after") >&2 || true
    exit 1
fi
echo "kept: $(echo "$after" | grep -i '^torch=')"
"$venv/bin/python" -m pip install -q hypothesis  # the README's kit example says it needs it
cd "$venv"  # the installed package, not this checkout's sources; the README's examples write runs/ here
"$OLDPWD/$venv/bin/python" - "$OLDPWD/README.md" <<'EOF'
import re, sys, types
text = open(sys.argv[1]).read()
module = types.ModuleType("readme_examples")  # torch.compile looks its globals up by name
sys.modules[module.__name__] = module
blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
for i, code in enumerate(blocks, 1):
    exec(compile(code, f"README.md block {i}", "exec"), module.__dict__)
import purestep, torch
assert "site-packages" in purestep.__path__[0] or "site-packages" in str(purestep.__file__), purestep.__path__
print(f"README.md: {len(blocks)} python blocks ran on torch {torch.__version__}, purestep {purestep.__version__}")
EOF
