"""Invariant family "composition": chain(identity(), t), chain(t, identity()) and masked(t, all
True) give the same updates as t, bitwise, for every registered transform.
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_composes_with_identity_and_full_mask(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=("composition",), **kwargs_for(case))
