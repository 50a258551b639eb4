"""QK-clip (Kimi K2's MuonClip) against a per-head reference and against the attention logits
themselves: after the clip, each head's max logit is min(S_h, τ)."""

from __future__ import annotations

import math

import pytest
import torch

import purestep.core as ps


def _max_logits(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Each query head's max pre-softmax logit q·k / √d over a batch x (T, d_in)."""
    hd = wq.shape[0] // heads
    q = (x @ wq.T).view(-1, heads, hd).transpose(0, 1)  # (H, T, hd)
    k = (x @ wk.T).view(-1, kv_heads, hd).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    return (q @ k.transpose(1, 2) / math.sqrt(hd)).amax(dim=(1, 2))


@pytest.mark.parametrize("heads,kv_heads,fused", [(4, 4, True), (4, 4, False), (4, 2, False)], ids=["fused qkv", "MHA", "GQA"])
def test_after_the_clip_each_heads_max_logit_is_at_most_tau_and_the_others_keep_theirs(heads, kv_heads, fused):
    g = torch.Generator().manual_seed(0)
    d, hd = 8, 4
    wq = torch.randn(heads * hd, d, generator=g, dtype=torch.float64) * 3
    wk = torch.randn(kv_heads * hd, d, generator=g, dtype=torch.float64) * 3
    wv = torch.randn(kv_heads * hd, d, generator=g, dtype=torch.float64)
    x = torch.randn(16, d, generator=g, dtype=torch.float64)
    before = _max_logits(x, wq, wk, heads, kv_heads)
    tau = float(before.median())  # about half the heads above τ
    if fused:
        params = {"attn.qkv": torch.cat([wq, wk, wv]), "mlp.w": torch.randn(3, 3, dtype=torch.float64)}
        spec = ps.QKHeads(q="attn.qkv", k="attn.qkv", heads=heads, kv_heads=kv_heads,
                          q_rows=(0, heads * hd), k_rows=(heads * hd, (heads + kv_heads) * hd))
    else:
        params = {"attn.q": wq, "attn.k": wk, "mlp.w": torch.randn(3, 3, dtype=torch.float64)}
        spec = ps.QKHeads(q="attn.q", k="attn.k", heads=heads, kv_heads=kv_heads)
    opt = ps.chain(ps.identity(), ps.qk_clip(tau, {"attn": spec}))  # a zero-lr optimizer: the clip alone
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    u, _ = opt.update(zero, opt.init(params), params, max_logits={"attn": before})
    new = ps.apply_updates(params, u)
    if fused:
        nq, nk = new["attn.qkv"][: heads * hd], new["attn.qkv"][heads * hd: (heads + kv_heads) * hd]
        torch.testing.assert_close(new["attn.qkv"][(heads + kv_heads) * hd:], wv, rtol=0, atol=0)  # v untouched
    else:
        nq, nk = new["attn.q"], new["attn.k"]
    after = _max_logits(x, nq, nk, heads, kv_heads)
    torch.testing.assert_close(after, torch.minimum(before, torch.tensor(tau, dtype=torch.float64)), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(new["mlp.w"], params["mlp.w"], rtol=0, atol=0)
    assert bool((before > tau).any()) and bool((before <= tau).any())
    # Each key head takes √(min γ) of the query heads that share it; each query head the rest of its γ_h.
    gamma = torch.where(before > tau, tau / before, torch.ones_like(before))
    k_factor = gamma.view(kv_heads, heads // kv_heads).amin(dim=1).sqrt()
    torch.testing.assert_close(nk, wk * k_factor.repeat_interleave(hd)[:, None], rtol=1e-12, atol=1e-12)
    q_factor = gamma / k_factor.repeat_interleave(heads // kv_heads)
    torch.testing.assert_close(nq, wq * q_factor.repeat_interleave(hd)[:, None], rtol=1e-12, atol=1e-12)


def _reference(params, updates, max_logits, tau, heads, hd):
    """Per head, from the paper: W ← W·√(τ/S_h) on the head's rows of the updated W_q and W_k."""
    out = {k: p + u for k, p, u in zip(params, params.values(), updates.values())}
    for h in range(heads):
        s = float(max_logits[h])
        if s > tau:
            for k in ("attn.q", "attn.k"):
                out[k][h * hd:(h + 1) * hd] *= math.sqrt(tau / s)
    return out


def test_qk_clip_after_muon_adamw_matches_a_per_head_reference_over_steps_and_on_the_compiled_flat_step():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    heads, hd, d = 2, 4, 8
    params = {"attn.q": torch.randn(heads * hd, d, generator=g), "attn.k": torch.randn(heads * hd, d, generator=g),
              "attn.proj": torch.randn(d, d, generator=g), "norm": torch.ones(d)}
    clip = ps.qk_clip(5.0, {"attn": ps.QKHeads(q="attn.q", k="attn.k", heads=heads)})
    base = ps.muon_adamw(0.02, ns_dtype=torch.float32, labels=lambda p: {k: "muon" if v.dim() == 2 else "adamw" for k, v in p.items()})
    opt = ps.chain(base, clip)
    compiled = ps.make_update(opt, compile=True, donate=True)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, base.init(params)
    for step in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        logits = torch.tensor([8.0, 3.0]) if step % 2 == 0 else torch.tensor([2.0, 12.0])
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            compiled(p, {k: v.clone() for k, v in grads.items()}, s, max_logits={"attn": logits})
        u, s_ref = base.update(grads, s_ref, p_ref)
        p_ref = _reference(p_ref, u, logits, 5.0, heads, hd)
    assert compiled.explain().startswith("flat"), compiled.explain()
    assert ["attn.q"] in compiled.layout().values() and ["attn.k"] in compiled.layout().values()
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6)


def test_qk_clip_passes_updates_through_without_max_logits_and_refuses_bad_input_naming_it():
    params = {"attn.q": torch.ones(4, 2), "attn.k": torch.ones(4, 2)}
    clip = ps.qk_clip(10.0, {"attn": ps.QKHeads(q="attn.q", k="attn.k", heads=2)})
    u = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    out, _ = clip.update(u, clip.init(params), params)
    assert all(out[k] is u[k] for k in u)
    with pytest.raises(ValueError, match="no entry for attention 'attn'"):
        clip.update(u, clip.init(params), params, max_logits={})
    with pytest.raises(ValueError, match="3 values for 2 heads"):
        clip.update(u, clip.init(params), params, max_logits={"attn": torch.ones(3)})
    with pytest.raises(ValueError, match="'attn.v' is not a param path"):
        ps.qk_clip(10.0, {"attn": ps.QKHeads(q="attn.q", k="attn.v", heads=2)}).init(params)
    with pytest.raises(ValueError, match="do not split into 3 heads"):
        ps.qk_clip(10.0, {"attn": ps.QKHeads(q="attn.q", k="attn.k", heads=3)}).init(params)
    with pytest.raises(ValueError, match="threshold"):
        ps.qk_clip(0.0, {"attn": ps.QKHeads(q="attn.q", k="attn.k", heads=2)})


def test_muon_with_qk_clip_matches_pytorch_optimizers_muonclip():
    """`ps.chain(ps.muon(...), ps.qk_clip(...))` against pytorch_optimizer's `MuonClip` (Kimi
    K2's MuonClip, α = 0.5) over steps whose max logits cross τ, where their conventions meet:
    separate q and k projections with each head's rows contiguous, plain momentum (MuonClip
    runs Muon without Nesterov), Moonlight's lr adjustment (`adjust_lr="match_rms_adamw"`),
    decoupled decay, and Newton-Schulz in float32 on both sides (theirs runs it in bfloat16,
    a dtype its optimizer does not expose: patched here; ours takes `ns_dtype`)."""
    pytest.importorskip("pytorch_optimizer")
    import functools

    import pytorch_optimizer.optimizer.muon.base as po_base
    from pytorch_optimizer.optimizer.muon.muon_clip import MuonClip

    heads, dim, tau, lr, wd = 4, 16, 10.0, 0.02, 0.1
    g = torch.Generator().manual_seed(0)
    start = {"q": torch.randn(dim, dim, generator=g), "k": torch.randn(dim, dim, generator=g)}
    ours = {k: v.clone() for k, v in start.items()}
    theirs = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    opt = ps.chain(
        ps.muon(lr, momentum=0.95, nesterov=False, adjust_lr="match_rms_adamw", weight_decay=wd, ns_dtype=torch.float32),
        ps.qk_clip(tau, {"attn": ps.QKHeads(q="q", k="k", heads=heads)}),
    )
    state = opt.init(ours)
    ref = MuonClip(
        [
            {"params": [theirs["q"]], "use_muon": True, "qk_clip": "query", "attention_name": "attn"},
            {"params": [theirs["k"]], "use_muon": True, "qk_clip": "key", "attention_name": "attn"},
        ],
        lr=lr,
        momentum=0.95,
        weight_decay=wd,
        qk_clip_threshold=tau,
        use_adjusted_lr=True,
        foreach=False,
    )
    ns32 = functools.partial(po_base.zero_power_via_newton_schulz_5, dtype=torch.float32)
    clipped = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(po_base, "zero_power_via_newton_schulz_5", ns32)
        for _ in range(8):
            grads = {k: torch.randn(dim, dim, generator=g) for k in start}
            logits = torch.rand(heads, generator=g) * 20.0  # about half the heads above τ
            clipped += int((logits > tau).sum())
            updates, state = opt.update(grads, state, ours, max_logits={"attn": logits})
            ours = ps.apply_updates(ours, updates)
            for k, p in theirs.items():
                p.grad = grads[k].clone()
            ref.step(attention_max_logits={"attn": logits})
            for k in start:
                torch.testing.assert_close(ours[k], theirs[k].detach(), rtol=2e-5, atol=2e-6)
    assert clipped > 8
