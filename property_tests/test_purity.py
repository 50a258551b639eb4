"""Invariant family "purity": init and update mutate none of their inputs (params, grads,
state, extra keyword trees), for every registered transform.
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_mutates_no_input(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=("purity",), **kwargs_for(case))
