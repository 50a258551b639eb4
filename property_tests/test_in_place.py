"""Invariant family "in_place": where a transform has an in-place form (`ps.with_in_place`:
affine or apply_), the eager donated apply gives the params and state of `update` then
`apply_updates`, to the dtype's tolerance, for every registered transform.
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_in_place_apply_equals_update_then_apply_updates(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=("in_place",), **kwargs_for(case))
