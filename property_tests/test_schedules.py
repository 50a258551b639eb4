"""Invariant family "schedules": every registered schedule, over steps 0..150, gives a finite
0-d tensor for a tensor step equal to its value at the int step ("tensor_steps"), stays in
bounds (non-negative unless registered otherwise), joins its phases without a jump
("continuity") and is monotone within phases ("monotone_phases": at most two turns unless
boundaries are registered in SCHEDULE_CHECKS).
"""

from __future__ import annotations

import pytest

from purestep.core.testing import check_schedule
from tests.registry import SCHEDULE_CHECKS, SCHEDULES, TRANSFORMS


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_invariants(name):
    kwargs = dict(bounds=(0.0, float("inf")), max_turns=2)
    kwargs.update(SCHEDULE_CHECKS.get(name, {}))
    check_schedule(SCHEDULES[name](), steps=150, **kwargs)


def test_schedule_checks_name_registered_schedules():
    assert set(SCHEDULE_CHECKS) <= set(SCHEDULES)


def test_schedule_inside_a_registered_transform_passes():
    # scale_by_lr's registered schedule is a plain lambda: the kit checks any callable.
    check_schedule(lambda t: 0.1 / (1.0 + t), steps=50, bounds=(0.0, 0.1))
    assert "scale_by_lr" in TRANSFORMS
