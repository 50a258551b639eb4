"""Property-test your own optimizer with purestep.core.testing.

A sign-momentum optimizer (signSGD with momentum, "Signum") written as a pure transform,
checked with the invariants purestep runs on its own optimizers; then a variant with a
planted bug (it updates its momentum buffer in place), and the failure the kit reports.

    python examples/custom_optimizer.py
"""

from typing import NamedTuple

import torch

import purestep.core as ps
from purestep.core.testing import check_bounded_updates, check_transform, hyperparams


class SignMomentumState(NamedTuple):
    mu: dict  # momentum buffers, like params


def sign_momentum(lr: float = 1e-3, momentum: float = 0.9, *, in_place: bool = False) -> ps.Transform:
    """m ← μ·m + (1-μ)·g;  p ← p - η·sign(m)."""

    def init(params):
        return SignMomentumState(ps.tree_zeros_like(params))

    def update(grads, state, params=None, **extra):
        if in_place:  # the planted bug: mutates the caller's state
            mu = ps.tree_map(lambda m, g: m.mul_(momentum).add_(g, alpha=1 - momentum), state.mu, grads)
        else:
            mu = ps.tree_map(lambda m, g: momentum * m + (1 - momentum) * g, state.mu, grads)
        return ps.tree_map(lambda m: -lr * torch.sign(m), mu), SignMomentumState(mu)

    return ps.Transform(init, update)


if __name__ == "__main__":
    # The checks: purity, state stability, update structure, finite outputs, determinism, composition,
    # over random trees (rank 0-4, float32/float64/bfloat16) and grads (zero, huge, tiny), random lr/momentum.
    check_transform(sign_momentum, hyperparams=hyperparams("lr", "momentum"))
    check_bounded_updates(lambda: sign_momentum(lr=1e-3), bound=1e-3)  # |update| <= lr, always
    print("sign_momentum: every invariant holds\n")

    try:
        check_transform(lambda: sign_momentum(in_place=True))
    except AssertionError as failure:
        print("sign_momentum(in_place=True) fails:\n")
        print(failure)
    else:
        raise SystemExit("the planted bug was not caught")
