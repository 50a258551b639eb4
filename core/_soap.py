"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024).

The update rule is written once, on `soap` below; `scale_by_soap` is the block. The
eigenbasis is set up at the first update (eigh) and refreshed every
`precondition_frequency` updates by one power-iteration step and a QR; between refreshes
a step costs Adam plus the rotations into and out of the basis. Both branches are
`torch.cond`s on the step count: compiled, neither waits on the host (eagerly on the
CPU, where reading the count costs nothing, they are plain branches).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _adam as adam
from . import _low_precision as lp
from ._base import (
    Params,
    ScalarOrSchedule,
    Transform,
    as_float64,
    check_betas,
    check_hyperparam,
    check_int,
    check_nonnegative,
    check_positive,
    leaf_device,
    once,
    resolve,
    zero_count,
)
from ._cond import as_is, cond, fresh, plain_branch
from .engine import owners
from .engine.needs import Needs, with_needs


class SOAPState(NamedTuple):
    """State of `scale_by_soap`, per leaf: `mu` and `nu` (Adam's moments, in the eigenbasis,
    shaped like the params), `gg` (Shampoo's factor per dimension, d × d) and `q` (its
    eigenbasis); a dimension left unpreconditioned holds an empty tensor in both."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates so far, the first (basis set-up only) included
    mu: Params
    nu: Params
    gg: Any
    q: Any


def merged_shape(shape: tuple[int, ...], max_precond_dim: int) -> tuple[int, ...]:
    """The reference's `merge_dims`: neighbouring dims joined while their product stays <= max_precond_dim."""
    out, run = [], 1
    for size in shape:
        if run * size > max_precond_dim:
            if run > 1:
                out.append(run)
                run = size
            else:
                out.append(size)
                run = 1
        else:
            run *= size
    if run > 1 or not out:
        out.append(run)
    return tuple(out)


def _project(x: Tensor, qs: list[Tensor | None], back: bool) -> Tensor:
    """`x` rotated into (or, `back`, out of) the eigenbasis, dimension by dimension (None: a
    dimension left as it is)."""
    for q in qs:
        if q is not None:
            x = torch.tensordot(x, q, dims=([0], [1 if back else 0]))  # the rotated dim goes last
        else:
            x = x.permute(*range(1, x.dim()), 0)
    return x


def _present(xs: list, have: list[bool] | None = None) -> list:
    """The entries of dimensions that are preconditioned (not None, or marked in `have`)."""
    return [x for i, x in enumerate(xs) if (x is not None if have is None else have[i])]


def _spread(present: Any, have: list[bool]) -> list:
    """The per-dimension list again: `present` in order where `have`, None elsewhere."""
    it = iter(present)
    return [next(it) if h else None for h in have]


def _unflat(args: tuple, k: int) -> tuple:
    """A cond's flat operands back as (g, mu, nu, factors, bases, beta1, beta2, beta_s, bc, refresh)."""
    return (*args[:3], list(args[3 : 3 + k]), list(args[3 + k : 3 + 2 * k]), *args[3 + 2 * k :])


def _factors(g: Tensor, gg: list[Tensor | None]) -> list[Tensor | None]:
    """g's Gram matrix along each preconditioned dimension (the others contracted)."""
    out = []
    for i, f in enumerate(gg):
        rest = [d for d in range(g.dim()) if d != i]
        out.append(torch.tensordot(g, g, dims=(rest, rest)) if f is not None else None)
    return out


def _eigenbasis(gg: list[Tensor | None]) -> list[Tensor | None]:
    """Eigenvectors of each factor, largest eigenvalue first (the set-up at the first update)."""
    out: list[Tensor | None] = []
    for f in gg:
        if f is None:
            out.append(None)
            continue
        eye = torch.eye(f.shape[0], dtype=f.dtype, device=f.device)
        out.append(torch.linalg.eigh(f + 1e-30 * eye)[1].flip(1))
    return out


def _refresh(gg: list[Tensor | None], q: list[Tensor | None], nu: Tensor) -> tuple[list[Tensor | None], Tensor]:
    """One power-iteration step and a QR per factor; `nu` re-sorted to the new order."""
    out: list[Tensor | None] = []
    for i, (f, o) in enumerate(zip(gg, q)):
        if f is None or o is None:
            out.append(None)
            continue
        order = torch.argsort((o * (f @ o)).sum(dim=0), descending=True)  # diag(oᵀ·f·o): the eigenvalue estimates
        nu = nu.index_select(i, order)
        out.append(torch.linalg.qr(f @ o[:, order])[0])
    return out, nu


def scale_by_soap(
    b1: ScalarOrSchedule = 0.95,
    b2: ScalarOrSchedule = 0.95,
    shampoo_beta: ScalarOrSchedule | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """SOAP's preconditioned direction (the update before lr and decay); see `soap`.

    The first update sets the eigenbasis up and returns zeros. Runs per leaf (its state is
    not shaped like the params): `make_update` compiles it per leaf with `compile=True`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale_by_soap()
        >>> g = {"w": torch.randn(4, 3)}
        >>> s = t.init(g)
        >>> u, s = t.update(g, s)   # the first update: the basis only
        >>> float(u["w"].abs().max()), tuple(s.q["w"][0].shape)
        (0.0, (4, 4))
    """
    check_betas((b1, b2), name="betas")
    if shampoo_beta is not None:
        check_hyperparam("shampoo_beta", shampoo_beta)
        check_nonnegative("shampoo_beta", shampoo_beta)
    check_positive("eps", eps)
    check_int("precondition_frequency", precondition_frequency, 1)
    check_int("max_precond_dim", max_precond_dim, 1)
    lp.check_moments(mu_dtype, nu_dtype, rounding)
    sb = b2 if shampoo_beta is None else shampoo_beta

    def shape_of(p: Tensor) -> tuple[int, ...]:
        return merged_shape(tuple(p.shape), max_precond_dim) if merge_dims and p.dim() > 1 else tuple(p.shape)

    def factor_dims(p: Tensor) -> list[int]:
        """The size of each dimension's factor, 0 where it stays unpreconditioned."""
        shape = shape_of(p)
        if p.dim() <= 1 and not precondition_1d:
            return [0] * len(shape)
        return [d if d <= max_precond_dim else 0 for d in shape]

    owner_path = mu_dtype is None and nu_dtype is None  # moments kept whole at a leaf's owner

    def owned_init(at: Any, leaves: list, spec: Any, wide: Any) -> SOAPState:
        def moments() -> Any:
            return pytree.tree_unflatten([at.zeros(i, tuple(p.shape), wide(p)) for i, p in enumerate(leaves)], spec)

        def factors() -> Any:
            per_leaf = [tuple(at.zeros(i, (d, d), wide(p)) for d in factor_dims(p)) for i, p in enumerate(leaves)]
            return pytree.tree_unflatten(per_leaf, spec)

        return SOAPState(zero_count(at.device), moments(), moments(), factors(), factors())

    def init(params: Params) -> SOAPState:
        leaves, spec = pytree.tree_flatten(params)
        wide = lambda p: torch.promote_types(p.dtype, torch.float32)  # noqa: E731
        if owner_path and owners.takes(leaves):  # each leaf's state at the rank that runs its math
            at = owners.of(leaves)
            assert at is not None
            return owned_init(at, leaves, spec, wide)
        mats = lambda p: tuple(torch.zeros((d, d), dtype=wide(p), device=p.device) for d in factor_dims(p))  # noqa: E731
        zeros = lambda p: torch.zeros(p.shape, dtype=wide(p), device=p.device)  # noqa: E731
        moments = lambda d: pytree.tree_map(zeros, params) if d is None else lp.init_moments(params, d)  # noqa: E731
        return SOAPState(
            zero_count(leaf_device(leaves)),
            moments(mu_dtype),
            moments(nu_dtype),
            pytree.tree_map(mats, params),
            pytree.tree_map(mats, params),
        )

    def update(grads, state, params=None, **extra):
        count = state.count
        # Clones: a cond's operands may not alias each other (beta_s is b2 by default).
        beta1, beta2, beta_s = (as_float64(resolve(b, count), count.device).clone() for b in (b1, b2, sb))
        t = (count).to(torch.float64)  # real updates so far, this one included (the first sets up only)
        bc = once(torch.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)) if correct_bias else as_float64(1.0, count.device)
        first = count == 0
        refresh = (count > 0) & (count % precondition_frequency == 0)
        out_ = as_is if plain_branch(first) else fresh  # cond outputs are copies; plain branches' need not be

        def leaf(gw: Tensor, mu_: Tensor, nu_: Tensor, gg: Any, q: Any) -> tuple:
            """One leaf's step on whole tensors (in its merged shape, the compute dtype):
            (direction, mu, nu, factors, bases)."""
            have = [f.numel() > 0 for f in gg]  # static: which dimensions are preconditioned
            full = lambda xs: _spread(xs, have)  # noqa: E731

            def fold(gw, gg, beta_s):
                return [f.lerp(n, 1.0 - beta_s.to(f.dtype)) for f, n in zip(gg, _present(_factors(gw, full(gg))))]

            k = sum(have)

            def set_up(*args):
                gw, mu_, nu_, gg, q, beta1, beta2, beta_s, bc, refresh = _unflat(args, k)
                gg = fold(gw, gg, beta_s)
                return tuple(out_(x) for x in (torch.zeros_like(gw), mu_, nu_, *gg, *_present(_eigenbasis(full(gg)))))

            def step(*args):
                gw, mu_, nu_, gg, q, beta1, beta2, beta_s, bc, refresh = _unflat(args, k)
                gp = _project(gw, full(q), back=False)
                (mu_,), (nu_,) = adam.moments([mu_], [nu_], [gp], beta1, beta2)  # Adam's, in the eigenbasis
                direction = _project(mu_ / (nu_.sqrt() + eps), full(q), back=True)
                if normalize_grads:
                    direction = direction / (1e-30 + direction.square().mean().sqrt())
                gg = fold(gw, gg, beta_s)

                def renew(mu_, nu_, *gq):
                    gg, q = gq[:k], gq[k:]
                    new_q, nu_ = _refresh(full(gg), full(q), nu_)
                    mu_ = _project(_project(mu_, full(q), back=True), new_q, back=False)
                    return tuple(out_(x) for x in (mu_, nu_, *_present(new_q)))

                def keep(mu_, nu_, *gq):
                    q = gq[k:]
                    return tuple(out_(x) for x in (mu_, nu_, *q))

                mu_, nu_, *q = cond(refresh, renew, keep, (mu_, nu_, *gg, *q))
                return tuple(out_(x) for x in (direction * bc.to(direction.dtype), mu_, nu_, *gg, *q))

            operands = (gw, mu_, nu_, *_present(gg, have), *_present(q, have), beta1, beta2, beta_s, bc, refresh)
            out = cond(first, set_up, step, operands)
            found_gg, found_q = iter(out[3 : 3 + k]), iter(out[3 + k : 3 + 2 * k])
            new_gg = tuple(next(found_gg) if h else f for f, h in zip(gg, have))
            new_q = tuple(next(found_q) if h else f for f, h in zip(q, have))
            return out[0], out[1], out[2], new_gg, new_q

        spec = pytree.tree_structure(grads)
        if owners.holds(spec.flatten_up_to(state.mu)):  # the state init placed at the leaves' owners
            return owned_update(grads, state, leaf)
        outs, mus, nus, ggs, qs = [], [], [], [], []
        # The moments in the compute dtype (float32, or float64 for float64 params), whatever they are stored in.
        gs, wide, mu_in = lp.load_moments(grads, state.mu, params)
        nu_in = lp.load_moments(grads, state.nu, second=True)[2]
        pairs = zip(
            gs,
            wide,
            mu_in,
            nu_in,
            spec.flatten_up_to(state.gg),  # a tuple per leaf (the params' own tuples are not leaves)
            spec.flatten_up_to(state.q),
        )
        for g, g_wide, mu, nu, gg, q in pairs:
            shape = shape_of(g)
            cd = torch.promote_types(g.dtype, torch.float32)  # the factors' dtype too
            gw = g_wide.to(cd).reshape(shape)
            direction, mu_, nu_, new_gg, new_q = leaf(gw, mu.to(cd).reshape(shape), nu.to(cd).reshape(shape), gg, q)
            ggs.append(new_gg)
            qs.append(new_q)
            outs.append(direction.reshape(g.shape).to(g.dtype))
            mus.append(mu_.reshape(mu.shape))
            nus.append(nu_.reshape(nu.shape))
        unflat = lambda xs: pytree.tree_unflatten(xs, spec)  # noqa: E731
        keys = lp.moment_keys(count, rounding, state.mu)
        mu_out = lp.store_moments(mus, state.mu, keys)
        nu_out = lp.store_moments(nus, state.nu, keys, second=True)
        return unflat(outs), SOAPState(count + 1, mu_out, nu_out, unflat(ggs), unflat(qs))

    def owned_update(grads, state, leaf):
        # DTensor params: each leaf's step at its owner, on its whole grad (one exchange each
        # way); its moments, factors and bases live there (`engine.owners`).
        spec = pytree.tree_structure(grads)
        gs = spec.flatten_up_to(grads)
        at = owners.of(gs)
        assert at is not None, "SOAP's state is at the leaves' owners, but these grads are laid out otherwise"
        mus, nus = spec.flatten_up_to(state.mu), spec.flatten_up_to(state.nu)
        ggs, qs = spec.flatten_up_to(state.gg), spec.flatten_up_to(state.q)
        states = [[m, n, *gg, *q] for m, n, gg, q in zip(mus, nus, ggs, qs)]
        cd = [torch.promote_types(g.dtype, torch.float32) for g in gs]

        def at_owner(i: int, g: Tensor, held: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            shape, k = shape_of(g), len(ggs[i])
            mu_, nu_, gg, q = held[0], held[1], tuple(held[2 : 2 + k]), tuple(held[2 + k :])
            d, mu_, nu_, gg, q = leaf(g.reshape(shape), mu_.reshape(shape), nu_.reshape(shape), gg, q)
            return d.reshape(g.shape), [mu_.reshape(g.shape), nu_.reshape(g.shape), *gg, *q]

        outs, new = at.run(at_owner, [g.to(c) for g, c in zip(gs, cd)], states)
        unflat = lambda xs: pytree.tree_unflatten(xs, spec)  # noqa: E731
        k = [len(gg) for gg in ggs]
        return unflat([o.to(g.dtype) for o, g in zip(outs, gs)]), SOAPState(
            state.count + 1,
            unflat([n[0] for n in new]),
            unflat([n[1] for n in new]),
            unflat([tuple(n[2 : 2 + j]) for n, j in zip(new, k)]),
            unflat([tuple(n[2 + j :]) for n, j in zip(new, k)]),
        )

    # Rotations and Gram matrices over whole leaves, kept per leaf: not shaped like the params.
    why = (
        "SOAP keeps per-leaf preconditioners (factor matrices and eigenbases), not shaped like the params "
        "(on DTensor params, with mu_dtype and nu_dtype None: each leaf's step and state at its owner rank)"
    )
    return with_needs(Transform(init, update), Needs(flat=why))


class _SOAPDecayState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # optax's name shadows tuple.count


def soap(
    lr: ScalarOrSchedule = 3e-3,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.95, 0.95),
    shampoo_beta: ScalarOrSchedule | None = None,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """SOAP (Vyas et al. 2024): Adam run in the eigenbasis of Shampoo's preconditioner.

    Per leaf (seen with `merge_dims` as the reference merges it), each dimension i of size
    at most `max_precond_dim` keeps a factor Gᵢ ← β_s·Gᵢ + (1-β_s)·g₍ᵢ₎g₍ᵢ₎ᵀ (β_s =
    `shampoo_beta`, or β₂ when None) and its eigenbasis Qᵢ; a 1-D leaf is plain Adam unless
    `precondition_1d`. With g' = g rotated by every Qᵢ:

        update 1: Gᵢ and Qᵢ = eigh(Gᵢ) set up; the params do not move
        m ← β₁·m + (1-β₁)·g';   v ← β₂·v + (1-β₂)·g'²        (in the eigenbasis)
        d = rotate back(m / (√v + ε))   (/ its RMS with normalize_grads)
        p ← (p − η·√(1-β₂ᵗ)/(1-β₁ᵗ)·d) · (1 − η·λ)            t = updates after the first
        every `precondition_frequency` updates: Qᵢ ← QR(Gᵢ·Qᵢ) (one power-iteration
        step, columns sorted by their eigenvalue estimates, v re-sorted to match), m
        rotated into the new basis

    as the reference implementation (github.com/nikhilvyas/SOAP, `SOAP`), decay included
    (applied to the updated params).

    Args:
      lr: η. betas: (β₁, β₂). weight_decay: λ. eps: ε. correct_bias: Adam's bias
        correction. Other arguments as the reference's.
      mu_dtype, nu_dtype, rounding: where m and v (in the eigenbasis) are stored, as
        `adam`'s: bfloat16/float16 rounded stochastically (or to nearest), fp8 8-bit
        block-quantized; None keeps them in float32 (float64 for float64 params), as the
        reference does. The step computes in float32 either way; the factors and bases
        stay in float32.

    Warning:
        A step runs per leaf (factors are d × d matrices, not shaped like the params), so
        `make_update` compiles it per leaf, not on flat buffers. On DTensor params (FSDP2,
        HSDP, TP) with `mu_dtype=nu_dtype=None`, each leaf's step runs at one rank, its owner,
        where its moments, factors and bases live (`engine/owners.py`: the eigen work and the
        memory split over the ranks); with stored dtypes set, every rank runs whole DTensor
        leaves. Memory: two d × d matrices per preconditioned dimension.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.soap(1e-2)
        >>> params = {"w": torch.ones(3, 2)}
        >>> state = opt.init(params)
        >>> for _ in range(3):
        ...     u, state = opt.update({"w": torch.randn(3, 2)}, state, params)
        ...     params = ps.apply_updates(params, u)
        >>> int(state.count)
        3

    References:
        Vyas et al., SOAP: Improving and Stabilizing Shampoo using Adam, 2024 (arXiv 2409.11321).
    """
    check_hyperparam("lr", lr)
    check_nonnegative("lr", lr)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    inner = scale_by_soap(
        betas[0],
        betas[1],
        shampoo_beta,
        eps,
        precondition_frequency,
        max_precond_dim,
        merge_dims,
        precondition_1d,
        normalize_grads,
        correct_bias,
        mu_dtype=mu_dtype,
        nu_dtype=nu_dtype,
        rounding=rounding,
    )

    def update(grads, state, params=None, **extra):
        if params is None:
            raise ValueError(
                "soap needs params (its decay acts on the updated params): call update(grads, state, params)"
            )
        count = state.count
        eta, lam = (as_float64(resolve(x, count), count.device) for x in (lr, weight_decay))
        direction, state = inner.update(grads, state, params)
        keep = once(eta * lam)
        # p' = (p − η·d)(1 − ηλ)  ⇒  u = −η·d − ηλ·(p − η·d)
        out = pytree.tree_map(
            lambda d, p: (-(eta * d) - keep * (p - eta * d)).to(p.dtype) * (count > 0), direction, params
        )
        return out, state

    return with_needs(Transform(inner.init, update), Needs(parts=lambda tree: [(inner, None)]))
