"""Invariant family "state_stability" (with "update_structure"): state structure, shapes,
dtypes and devices stay as at init, every state leaf is a tensor, and updates are shaped
and typed like the params, over float32/float64/bfloat16 trees of rank 0-4.
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_state_keeps_its_structure_shapes_and_dtypes(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=("state_stability",), **kwargs_for(case))


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_updates_are_shaped_and_typed_like_params(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=("update_structure",), **kwargs_for(case))
