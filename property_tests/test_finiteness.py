"""Invariant family "finite_outputs": finite inputs give finite updates and state, with all-zero,
huge (1e10) and tiny (1e-10) grads included, for every registered transform.
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_outputs_are_finite_for_finite_inputs(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=("finite_outputs",), **kwargs_for(case))
