"""Hypothesis profiles for the property suites, and how a registry Case drives the kit.

Profiles: "dev" (default) and "ci" (derandomized, chosen when CI is set); both keep
examples few and have no deadline, so the whole suite runs in well under 3 minutes
on 2 cores. Pick another with HYPOTHESIS_PROFILE=<name>.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.registry import Case

settings.register_profile("dev", max_examples=8, deadline=None, database=None)
settings.register_profile("ci", max_examples=8, deadline=None, database=None, derandomize=True)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


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
