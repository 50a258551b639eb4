"""The public surface of purestep.core: documented, registered, and importable without hypothesis."""

from __future__ import annotations

import subprocess
import sys

import pytest

import purestep.core as ps
from tests.registry import NOT_TRANSFORMS, SCHEDULES, TRANSFORMS


def _own_docstring(obj) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if isinstance(obj, type) and issubclass(obj, tuple) and doc.startswith(f"{obj.__name__}("):
        return ""  # the docstring NamedTuple generates, not one written for it
    return doc


@pytest.mark.parametrize("name", ps.__all__)
def test_public_name_has_a_docstring(name):
    obj = getattr(ps, name)
    assert _own_docstring(obj), f"purestep.core.{name} has no docstring: add a one-line summary"


def test_docstring_check_can_fail():
    from typing import NamedTuple

    class Bare(NamedTuple):
        x: int

    def undocumented():
        pass

    assert not _own_docstring(Bare) and not _own_docstring(undocumented)


def test_every_public_name_is_registered():
    registered = set(TRANSFORMS) | set(SCHEDULES) | NOT_TRANSFORMS
    missing = sorted(set(ps.__all__) - registered)
    assert not missing, (
        f"public names not in tests/registry.py: {missing}; add a Case to TRANSFORMS, a factory to "
        "SCHEDULES, or the name to NOT_TRANSFORMS"
    )


def test_registry_names_only_public_names_or_compositions():
    # Registry keys that are public names must still exist (a rename breaks this test, not silently the suite).
    stale = sorted(n for n in NOT_TRANSFORMS | set(SCHEDULES) if n not in ps.__all__)
    assert not stale, f"tests/registry.py lists names that purestep.core no longer exports: {stale}"


def test_all_lists_each_name_once_and_every_name_exists():
    assert len(ps.__all__) == len(set(ps.__all__))
    assert all(hasattr(ps, n) for n in ps.__all__)


def test_core_imports_without_hypothesis_and_testing_is_not_reexported():
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "import purestep.core as ps\n"
        "assert not hasattr(ps, 'testing') and 'purestep.core.testing' not in sys.modules\n"
        "try:\n"
        "    import purestep.core.testing\n"
        "except ImportError as e:\n"
        "    assert 'pip install hypothesis' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('testing imported without hypothesis')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
