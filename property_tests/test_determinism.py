"""Invariant family "determinism": a fresh instance on the same inputs gives bitwise-equal
updates and states, and so does the same instance replayed ("replay": no state is kept
outside the returned state), for every registered transform.
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_is_bitwise_deterministic_and_replays(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=("determinism", "replay"), **kwargs_for(case))
