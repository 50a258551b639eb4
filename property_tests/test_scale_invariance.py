"""Invariant family "scale_invariance": for transforms registered scale_invariant (the Adam
family), multiplying every grad by c in [1e-2, 1e2] leaves the updates unchanged up to eps.
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_scale_invariance
from tests.registry import TRANSFORMS

CASES = sorted(n for n, c in TRANSFORMS.items() if c.scale_invariant)


@pytest.mark.parametrize("name", CASES)
def test_updates_ignore_the_grad_scale(name, kwargs_for):
    case = TRANSFORMS[name]
    check_scale_invariance(case.make, **kwargs_for(case))


def test_some_transform_declares_scale_invariance():
    assert "adam" in CASES
