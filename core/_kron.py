"""PSGD-Kron: SGD with momentum, preconditioned by Kronecker-factored matrices fitted online (Li 2015/2018).

The rule is written once, on `kron` below; `scale_by_kron` is the block. Each leaf keeps one
factor per dimension, an upper-triangular matrix (a dense preconditioner for that dimension)
or a diagonal; the preconditioner is P = ⊗ᵢ QᵢᵀQᵢ. With probability p(step) an update
refits the factors from a Hessian-vector-free probe: a Gaussian vector drawn from a
counter-based generator keyed by the state (`key`, the step and the leaf), never torch's
global RNG, so a run and its resume from a checkpoint draw the same probes. The refit is a
`torch.cond` on that draw: compiled, the step never waits on the host and never recompiles.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _foreach as ls
from . import _low_precision as lp
from ._weight_decay import decayed
from ._base import (
    check_bool,
    Params,
    ScalarOrSchedule,
    Transform,
    as_float64,
    check_beta,
    check_hyperparam,
    check_int,
    check_nonnegative,
    check_positive,
    leaf_device,
    once,
    resolve,
    zero_count,
)
from ._blocks import scale_by_lr
from ._combine import chain
from ._schedules import _schedule
from ._cond import as_is, cond, fresh, plain_branch
from .engine import owners
from .engine.dtensor import is_dtensor
from .engine.needs import Needs, with_needs

_MODES = (None, "one_diag", "smart_one_diag", "all_diag")
_TINY = torch.finfo(torch.bfloat16).tiny  # the refit's guard against 0 / 0, as the reference's
_PROBE, _COIN = 0x51, 0x52  # salts: the probe's bits and the refit's coin never share a hash


class ScaleByKronState(NamedTuple):
    """State of `scale_by_kron`: the momentum (like the params), the generator's `key` and,
    per leaf, a tuple of one factor per dimension: (d, d) upper triangular or (d,) diagonal
    (a 0-d leaf has one (1,) factor)."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates so far
    key: Tensor  # (), int64: the probe generator's seed
    mu: Params
    q: Any


def update_probability(
    max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001, flat_start: int = 500
) -> Any:
    """PSGD-Kron's refit probability at update t (from 0): max_prob for `flat_start` updates,
    then max_prob·exp(-decay·(t - flat_start)), never below `min_prob` (the default of
    kron_torch and pytorch_optimizer's Kron: every update for 500, 3% from about 4000 on;
    HeavyBall 3.2's PSGDKron stays flat for 1000 updates, then decays as 0.999ⁿ).

    Examples:
        >>> import torch, purestep.core as ps
        >>> p = ps.kron_update_probability()
        >>> [round(p(t), 4) for t in (0, 500, 1000, 10000)]
        [1.0, 1.0, 0.6065, 0.03]
    """
    for name, value in (("max_prob", max_prob), ("min_prob", min_prob)):
        check_hyperparam(name, value)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if min_prob > max_prob:
        raise ValueError(f"min_prob={min_prob} must be at most max_prob={max_prob}")
    check_nonnegative("decay", decay)
    check_int("flat_start", flat_start, 0)

    def fn(t: Tensor) -> Tensor:
        return torch.clamp(max_prob * torch.exp(-decay * (t - flat_start)), min_prob, max_prob)

    return _schedule(fn, "kron_update_probability")


def _uniform(x: Tensor, seed: Tensor) -> Tensor:
    """Uniform numbers in (0, 1) shaped like `x` (its dtype), 24 random bits each, from the hash of `seed`."""
    bits = (lp._random_bits(x, seed=seed) >> 8) & 0xFFFFFF
    return (bits.to(x.dtype) + 0.5) * 2.0**-24


def probe(x: Tensor, key: Tensor, count: Tensor, leaf: int) -> Tensor:
    """The refit's standard normal probe for leaf number `leaf` at update `count` (Box-Muller
    over two counter-based hashes): a function of (key, count, leaf, element index) alone."""
    base = lp.leaf_key(count, leaf, _PROBE) ^ (key & 0xFFFFFFFF)
    u1 = _uniform(x, lp.leaf_seed(base))
    u2 = _uniform(x, lp.leaf_seed(base ^ 0x9E3779B9))
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


def _coin(key: Tensor, count: Tensor) -> Tensor:
    """A uniform number in (0, 1), float64, for the refit at update `count`."""
    one = torch.zeros(1, dtype=torch.float64, device=count.device)
    return _uniform(one, lp.leaf_seed(lp.leaf_key(count, 0, _COIN) ^ (key & 0xFFFFFFFF)))[0]


def _diagonals(shape: tuple[int, ...], max_size: int, min_ndim: int, mode: str | None) -> list[bool]:
    """Which dimensions get a diagonal factor (the rest a triangular one), as the reference decides."""
    n = len(shape)
    diag = [False] * n
    largest = max(range(n), key=lambda i: (shape[i], i))  # ties: the last such dim, as numpy's argsort reversed
    if mode == "all_diag":
        diag = [True] * n
    elif mode == "one_diag" or (mode == "smart_one_diag" and n >= 2 and sorted(shape)[-1] > sorted(shape)[-2]):
        diag[largest] = True
    return [d or size == 1 or size > max_size or n < min_ndim for d, size in zip(diag, shape)]


def _along(x: Tensor, q: Tensor, i: int) -> Tensor:
    """x with dimension i multiplied by q: Σ_b q[a, b]·x[.., b, ..] (a matrix) or q[a]·x[.., a, ..]."""
    if q.dim() == 1:
        return x * q.view([-1 if j == i else 1 for j in range(x.dim())])
    return torch.tensordot(q, x, dims=([1], [i])).movedim(0, i)


def _solve_along(x: Tensor, q: Tensor, i: int) -> Tensor:
    """x with dimension i multiplied by Q⁻ᵀ: Σ_a x[.., a, ..]·Q⁻¹[a, b] (a triangular solve) or x / q."""
    if q.dim() == 1:
        return x / q.view([-1 if j == i else 1 for j in range(x.dim())])
    y = x.movedim(i, -1)
    flat = torch.linalg.solve_triangular(q, y.reshape(-1, y.shape[-1]), upper=True, left=False)
    return flat.reshape(y.shape).movedim(-1, i)


def _gram(x: Tensor, i: int, diagonal: bool) -> Tensor:
    """x's Gram matrix along dimension i (the others contracted), or its diagonal."""
    rest = [d for d in range(x.dim()) if d != i]
    if diagonal:
        return (x * x).sum(dim=rest) if rest else x * x
    return torch.tensordot(x, x, dims=(rest, rest))


def _norm_lower_bound(a: Tensor) -> Tensor:
    """A lower bound of the spectral norm of the symmetric matrix `a` (kron_torch's estimate:
    one power step from its largest row or column)."""
    tiny = torch.finfo(a.dtype).tiny
    top = a.abs().amax()
    a = a / torch.where(top > 0, top, torch.ones_like(top))
    aa = a * a
    value0, i = torch.max(aa.sum(dim=0), 0)
    value1, j = torch.max(aa.sum(dim=1), 0)
    x0 = a.index_select(1, i.reshape(1)).flatten() @ a
    bound0 = torch.linalg.vector_norm((x0 / torch.linalg.vector_norm(x0).clamp_min(tiny)) @ a.T)
    x1 = a @ a.index_select(0, j.reshape(1)).flatten()
    bound1 = torch.linalg.vector_norm(a.T @ (x1 / torch.linalg.vector_norm(x1).clamp_min(tiny)))
    return top * torch.where(value0 > value1, bound0, bound1)


def _refit(g: Tensor, v: Tensor, qs: list[Tensor], lr: float) -> list[Tensor]:
    """The factors after one fit on the pair (v, g), balanced first (the same P, factors of equal size)."""
    if len(qs) > 1:
        norms = torch.stack([q.abs().amax() for q in qs])
        mean = norms.prod() ** (1.0 / len(qs))
        qs = [q * (mean / n) for q, n in zip(qs, norms)]
    a, b = g, v
    for i, q in enumerate(qs):
        a, b = _along(a, q, i), _solve_along(b, q, i)
    out = []
    for i, q in enumerate(qs):
        t1, t2 = _gram(a, i, q.dim() == 1), _gram(b, i, q.dim() == 1)
        if q.dim() == 1:
            out.append(q - lr * (t1 - t2) * q / ((t1 + t2).abs().amax() + _TINY))
        else:
            step = torch.triu(t1 - t2) * lr / (_norm_lower_bound(t1 + t2) + _TINY)
            out.append(q - step @ q)
    return out


def _precondition(g: Tensor, qs: list[Tensor]) -> Tensor:
    """P·g with P = ⊗ᵢ QᵢᵀQᵢ (qᵢ² for a diagonal factor)."""
    for i, q in enumerate(qs):
        g = _along(g, q * q if q.dim() == 1 else q.T @ q, i)
    return g


def _whole(x: Any) -> Tensor:
    """A DTensor gathered whole on every rank (the refit is math over whole matrices), else x."""
    return x.full_tensor() if is_dtensor(x) else x


def _placed_like(u: Tensor, x: Any) -> Tensor:
    """`u`, computed whole on every rank, with `x`'s placements when `x` is a DTensor (no collective)."""
    if not is_dtensor(x):
        return u
    from torch.distributed.tensor import DTensor, Replicate

    mesh = x.device_mesh
    whole = DTensor.from_local(u, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, x.placements)


def scale_by_kron(
    b1: ScalarOrSchedule = 0.9,
    *,
    update_prob: ScalarOrSchedule | None = None,
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    precond_lr: float = 0.1,
    precond_init_scale: float = 1.0,
    precond_dtype: torch.dtype | None = None,
    seed: int = 0,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """PSGD-Kron's preconditioned direction (the update before lr and decay); see `kron`.

    Runs per leaf (its factors are not shaped like the params): `make_update` compiles it per
    leaf with `compile=True`. On DTensor params the sharded path models (FSDP2, HSDP, TP), in
    float32 or float64 with `mu_dtype=None`, each leaf's update runs at one rank, its owner,
    where its momentum and factors live (`engine/owners.py`); otherwise every rank refits and
    preconditions the whole leaf.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale_by_kron()
        >>> g = {"w": torch.randn(4, 3), "b": torch.randn(3)}
        >>> s = t.init(g)
        >>> [tuple(q.shape) for q in s.q["w"]], [tuple(q.shape) for q in s.q["b"]]
        ([(4, 4), (3, 3)], [(3,)])
        >>> u, s = t.update(g, s)
        >>> bool(u["w"].square().mean().sqrt() <= 1.1)
        True
    """
    check_hyperparam("b1", b1)
    check_beta("b1", b1)
    if update_prob is not None:
        check_hyperparam("update_prob", update_prob)
        if not callable(update_prob) and not 0.0 <= float(update_prob) <= 1.0:
            raise ValueError(f"update_prob must be in [0, 1], got {update_prob}")
    check_int("max_size_triangular", max_size_triangular, 1)
    check_int("min_ndim_triangular", min_ndim_triangular, 0)
    if memory_save_mode not in _MODES:
        raise ValueError(f"memory_save_mode must be one of {_MODES}, got {memory_save_mode!r}")
    check_bool("momentum_into_precond_update", momentum_into_precond_update)
    check_positive("precond_lr", precond_lr)
    check_positive("precond_init_scale", precond_init_scale)
    if precond_dtype is not None and precond_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"precond_dtype must be torch.float32, torch.float64 or None, got {precond_dtype}")
    check_int("seed", seed, 0)
    lp.check_stored("mu_dtype", mu_dtype, rounding)
    prob = update_probability() if update_prob is None else update_prob

    def dtype_of(p: Tensor) -> torch.dtype:
        return precond_dtype or torch.promote_types(p.dtype, torch.float32)

    def factors(p: Tensor) -> tuple[Tensor, ...]:
        shape = tuple(p.shape) or (1,)
        scale = precond_init_scale ** (1.0 / len(shape))
        diag = _diagonals(shape, max_size_triangular, min_ndim_triangular, memory_save_mode)
        dtype, device = dtype_of(p), p.device
        return tuple(
            scale * (torch.ones(d, dtype=dtype, device=device) if is_diag else torch.eye(d, dtype=dtype, device=device))
            for d, is_diag in zip(shape, diag)
        )

    def owned(leaves: list) -> Any:
        """The leaves' `engine.owners` when the momentum and factors live at each leaf's owner:
        DTensor params in a placement the engine models, momentum kept in their own float32
        or float64 (nothing to round)."""
        full = mu_dtype is None and all(x.dtype in (torch.float32, torch.float64) for x in leaves)
        return owners.of(leaves) if full and owners.takes(leaves) else None

    def init(params: Params) -> ScaleByKronState:
        leaves, spec = pytree.tree_flatten(params)
        at = owned(leaves)
        count = zero_count(at.device if at is not None else leaf_device(leaves))
        key = torch.full((), seed, dtype=torch.int64, device=count.device)
        if at is None:
            return ScaleByKronState(count, key, lp.init_moments(params, mu_dtype), pytree.tree_map(factors, params))
        # Each leaf's momentum and factors at the rank that runs its math (`engine.owners`).
        mus = [at.zeros(i, tuple(p.shape), p.dtype) for i, p in enumerate(leaves)]
        qs = [tuple(at.placed(i, f if at.owner[i] in (None, at.me) else f[:0], f.shape) for f in factors(p))
              for i, p in enumerate(leaves)]  # fmt: skip
        return ScaleByKronState(count, key, pytree.tree_unflatten(mus, spec), pytree.tree_unflatten(qs, spec))

    def update(grads, state, params=None, **extra):
        count = state.count
        beta1 = as_float64(resolve(b1, count), count.device)
        bc1 = once(1.0 - beta1 ** (count + 1).to(torch.float64))
        refit = _coin(state.key, count) < as_float64(resolve(prob, count), count.device)
        out_ = as_is if plain_branch(refit) else fresh

        def leaf(n: int, mu: Tensor, g: Tensor | None, qs: Any) -> tuple[Tensor, tuple]:
            """Leaf `n`'s direction and factors from its whole momentum (after this update's
            EMA) and, unless the momentum fits the preconditioner, its whole grad."""
            cd = qs[0].dtype
            shape = tuple(mu.shape) or (1,)
            m_hat = (mu / bc1.to(mu.dtype)).to(cd).reshape(shape)
            fit_on = m_hat if g is None else g.to(cd).reshape(shape)

            def renew(fit_on, key, count, *qs):
                v = probe(fit_on, key, count, n)
                return tuple(out_(q) for q in _refit(fit_on, v, list(qs), precond_lr))

            def keep(fit_on, key, count, *qs):
                return tuple(out_(q) for q in qs)

            qs = tuple(cond(refit, renew, keep, (fit_on, state.key, count, *qs)))
            d = _precondition(m_hat, list(qs))
            return d * torch.clamp(1.1 / (d.square().mean().sqrt() + 1e-6), max=1.0), qs  # RMS at most 1.1

        spec = pytree.tree_structure(grads)
        if owners.holds(spec.flatten_up_to(state.mu)):  # the state init placed at the leaves' owners
            at = owners.of(spec.flatten_up_to(grads))
            assert at is not None, "Kron's state is at the leaves' owners, but these grads are laid out otherwise"
            return owned_update(grads, state, at, beta1, leaf)
        gs, wide, mus = lp.load_moments(grads, state.mu, params)
        q_leaves = spec.flatten_up_to(state.q)  # a tuple of factors per leaf (the params' own tuples are not leaves)
        new_mus = ls.ema(mus, wide, beta1)  # m ← β₁·m + (1-β₁)·g
        outs, new_qs = [], []
        for n, (g, gw, mu, qs) in enumerate(zip(gs, wide, new_mus, q_leaves)):
            if g.numel() == 0:  # nothing to precondition (and no factor to refit)
                new_qs.append(qs)
                outs.append(torch.zeros_like(g))
                continue
            fit_g = None if momentum_into_precond_update else _whole(gw)
            d, qs = leaf(n, _whole(mu), fit_g, qs)
            new_qs.append(qs)
            outs.append(_placed_like(d.reshape(g.shape).to(g.dtype), g))
        keys = lp.moment_keys(count, rounding, state.mu)
        new_state = ScaleByKronState(
            count + 1,
            state.key,
            lp.store_moments(new_mus, state.mu, keys),
            pytree.tree_unflatten(new_qs, spec),
        )
        return pytree.tree_unflatten(outs, spec), new_state

    def owned_update(grads, state, at, beta1, leaf):
        # Each leaf at its owner, on its whole grad (one exchange each way): m ← β₁·m + (1-β₁)·g
        # there, then the refit and the preconditioned direction; momentum and factors stay there.
        spec = pytree.tree_structure(grads)
        gs, mus, q_leaves = spec.flatten_up_to(grads), spec.flatten_up_to(state.mu), spec.flatten_up_to(state.q)

        def at_owner(n: int, g: Tensor, held: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            (mu,) = ls.ema([held[0]], [g], beta1)
            if g.numel() == 0:
                return torch.zeros_like(g), [mu, *held[1:]]
            d, qs = leaf(n, mu, None if momentum_into_precond_update else g, tuple(held[1:]))
            return d.reshape(g.shape).to(g.dtype), [mu, *qs]

        outs, new = at.run(at_owner, gs, [[m, *qs] for m, qs in zip(mus, q_leaves)])
        unflat = lambda xs: pytree.tree_unflatten(xs, spec)  # noqa: E731
        new_state = ScaleByKronState(
            state.count + 1, state.key, unflat([n[0] for n in new]), unflat([tuple(n[1:]) for n in new])
        )
        return unflat(outs), new_state

    why = (
        "PSGD-Kron keeps per-leaf Kronecker factors (one matrix or diagonal per dimension), not shaped like the params "
        "(on float32/float64 DTensor params, with mu_dtype None: each leaf's update and state at its owner rank)"
    )
    return with_needs(Transform(init, update), Needs(flat=why))


def kron(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    mask: Any = None,
    update_prob: ScalarOrSchedule | None = None,
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    precond_lr: float = 0.1,
    precond_init_scale: float = 1.0,
    precond_dtype: torch.dtype | None = None,
    seed: int = 0,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """PSGD-Kron (Li 2015/2018; kron_torch, HeavyBall's `PSGDKron`, pytorch_optimizer's `Kron`):
    momentum preconditioned by Kronecker-factored matrices fitted online.

    Per leaf of shape (d₁, …, d_k), one factor Qᵢ per dimension: upper triangular d × d,
    or a diagonal where dᵢ = 1, dᵢ > `max_size_triangular`, k < `min_ndim_triangular` or
    `memory_save_mode` says so ("one_diag": the largest dim; "smart_one_diag": the largest
    when it is strictly the largest; "all_diag"); each starts as `precond_init_scale`^(1/k)·I.
    With P = ⊗ᵢ QᵢᵀQᵢ:

        m ← β₁·m + (1-β₁)·g;   m̂ = m / (1-β₁ᵗ)
        with probability p(t): refit every Qᵢ on (v, h), v ~ N(0, I) a probe, h = m̂ (or g
          with momentum_into_precond_update=False): A = h ×ᵢ Qᵢ, B = v ×ᵢ Qᵢ⁻ᵀ,
          Qᵢ ← Qᵢ − η_p·triu(AᵢAᵢᵀ − BᵢBᵢᵀ)·Qᵢ / ‖AᵢAᵢᵀ + BᵢBᵢᵀ‖ (a spectral-norm lower
          bound; a diagonal factor: elementwise, over the max-norm), the factors balanced first
        d = P·m̂, scaled down to RMS 1.1 where larger
        p ← p − η·(d + λ·p)

    with η = `lr`, β₁ = `b1`, λ = `weight_decay` (decoupled, on the leaves `mask` selects),
    η_p = `precond_lr`, t the step from 1 and p(t) = `update_prob` (None: the reference's
    schedule, `kron_update_probability()`). This is pytorch_optimizer's `Kron` (kron_torch),
    checked against it in float64 with the same probes; there the refit comes every
    ⌈1/p⌉-th update and the factors are balanced at random (1%), here the refit comes at
    random with probability p and the factors are balanced at every refit (which does not
    change P).

    HeavyBall's `PSGDKron` (3.2) differs by its defaults, not by the algorithm (with them
    aligned its diagonal factors equal these to float32 rounding): the refit's normalizer is a
    running bound kept across refits (`lower_bound_beta=0.9`) instead of each refit's own
    bound, the init scale is taken from the
    first grad (`mean(g⁴)^(-1/16)`), the update is clipped elementwise (a trust region) instead
    of by its RMS, and triangular factors stop at 2048. On LightBench's small quadratics with
    vanishing grads (`benchmarks/bench_scoreboard.py`: batch_size_scaling, quadratic_quantized_gradient)
    the running bound is what wins them within 1000 steps, and HeavyBall's init scale is what
    wins sparse_parameters sooner. pytorch_optimizer's Kron and this one follow the same
    curves there (`results/2026-11-29-scoreboard-cpu.md`); it wins batch_size_scaling at lr
    3e-2 (722 steps) where this one wins at no lr of the grid (closest: 8e-8 against the
    1e-8 threshold, at lr 0.3): the refit draws differ (theirs every ⌈1/p⌉ updates, these at
    random).

    Args:
      lr: η. b1: β₁. weight_decay: λ; the references decay only leaves of 2 or more dims:
        pass `mask=lambda p: {k: v.dim() >= 2 for k, v in p.items()}` for theirs.
      update_prob: the refit probability, a float in [0, 1] or a schedule of the update
        count (t - 1).
      precond_dtype: the factors' dtype; None: float32, or float64 for float64 params.
      seed: the probe generator's seed, kept in the state (`key`): the probes and refit
        draws are a hash of (key, update count, leaf, element), the same eagerly, compiled,
        on any device and after a resume; change the seed for a different draw.
      mu_dtype, rounding: how m is stored; see `adam`.

    Warning:
        A step runs per leaf (factors are d × d matrices), so `make_update` compiles it per
        leaf, not on flat buffers; on DTensor leaves (FSDP2, HSDP, TP) each leaf at its owner
        rank (see `scale_by_kron`). Memory: one d × d matrix per triangular dimension, held
        by that rank alone.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.kron(1e-2)
        >>> params = {"w": torch.ones(3, 2)}
        >>> state = opt.init(params)
        >>> for _ in range(3):
        ...     u, state = opt.update({"w": torch.randn(3, 2)}, state, params)
        ...     params = ps.apply_updates(params, u)
        >>> int(ps.tree_get(state, "count")), [tuple(q.shape) for q in ps.tree_get(state, "q")["w"]]
        (3, [(3, 3), (2, 2)])

    References:
        Li, Preconditioned Stochastic Gradient Descent, IEEE TNNLS 2018 (arXiv 1512.04202);
        Li, Preconditioner on Matrix Lie Group for SGD, ICLR 2019 (arXiv 1809.10232).
    """
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    block = scale_by_kron(
        b1,
        update_prob=update_prob,
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=min_ndim_triangular,
        memory_save_mode=memory_save_mode,
        momentum_into_precond_update=momentum_into_precond_update,
        precond_lr=precond_lr,
        precond_init_scale=precond_init_scale,
        precond_dtype=precond_dtype,
        seed=seed,
        mu_dtype=mu_dtype,
        rounding=rounding,
    )
    return chain(block, decayed(weight_decay, mask), scale_by_lr(lr))
