"""Hypothesis profiles for every test directory.

"ci" (the default) is derandomized, so a test run is reproducible and a planted bug is
found the same way every time; "dev" draws fresh examples; "thorough" draws many.
Pick one with HYPOTHESIS_PROFILE=<name>.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=8, deadline=None, database=None, derandomize=True)
settings.register_profile("dev", max_examples=8, deadline=None, database=None)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
