"""Invariant family "decoupled_decay": for transforms registered with decoupled_decay,
u(p) - u(0) is a pure multiple of p, the same for every decayed leaf (AdamW, not Adam+L2).
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_decoupled_decay
from tests.registry import TRANSFORMS

CASES = sorted(n for n, c in TRANSFORMS.items() if c.decoupled_decay)


@pytest.mark.parametrize("name", CASES)
def test_weight_decay_is_decoupled(name, kwargs_for):
    case = TRANSFORMS[name]
    check_decoupled_decay(case.make, **kwargs_for(case))


def test_some_transform_declares_decoupled_decay():
    assert "adamw" in CASES
