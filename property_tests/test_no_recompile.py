"""Invariant family "no_recompile": a compiled update + apply_updates step compiles once
while grads, step counts, schedules and injected hyperparameters change.

Graphs are tiny (two small leaves), so each compile takes seconds, not the 10-30 s of a
real model on a 2-core CPU.
"""

from __future__ import annotations

import pytest

import purestep.core as ps
from purestep.core.testing import check_transform
from tests.registry import TRANSFORMS, _half_width


def test_injected_adamw_with_a_schedule_compiles_once(kwargs_for):
    case = TRANSFORMS["inject_hyperparams"]  # adamw, lr schedule, hyperparams in state
    check_transform(case.make, checks=(), compile=True, **kwargs_for(case))


# STYLE: every optimizer gets a no-recompile test. Each alias is built with its
# hyperparameters injected (lr, betas, momentum, weight decay in state); the kit halves
# them every step while grads and counts change, under fail_on_recompile.
INJECTED = {
    "sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": dict(lr=1e-2, weight_decay=0.01),
    "adamw": dict(lr=1e-2, betas=(0.9, 0.99)),
    "lion": dict(lr=1e-3, weight_decay=0.1),
    "lamb": dict(lr=1e-2, weight_decay=0.1),
    "lars": dict(lr=0.1, weight_decay=0.01),
    "ademamix": dict(lr=1e-2, b3=0.99, alpha=5.0, weight_decay=0.1),
    "cautious_adamw": dict(lr=1e-2, weight_decay=0.1),
    "mup_adamw": dict(lr=1e-2, weight_decay=0.1, base_shapes=_half_width),
    "mup_sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.01, base_shapes=_half_width),
    "adopt": dict(lr=1e-2, b2=0.999, weight_decay=0.1),
    "prodigy": dict(lr=1.0, d0=1e-3, weight_decay=0.1),
    "mars": dict(lr=1e-2, gamma=0.05, weight_decay=0.1),
    "laprop": dict(lr=1e-2, weight_decay=0.1),
    "adamc": dict(lr=1e-2, weight_decay=0.1),
    "kron": dict(lr=1e-2, b1=0.9, weight_decay=0.1, update_prob=0.5),
}


@pytest.mark.parametrize("name", sorted(INJECTED))
def test_each_optimizer_compiles_once_while_its_hyperparameters_change(name, kwargs_for):
    factory = lambda: ps.inject_hyperparams(getattr(ps, name))(**INJECTED[name])  # noqa: E731
    check_transform(factory, checks=(), compile=True, **kwargs_for(TRANSFORMS[name]))
