"""Test-process settings for every test directory: JAX on the CPU, hypothesis profiles.

JAX (the optax references) is pinned to the CPU before anything imports it: on a GPU
machine it would otherwise take 75% of the GPU's memory in every test process.

Hypothesis: "ci" (the default) is derandomized, so a test run is reproducible and a planted
bug is found the same way every time; "dev" draws fresh examples; "thorough" draws many.
Pick one with HYPOTHESIS_PROFILE=<name>.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=8, deadline=None, database=None, derandomize=True)
settings.register_profile("dev", max_examples=8, deadline=None, database=None)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
