"""Invariant family "bounded_updates": for sign-based transforms (Lion, Sophia), |update| is
at most the registered update_bound elementwise, whatever the grads (params zero, so
decoupled decay adds nothing).
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_bounded_updates
from tests.registry import TRANSFORMS

CASES = sorted(n for n, c in TRANSFORMS.items() if c.sign_based or c.update_bound is not None)


@pytest.mark.parametrize("name", CASES)
def test_updates_are_bounded(name, kwargs_for):
    case = TRANSFORMS[name]
    assert case.update_bound is not None, (
        f"Case {name!r} is sign_based: register update_bound=<lr> in tests/registry.py"
    )
    check_bounded_updates(case.make, case.update_bound, **kwargs_for(case))
