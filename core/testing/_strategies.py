"""Hypothesis strategies and drawn examples for `purestep.core.testing` (which re-exports the public ones)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import hypothesis
import torch
from hypothesis import strategies as st
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# Grad magnitudes drawn; hypothesis tries the first in its simplest example and shrinks toward it.
GRAD_KINDS = ("zeros", "normal", "huge", "tiny", "mixed")
_MAGNITUDE = {"normal": 1.0, "zeros": 0.0, "huge": 1e10, "tiny": 1e-10}


# --------------------------------------------------------------------------- #
# Building trees from small, readable descriptions (what hypothesis shrinks).
# --------------------------------------------------------------------------- #


def seeded_tensor(shape: Sequence[int], dtype: torch.dtype, magnitude: float, seed: int, device: Any = "cpu") -> Tensor:
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * magnitude).to(device=device, dtype=dtype)


def grads_like(params: dict[str, Tensor], kind: str, seed: int, *, nonnegative: bool = False) -> dict[str, Tensor]:
    out = {}
    for i, (name, p) in enumerate(params.items()):
        leaf_kind = ("normal", "zeros", "huge", "tiny")[(seed + i) % 4] if kind == "mixed" else kind
        g = seeded_tensor(p.shape, p.dtype, _MAGNITUDE[leaf_kind], seed * 1009 + i, p.device)
        out[name] = g.abs() if nonnegative else g
    return out


def brief(t: Tensor) -> str:
    name = str(t.dtype).replace("torch.", "")
    text = f"{name}{list(t.shape)}"
    if t.numel() <= 3:
        text += f"={[round(v, 4) for v in t.double().reshape(-1).tolist()]}"
    return text


class Example:
    """One drawn input for the checks: params, then per step a grads kind and seed
    (printed briefly, as hypothesis's counterexample)."""

    def __init__(self, params, param_seed, grads, grad_kinds, extras, hyperparams):
        self.params: dict[str, Tensor] = params
        self.param_seed: int = param_seed
        self.grads: list[dict[str, Tensor]] = grads
        self.grad_kinds: list[tuple[str, int]] = grad_kinds
        self.extras: list[dict[str, Any]] = extras
        self.hyperparams: dict[str, Any] = hyperparams

    def replace(self, **changes: Any) -> "Example":
        fields = dict(vars(self), **changes)
        return Example(**fields)

    def __repr__(self) -> str:
        params = "{" + ", ".join(f"{k!r}: {brief(v)}" for k, v in self.params.items()) + "}"
        grads = ", ".join(k if k == "zeros" else f"{k}(seed={s})" for k, s in self.grad_kinds)
        extra = "".join(f"; step {i} extra {sorted(e)}" for i, e in enumerate(self.extras) if e)
        hp = f"; hyperparams {self.hyperparams}" if self.hyperparams else ""
        return f"Example(params={params} (seed={self.param_seed}); grads per step: [{grads}]{extra}{hp})"


# --------------------------------------------------------------------------- #
# Strategies.
# --------------------------------------------------------------------------- #

_seeds = st.integers(min_value=0, max_value=2**16)


def _layouts(min_leaves, max_leaves, min_rank, max_rank, max_side, dtypes):
    leaf = st.tuples(
        st.lists(st.integers(1, max_side), min_size=min_rank, max_size=max_rank).map(tuple),
        st.sampled_from(tuple(dtypes)),
    )
    return st.lists(leaf, min_size=min_leaves, max_size=max_leaves)


def _build_params(layout, seed: int, zero: bool, device: Any = "cpu") -> dict[str, Tensor]:
    return {
        f"p{i}": seeded_tensor(shape, dtype, 0.0 if zero else 1.0, seed + i, device)
        for i, (shape, dtype) in enumerate(layout)
    }


def param_trees(
    *,
    min_leaves: int = 1,
    max_leaves: int = 4,
    min_rank: int = 0,
    max_rank: int = 4,
    max_side: int = 3,
    dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    zeros: bool = True,
) -> st.SearchStrategy[dict[str, Tensor]]:
    """Params trees `{"p0": tensor, ...}`: ranks `min_rank..max_rank`, sides `1..max_side`
    (size-1 dims included), dtypes from `dtypes`, values N(0, 1) (or all zero, a bias at init).

    Examples:
        >>> from hypothesis import given
        >>> from purestep.core.testing import param_trees
        >>> @given(param_trees(max_rank=2))
        ... def test(params):
        ...     assert all(p.dim() <= 2 for p in params.values())
        >>> test()
    """
    return st.builds(
        _build_params,
        _layouts(min_leaves, max_leaves, min_rank, max_rank, max_side, dtypes),
        _seeds,
        st.booleans() if zeros else st.just(False),
    )


def grad_trees(params: dict[str, Tensor], kinds: Iterable[str] = GRAD_KINDS) -> st.SearchStrategy[dict[str, Tensor]]:
    """Grads trees matching `params` leaf for leaf (shape and dtype), of a magnitude drawn
    from `kinds`: "normal" N(0, 1), "zeros", "huge" (1e10), "tiny" (1e-10), "mixed" (per leaf)."""
    kinds = tuple(kinds)
    unknown = set(kinds) - set(GRAD_KINDS)
    if unknown:
        raise ValueError(f"kinds has unknown entries {sorted(unknown)}; choose from {GRAD_KINDS}")
    return st.builds(lambda kind, seed: grads_like(params, kind, seed), st.sampled_from(kinds), _seeds)


def log_uniform(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


_HYPERPARAMS: dict[str, Callable[[], st.SearchStrategy]] = {
    "lr": lambda: log_uniform(1e-4, 1.0),
    "weight_decay": lambda: st.floats(0.0, 0.2),
    "momentum": lambda: st.floats(0.0, 0.99),
    "eps": lambda: log_uniform(1e-10, 1e-6),
    "betas": lambda: st.tuples(st.floats(0.0, 0.99), st.floats(0.9, 0.9999)),
}


def hyperparams(*names: str, **strategies: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword dicts of hyperparameters in their usual ranges, to call a factory with.

    Known names: lr (1e-4..1, log), weight_decay (0..0.2), momentum (0..0.99),
    eps (1e-10..1e-6, log), betas ((0..0.99), (0.9..0.9999)); any other name takes a
    strategy as a keyword.

    Examples:
        >>> from hypothesis import strategies as st
        >>> from purestep.core.testing import hyperparams
        >>> hp = hyperparams("lr", "betas", weight_decay=st.just(0.0))
    """
    fields = {}
    for name in names:
        if name not in _HYPERPARAMS:
            raise ValueError(
                f"no default range for {name!r}; pass it as {name}=<strategy>, or one of {sorted(_HYPERPARAMS)}"
            )
        fields[name] = _HYPERPARAMS[name]()
    fields.update(strategies)
    return st.fixed_dictionaries(fields)


@dataclasses.dataclass(frozen=True)
class Options:
    steps: int = 3
    needs_params: bool = True
    matrices_only: bool = False
    dtypes: tuple = FLOAT_DTYPES
    kinds: tuple = GRAD_KINDS
    grad_like_extra: tuple = ()
    extra: Any = None
    hyperparams: Any = None
    max_leaves: int = 4
    device: Any = "cpu"


def _example(
    opts: Options, layout, param_seed: int, kinds: list, with_extra: Callable[[int], bool], hp: dict
) -> Example:
    params = _build_params(layout, param_seed, zero=False, device=opts.device)
    grads = [grads_like(params, k, s) for k, s in kinds]
    extras = []
    for i in range(len(kinds)):
        extra = dict(opts.extra or {})
        for name in opts.grad_like_extra:
            if with_extra(i):
                extra[name] = grads_like(params, "normal", 7919 + 31 * i + kinds[i][1], nonnegative=True)
        extras.append(extra)
    return Example(params, param_seed, grads, kinds, extras, hp)


@st.composite
def _examples(draw, opts: Options) -> Example:
    layout = draw(_layouts(1, opts.max_leaves, 2 if opts.matrices_only else 0, 4, 3, opts.dtypes))
    param_seed = draw(_seeds)
    kinds = draw(st.lists(st.tuples(st.sampled_from(opts.kinds), _seeds), min_size=1, max_size=opts.steps))
    flags = [draw(st.booleans()) for _ in kinds] if opts.grad_like_extra else []
    hp = draw(opts.hyperparams) if opts.hyperparams is not None else {}
    return _example(opts, layout, param_seed, kinds, lambda i: flags[i], hp)


def _edge_examples(opts: Options) -> list[Example]:
    """One small leaf, one step of each grad kind: tried first, whatever hypothesis draws.

    Hypothesis's derandomized draws differ between its versions and even between runs
    in one process, so edge grads (all-zero, huge, tiny) are never left to chance.
    Without fixed hyperparameters (a `hyperparams` strategy) there are none.
    """
    if opts.hyperparams is not None:
        return []
    layout = [((2, 3) if opts.matrices_only else (), opts.dtypes[0])]
    kinds = [k for k in ("normal", "zeros", "huge", "tiny") if k in opts.kinds]
    return [_example(opts, layout, 0, [(k, 0)], lambda i: True, {}) for k in kinds]


def given_examples(opts: Options, *more: st.SearchStrategy) -> Callable:
    """`hypothesis.given(examples, *more)` with the edge examples tried first."""

    def decorate(test: Callable) -> Callable:
        if not more:
            for ex in reversed(_edge_examples(opts)):  # run top to bottom: in the listed order
                test = hypothesis.example(ex)(test)
        return hypothesis.given(_examples(opts), *more)(test)

    return decorate
