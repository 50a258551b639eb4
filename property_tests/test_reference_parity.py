"""Invariant family "reference_parity": transforms registered with a torch.optim reference
match it in float64 over random steps on random trees (all-zero, huge and tiny grads too).
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS

CASES = sorted(n for n, c in TRANSFORMS.items() if c.reference is not None)


@pytest.mark.parametrize("name", CASES)
def test_transform_matches_its_torch_reference(name, kwargs_for):
    case = TRANSFORMS[name]
    check_transform(case.make, checks=(), reference=case.reference, **kwargs_for(case))
