"""What the root conftest.py promises every test process."""

from __future__ import annotations

import os

import hypothesis


def test_jax_is_pinned_to_the_cpu():
    # Set before jax is imported: on a GPU machine jax would otherwise take 75% of its memory.
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    import jax

    assert {d.platform for d in jax.devices()} == {"cpu"}


def test_the_default_hypothesis_profile_is_derandomized():
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
        assert hypothesis.settings.default.derandomize and hypothesis.settings.default.database is None
