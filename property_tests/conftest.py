"""How a registry Case drives the kit (hypothesis profiles live in the root conftest.py)."""

from __future__ import annotations

import pytest

from tests.registry import Case


def kit_kwargs(case: Case) -> dict:
    """The keyword arguments of the `purestep.core.testing` checks for a registry Case."""
    return dict(
        needs_params=case.needs_params,
        matrices_only=case.matrices_only,
        extra=dict(case.extra) or None,
        grad_like_extra=case.extra_trees,
    )


@pytest.fixture
def kwargs_for():
    return kit_kwargs
