"""QK-clip (Kimi K2's MuonClip): each attention head's W_q and W_k rescaled so that its max
pre-softmax logit stays at or below a threshold."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr
from ._base import EmptyState, Params, Transform, require_params
from .engine import ops as lay
from .engine.dtensor import replicated_like
from .engine.needs import Needs, Rule, with_needs


class QKHeads(NamedTuple):
    """Where one attention's W_q and W_k are, for `qk_clip`.

    `q` and `k` are param paths (the same path for a fused QKV weight); `q_rows` and `k_rows`
    the (start, stop) rows of W_q and W_k in them (None: every row); `heads` the query heads,
    `kv_heads` the key heads (GQA; None: as many as `heads`). Each head owns consecutive rows
    (`q_rows` splits into `heads` equal blocks, `k_rows` into `kv_heads`), as in
    `x @ W.T` followed by `.view(..., heads, head_dim)`.
    """

    q: str
    k: str
    heads: int
    kv_heads: int | None = None
    q_rows: tuple[int, int] | None = None
    k_rows: tuple[int, int] | None = None


def _rows(spec: tuple[int, int] | None, rows: int) -> tuple[int, int]:
    return (0, rows) if spec is None else (int(spec[0]), int(spec[1]))


def _repeat(x: Tensor, k: int) -> Tensor:
    """Each entry of `x` k times in a row (`repeat_interleave` without its index tensor, which
    would be made on the default device)."""
    return x.unsqueeze(1).expand(-1, k).reshape(-1)


def _check(attention: Mapping[str, QKHeads], tree: Any) -> dict[str, Any]:
    """The leaves `attention` names, checked against `tree` (paths, row ranges, head counts)."""
    leaves = dict(tr.tree_flatten_with_path(tree)[0])
    for name, a in attention.items():
        if not isinstance(a, QKHeads):
            raise ValueError(f"qk_clip attention '{name}' must be a ps.QKHeads, got {type(a).__name__}")
        kv = a.kv_heads if a.kv_heads is not None else a.heads
        if not (isinstance(a.heads, int) and a.heads > 0 and isinstance(kv, int) and kv > 0 and a.heads % kv == 0):
            raise ValueError(f"qk_clip attention '{name}': heads={a.heads} must be a multiple of kv_heads={kv}")
        for which, path, rows, n in (("q", a.q, a.q_rows, a.heads), ("k", a.k, a.k_rows, kv)):
            if path not in leaves:
                raise ValueError(f"qk_clip attention '{name}': {which}='{path}' is not a param path")
            leaf = leaves[path]
            lo, hi = _rows(rows, leaf.shape[0] if leaf.dim() else 0)
            if leaf.dim() < 1 or not 0 <= lo < hi <= leaf.shape[0] or (hi - lo) % n:
                raise ValueError(
                    f"qk_clip attention '{name}': rows {(lo, hi)} of '{path}' (shape {tuple(leaf.shape)}) do not "
                    f"split into {n} heads"
                )
    return leaves


def qk_clip(threshold: float, attention: Mapping[str, QKHeads]) -> Transform:
    """Rescale each head's W_q and W_k after the update so that its max logit is at most τ.

    `update(updates, state, params, max_logits={name: (heads,) tensor})`, with `max_logits` the
    max pre-softmax logit of each query head of each attention in `attention` over this step's
    batch (over every data-parallel rank: all-reduce it with MAX first). For a head h whose max
    logit S_h exceeds τ = `threshold`, γ_h = τ / S_h and the updated weights are
    W_q^h ← W_q^h·√γ_h, W_k^h ← W_k^h·√γ_h, so that its logits scale by γ_h (Kimi K2); with
    GQA a key head shared by several query heads takes √(min γ) of its group and each query
    head the rest of its own γ_h (so a head at or below τ whose key head was scaled down gets
    its W_q rows scaled up by as much: its logits stay as they were). Other rows and params,
    and heads whose key head is not scaled, keep the update as it is; a non-finite max logit
    clips nothing; without `max_logits` the transform passes the updates through.
    Chain it last: `ps.chain(ps.muon_adamw(...), ps.qk_clip(100.0, attention))`.

    Biases are not rescaled (the logit scales by γ_h exactly for projections without bias).

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"attn.q": torch.ones(4, 2), "attn.k": torch.ones(4, 2)}  # 2 heads of 2 rows
        >>> t = ps.qk_clip(10.0, {"attn": ps.QKHeads(q="attn.q", k="attn.k", heads=2)})
        >>> zero = {k: torch.zeros_like(v) for k, v in params.items()}
        >>> u, _ = t.update(zero, t.init(params), params, max_logits={"attn": torch.tensor([40.0, 5.0])})
        >>> (params["attn.q"] + u["attn.q"])[:, 0]  # head 0: √(10/40) = 0.5; head 1 under τ: kept
        tensor([0.5000, 0.5000, 1.0000, 1.0000])

    References:
        Kimi Team, Kimi K2: Open Agentic Intelligence, 2025 (MuonClip).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold must be a float > 0, got {threshold!r}")
    if not isinstance(attention, Mapping) or not attention:
        raise ValueError("attention must be a non-empty dict of name -> ps.QKHeads")
    attention = dict(attention)
    tau = float(threshold)
    # The leaves it rescales are buffers of their own on flat buffers (known by their path).
    wanted = {p for a in attention.values() for p in (a.q, a.k)}

    def rescaled(tree: Any) -> list[str | None]:  # per leaf: its path when rescaled (checked)
        _check(attention, tree)
        return [p if p in wanted else None for p in tr.tree_paths(tree)]

    named = Rule("qk_clip", attention, rescaled)

    def init(params: Params) -> EmptyState:
        lay.per_leaf(params, named)  # checked now (on flat buffers: when the layout was planned)
        return EmptyState()

    def update(updates, state, params=None, max_logits=None, **extra):
        if max_logits is None:
            return updates, state
        require_params(params, "qk_clip")
        us, spec = pytree.tree_flatten(updates)
        ps_ = tr.check_match(params, updates, "params", "updates", dtype=False)
        paths = lay.per_leaf(updates, named)  # one per leaf (or buffer): its path when rescaled
        at = {p: i for i, p in enumerate(paths) if p is not None}
        held = lay.held_rows(updates)  # the whole leaf's rows this process holds (over shards: its block's)
        scale: dict[int, Tensor] = {}  # leaf index -> its whole rows' factors
        for name, a in attention.items():
            if name not in max_logits:
                raise ValueError(f"qk_clip: max_logits has no entry for attention '{name}'")
            # per-step scalars in float64, on the params' device (not the default one)
            s = torch.as_tensor(max_logits[name], device=ps_[at[a.q]].device).to(torch.float64).reshape(-1)
            if s.numel() != a.heads:
                raise ValueError(f"qk_clip: max_logits['{name}'] has {s.numel()} values for {a.heads} heads")
            kv = a.kv_heads if a.kv_heads is not None else a.heads
            # 1 at or below τ, and for a non-finite logit (a broken step, not a scale to apply)
            gamma = torch.where((s > tau) & torch.isfinite(s), tau / s.clamp(min=tau), torch.ones_like(s))
            shared = gamma.view(kv, a.heads // kv).amin(dim=1)  # a key head: its group's smallest γ
            k_scale = torch.sqrt(shared)
            q_scale = gamma / _repeat(k_scale, a.heads // kv)
            for path, rows, factors in ((a.q, a.q_rows, q_scale), (a.k, a.k_rows, k_scale)):
                i = at[path]
                whole = held[i][2]  # type: ignore[index]  # a rescaled leaf is a buffer of its own
                lo, hi = _rows(rows, whole)
                per_row = _repeat(factors, (hi - lo) // factors.numel())
                base = scale.get(i)
                if base is None:
                    base = torch.ones(whole, dtype=torch.float64, device=ps_[i].device)
                scale[i] = torch.cat([base[:lo], base[lo:hi] * per_row.to(base.device), base[hi:]])
        out = list(us)
        for i, whole_rows in scale.items():
            p, u = ps_[i], us[i]
            first, count, _ = held[i]  # type: ignore[misc]
            r = whole_rows[first : first + count]  # this process's rows
            r = replicated_like(r.view(-1, *([1] * (u.dim() - 1))), p)  # on whole DTensors: replicated on p's mesh
            wide = torch.promote_types(u.dtype, torch.float32)
            new = (p.to(wide) + u.to(wide)) * r.to(wide)  # the updated weights, rescaled per head
            out[i] = (new - p.to(wide)).to(u.dtype)
        return pytree.tree_unflatten(out, spec), state

    # Over shards each rank rescales the rows of W_q, W_k its block holds (`ops.held_rows`).
    return with_needs(Transform(init, update), Needs(rules=(named,)))
