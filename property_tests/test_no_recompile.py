"""Invariant family "no_recompile": a compiled update + apply_updates step compiles once
while grads, step counts, schedules and injected hyperparameters change.

One small representative case only: each compile costs 10-30 s on a 2-core CPU.
"""

from __future__ import annotations

from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS


def test_injected_adamw_with_a_schedule_compiles_once(kwargs_for):
    case = TRANSFORMS["inject_hyperparams"]  # adamw, lr schedule, hyperparams in state
    check_transform(case.make, checks=(), compile=True, **kwargs_for(case))
