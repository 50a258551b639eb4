"""Muon against torch.optim.Muon, the orthogonalization itself, batching, routing and the hybrid."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import purestep.core as ps
from tests.core.test_alias import run_purestep

STEPS = 8
SHAPES = {"layers.0.q": (16, 32), "layers.0.up": (32, 16), "layers.1.q": (16, 32), "layers.1.o": (24, 24)}


def make(shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g, dtype=dtype) for k, s in shapes.items()}


def grad_stream(params, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()} for _ in range(steps)]


def ratio(shape, mode):
    a, b = shape[0], math.prod(shape[1:])
    return math.sqrt(max(1, a / b)) if mode == "original" else 0.2 * math.sqrt(max(a, b))


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov,weight_decay", [(True, 0.1), (False, 0.0)])
def test_muon_matches_torch_muon(adjust_lr, nesterov, weight_decay):
    params = make(SHAPES)
    grads = grad_stream(params)
    lr = 0.02
    tensors = {k: nn.Parameter(v.clone()) for k, v in params.items()}
    ref = torch.optim.Muon(
        list(tensors.values()), lr=lr, weight_decay=weight_decay, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr
    )
    opt = ps.muon(lr=lr, weight_decay=weight_decay, nesterov=nesterov, adjust_lr=adjust_lr)
    state = opt.init(params)
    ours = params
    for step, g in enumerate(grads):
        for k, p in tensors.items():
            p.grad = g[k].clone()
        ref.step()
        updates, state = opt.update(g, state, ours)
        ours = ps.apply_updates(ours, updates)
        for k, p in tensors.items():
            # bf16 Newton-Schulz on both sides: a step moves each entry by lr·s·|O| with |O| ~ 0.2;
            # allow 1% of lr·s per step (a few bf16 ulps: accumulation order differs between
            # kernels), 20x below what a wrong rule gives.
            atol = 1e-2 * lr * ratio(p.shape, adjust_lr) * (step + 1)
            torch.testing.assert_close(ours[k], p.detach(), rtol=0, atol=atol, msg=lambda m: f"step {step}, {k}: {m}")
    for k in params:
        assert (ours[k] - params[k]).abs().max() > 10 * lr * 0.01, k  # the params really moved


def test_bf16_emulation_stays_within_its_stated_tolerance_of_real_bf16_matmuls():
    # The documented bound (scale_by_muon's Warning): entries within 2⁻⁵ of real bf16 Newton-Schulz,
    # every value a bf16 value, and as close to a float64 Newton-Schulz as real bf16 is.
    g = torch.Generator().manual_seed(3)
    grads = {
        f"{shape}.{i}": torch.randn(*shape, generator=g) * (0.1 + 10 * torch.rand((), generator=g))
        for shape in [(8, 16), (16, 16), (24, 48)]
        for i in range(30)
    }

    def orthogonalize(**kw):
        t = ps.scale_by_muon(momentum=0.0, nesterov=False, **kw)
        return t.update(grads, t.init(grads))[0]

    real = orthogonalize(ns_dtype=torch.bfloat16, emulate_bf16=False)
    emulated = orthogonalize(ns_dtype=torch.bfloat16, emulate_bf16=True)
    exact = orthogonalize(ns_dtype=torch.float64)
    default = orthogonalize(ns_dtype=torch.bfloat16)
    chosen = real if ps._newton_schulz.CPU_BF16_MATMUL else emulated
    worst_real = max((real[k] - exact[k]).abs().max().item() for k in grads)
    worst_emulated = max((emulated[k] - exact[k]).abs().max().item() for k in grads)
    for k in grads:
        assert torch.equal(default[k], chosen[k]), k  # None: emulate exactly where bf16 matmuls are slow
        assert torch.equal(emulated[k].bfloat16().float(), emulated[k]), k
        assert (emulated[k] - real[k]).abs().max().item() <= 2**-5, k
    assert worst_emulated <= 1.5 * worst_real + 2**-7, (worst_emulated, worst_real)
    assert any(not torch.equal(emulated[k], real[k]) for k in grads)  # not bit-identical: hence the flag
    with pytest.raises(ValueError, match="emulate_bf16"):
        ps.muon(emulate_bf16="auto")


def test_muon_orthogonalizes_conv_filters_as_rows_by_the_rest():
    params = {"conv.weight": make({"w": (8, 3, 2, 2)})["w"]}
    grads = grad_stream(params, steps=6)
    flat = nn.Parameter(params["conv.weight"].reshape(8, 12).clone())
    ref = torch.optim.Muon([flat], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    opt = ps.muon(lr=0.02)
    state, ours = opt.init(params), params
    for g in grads:
        flat.grad = g["conv.weight"].reshape(8, 12).clone()
        ref.step()
        updates, state = opt.update(g, state, ours)
        ours = ps.apply_updates(ours, updates)
    torch.testing.assert_close(ours["conv.weight"].reshape(8, 12), flat.detach(), rtol=0, atol=6 * 1e-2 * 0.02)


def orthogonalized(shape, **kwargs):
    g = make({"w": shape}, seed=3, dtype=torch.float32)
    t = ps.scale_by_muon(momentum=0.0, nesterov=False, ns_dtype=torch.float32, **kwargs)
    updates, _ = t.update(g, t.init(g))
    return torch.linalg.svdvals(updates["w"] / ratio(shape, "original"))


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (48, 48)])
def test_ns5_singular_values_lie_in_half_to_three_halves(shape):
    s = orthogonalized(shape)
    assert s.min() >= 0.5 and s.max() <= 1.5, (s.min(), s.max())
    assert (s - 1).abs().max() > 0.05  # NS5 does not converge to 1: that is its design


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (48, 48)])
def test_polar_express_is_closer_to_one_than_ns5_at_equal_steps(shape):
    ns5 = (orthogonalized(shape) - 1).abs().max()
    pe = (orthogonalized(shape, ns_coefficients="polar_express") - 1).abs().max()
    assert pe < ns5 / 2, (pe, ns5)
    pe7 = (orthogonalized(shape, ns_coefficients="polar_express", ns_steps=7) - 1).abs().max()
    assert pe7 <= pe + 1e-3  # iterations past the table repeat the last polynomial


def test_per_iteration_coefficients_equal_a_repeated_triple():
    a = orthogonalized((32, 64), ns_coefficients=[(3.4445, -4.7750, 2.0315)] * 5)
    b = orthogonalized((32, 64))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm", "addmm", "baddbmm", "matmul"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_same_shape_matrices_share_one_batched_matmul_per_iteration():
    # (16, 32), its transpose (32, 16) and another (16, 32) form one batch; (24, 24) another.
    params = make(SHAPES, dtype=torch.float32)
    t = ps.scale_by_muon(ns_steps=5)
    state = t.init(params)
    with CountMatmuls() as counter:
        t.update(grad_stream(params, 1)[0], state)
    groups, per_iteration = 2, 3  # X·Xᵀ, b·A + c·A², a·X + B·X
    assert counter.ops.count("bmm") + counter.ops.count("baddbmm") == groups * 5 * per_iteration, counter.ops
    assert "mm" not in counter.ops and "addmm" not in counter.ops


def test_muon_runs_under_vmap_equal_to_separate_runs():
    """No host syncs and no data-dependent Python branching: the update vmaps over an ensemble."""
    opt = ps.muon(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    members = [make({"w": (8, 16), "v": (16, 8)}, seed=s) for s in range(3)]
    grads = [grad_stream(m, 1, seed=10 + i)[0] for i, m in enumerate(members)]

    def one(p, g):
        updates, _ = opt.update(g, opt.init(p), p)
        return ps.apply_updates(p, updates)

    stack = lambda trees: {k: torch.stack([t[k] for t in trees]) for k in trees[0]}  # noqa: E731
    batched = torch.func.vmap(one)(stack(members), stack(grads))
    for i in range(3):
        single = one(members[i], grads[i])
        for k in single:
            torch.testing.assert_close(batched[k][i], single[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["init", "update"])
def test_vectors_given_to_muon_raise_naming_the_path_and_pointing_to_muon_adamw(where):
    params = {"layers.0.weight": torch.zeros(4, 4), "layers.0.bias": torch.zeros(4)}
    opt = ps.muon()
    if where == "init":
        with pytest.raises(ValueError, match=r"'layers\.0\.bias'.*muon_adamw"):
            opt.init(params)
    else:
        state = opt.init({"layers.0.weight": torch.zeros(4, 4)})
        with pytest.raises(ValueError, match=r"'s'.*muon_adamw"):
            opt.update({"s": torch.zeros(())}, state)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(adjust_lr="spectral"), "adjust_lr"),
        (dict(adjust_lr=None), "adjust_lr"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(ns_steps=2.0), "ns_steps"),
        (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
        (dict(ns_coefficients="polar"), "ns_coefficients"),
        (dict(ns_dtype=torch.int32), "ns_dtype"),
        (dict(lr=-1.0), "lr"),
        (dict(momentum=-0.5), "momentum"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(eps=0.0), "eps"),
    ],
)
def test_invalid_muon_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ps.muon(**kwargs)


# --------------------------------------------------------------------------- #
# Routing and the hybrid.
# --------------------------------------------------------------------------- #


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(nn.functional.gelu(self.up(self.norm2(h))))


class TinyLM(nn.Module):
    def __init__(self, vocab=16, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.zeros(8, dim))
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x) + self.pos_emb[: x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def test_muon_labels_route_a_transformer_as_documented():
    params = dict(TinyLM().named_parameters())
    labels = ps.muon_labels(params)
    muon = {k for k, v in labels.items() if v == "muon"}
    assert muon == {
        f"layers.{i}.{n}" for i in range(2)
        for n in ("qkv.weight", "proj.weight", "up.weight", "down.weight")
    }
    for name in ("embed.weight", "pos_emb", "lm_head.weight", "norm.weight", "layers.0.norm1.weight", "layers.1.down.bias"):
        assert labels[name] == "adamw", name


@pytest.mark.parametrize(
    "name,shape,label",
    [
        ("transformer.wte.weight", (50, 8), "adamw"),
        ("model.embed_tokens.weight", (50, 8), "adamw"),
        ("output.weight", (50, 8), "adamw"),
        ("classifier.weight", (3, 8), "adamw"),
        ("encoder.layer.0.output.dense.weight", (8, 8), "muon"),  # BERT's hidden "output" block
        ("head.weight", (10, 8), "adamw"),
        ("blocks.0.attn.proj.weight", (8, 8), "muon"),
        ("conv1.weight", (16, 3, 3, 3), "muon"),
        ("bn1.weight", (16,), "adamw"),
        ("h.0.ln_1.weight", (8,), "adamw"),
        ("scale", (), "adamw"),
    ],
)
def test_muon_labels_by_rank_and_name(name, shape, label):
    assert ps.muon_labels({name: torch.zeros(shape)})[name] == label


def test_muon_adamw_is_muon_on_hidden_matrices_and_adamw_elsewhere():
    params = {k: v.detach().double() for k, v in TinyLM().named_parameters()}
    grads = grad_stream(params, steps=3)
    labels = ps.muon_labels(params)
    hybrid = ps.muon_adamw(lr=0.03, weight_decay=0.02, adamw_lr=1e-3, adamw_weight_decay=0.05)
    sides = {
        "muon": ps.muon(lr=0.03, weight_decay=0.02),
        "adamw": ps.adamw(1e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.05),
    }
    state = hybrid.init(params)
    side_states = {n: t.init({k: v for k, v in params.items() if labels[k] == n}) for n, t in sides.items()}
    for g in grads:
        updates, state = hybrid.update(g, state, params)
        for n, t in sides.items():
            sub = lambda tree: {k: v for k, v in tree.items() if labels[k] == n}  # noqa: E731
            expect, side_states[n] = t.update(sub(g), side_states[n], sub(params))
            for k, u in expect.items():
                torch.testing.assert_close(updates[k], u, rtol=0, atol=0, msg=k)


def test_muon_adamw_trains_a_small_transformer():
    torch.manual_seed(0)
    model = TinyLM(dim=16, layers=1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert sorted(set(ps.muon_labels(params).values())) == ["adamw", "muon"]
    start = torch.randint(0, 16, (16, 1))
    seq = (start + torch.arange(9)) % 16  # next token = previous + 1
    x, y = seq[:, :-1], seq[:, 1:]

    def loss_fn(p):
        logits = torch.func.functional_call(model, p, (x,))
        return nn.functional.cross_entropy(logits.reshape(-1, 16), y.reshape(-1))

    opt = ps.muon_adamw(adamw_lr=3e-3)
    state = opt.init(params)
    losses = []
    for _ in range(50):
        grads, loss = torch.func.grad_and_value(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_muon_state_has_no_recompile_when_lr_and_momentum_change():
    opt = ps.inject_hyperparams(ps.muon)(lr=0.02, momentum=0.95)  # bf16 iterations
    params = make({"w": (8, 16)}, dtype=torch.float32)
    state = opt.init(params)
    step = torch.compile(lambda g, s, p: opt.update(g, s, p), fullgraph=True)
    g = grad_stream(params, 1)[0]
    _, state = step(g, state, params)
    state = ps.set_hyperparam(ps.set_hyperparam(state, "lr", 0.01), "momentum", 0.9)
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled, _ = step(g, state, params)
    eager, _ = opt.update(g, state, params)
    # bf16 iterations amplify ulp-level differences in fusion/accumulation order: 5% of lr
    torch.testing.assert_close(compiled["w"], eager["w"], rtol=0, atol=5e-2 * 0.01)


def test_compiled_update_keeps_the_bf16_emulation_of_the_eager_one():
    # Inductor fuses a `.to(bf16).to(float32)` round trip away unless told to keep it: the
    # compiled step would then run Newton-Schulz in float32 and silently differ from eager.
    torch.manual_seed(0)
    params = {f"w{i}": torch.randn(24, 16) for i in range(2)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = ps.muon(lr=0.02, emulate_bf16=True)
    eager, _ = ps.make_update(opt)(params, grads, opt.init(params))
    compiled, _ = ps.make_update(opt, compile=True)(params, grads, opt.init(params))
    f32 = ps.muon(lr=0.02, ns_dtype=torch.float32)
    in_f32, _ = ps.make_update(f32)(params, grads, f32.init(params))
    for k in params:
        assert (eager[k] - in_f32[k]).abs().max() > 1e-5  # the emulation is visible at all
        torch.testing.assert_close(compiled[k], eager[k], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- #
# batch_dims: leaves that hold several matrices (experts, heads).
# --------------------------------------------------------------------------- #


def _experts(seed=0, steps=6):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 8, 4, generator=g, dtype=torch.float64)
    grads = [torch.randn(3, 8, 4, generator=g, dtype=torch.float64) for _ in range(steps)]
    return w, grads


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_muon_with_batch_dims_equals_one_muon_per_expert(adjust_lr):
    w, grads = _experts()
    kw = dict(ns_dtype=torch.float64, weight_decay=0.1, adjust_lr=adjust_lr)
    batched, _ = run_purestep(ps.muon(0.05, batch_dims=1, **kw), {"e": w}, [{"e": g} for g in grads])
    split = {f"e{i}": w[i] for i in range(3)}
    separate, _ = run_purestep(ps.muon(0.05, **kw), split, [{f"e{i}": g[i] for i in range(3)} for g in grads])
    for i in range(3):
        torch.testing.assert_close(batched[-1]["e"][i], separate[-1][f"e{i}"], rtol=1e-12, atol=1e-12)
    default, _ = run_purestep(ps.muon(0.05, **kw), {"e": w}, [{"e": g} for g in grads])
    assert not torch.allclose(default[-1]["e"], batched[-1]["e"])  # the default stays one 3 x 32 matrix


def test_muon_batch_dims_as_a_tree_or_a_callable_and_bad_values_name_the_leaf():
    w, grads = _experts()
    params = {"experts": w, "proj": w[0].clone()}
    steps = [{"experts": g, "proj": g[1]} for g in grads]
    kw = dict(ns_dtype=torch.float64)
    by_tree, _ = run_purestep(ps.muon(0.05, batch_dims={"experts": 1, "proj": 0}, **kw), params, steps)
    by_fn, _ = run_purestep(ps.muon(0.05, batch_dims=lambda path, x: int(path == "experts"), **kw), params, steps)
    torch.testing.assert_close(by_tree[-1], by_fn[-1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="'proj'"):
        ps.muon(0.05, batch_dims=1).init(params)  # (8, 4) with 1 batch dim leaves a vector
    with pytest.raises(ValueError, match="batch_dims"):
        ps.muon(0.05, batch_dims={"experts": 1}).init(params)  # no entry for proj


def test_muon_adamw_batch_dims_compiled_on_flat_buffers_equals_eager_per_expert():
    """Same-shape expert leaves with different batch_dims are told apart on flat buffers
    (one buffer each), stacked ones run batched; compiled and donated equals eager."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    params = {"layers.0.experts": torch.randn(2, 8, 4, generator=g), "layers.1.experts": torch.randn(2, 8, 4, generator=g),
              "layers.0.conv": torch.randn(2, 8, 4, generator=g), "layers.0.bias": torch.randn(4, generator=g)}
    opt = ps.muon_adamw(0.05, ns_dtype=torch.float32, batch_dims=lambda path, x: int("experts" in path),
                        cautious_weight_decay=True, weight_decay=0.1)
    compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for i in range(3):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            compiled(p, grads, s)
        p_ref, s_ref = eager(p_ref, grads, s_ref)
    assert compiled.explain().startswith("flat"), compiled.explain()
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6)


def test_muon_adamw_batch_dims_as_a_tree_of_every_param_or_injected_as_a_callable():
    """A hybrid's Muon side sees only its leaves: a tree shaped like all the params is read
    by leaf path; under inject_hyperparams a callable batch_dims stays static (not a schedule)."""
    w, grads = _experts()
    params = {"h.0.experts": w, "h.0.weight": w[0].clone(), "h.0.bias": torch.zeros(4, dtype=torch.float64)}
    steps = [{"h.0.experts": g, "h.0.weight": g[1], "h.0.bias": g[2, 0]} for g in grads]
    kw = dict(ns_dtype=torch.float64)
    by_tree, _ = run_purestep(ps.muon_adamw(batch_dims={"h.0.experts": 1, "h.0.weight": 0, "h.0.bias": 0}, **kw), params, steps)
    injected = ps.inject_hyperparams(ps.muon_adamw)(batch_dims=lambda path, x: int(x.dim() == 3), **kw)
    by_fn, _ = run_purestep(injected, params, steps)
    for k in params:
        torch.testing.assert_close(by_tree[-1][k], by_fn[-1][k], rtol=1e-12, atol=1e-12)


def _fused(seed=0, steps=5, rows=(8, 8, 8), cols=8):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(rows), cols, generator=g, dtype=torch.float64)
    grads = [torch.randn(sum(rows), cols, generator=g, dtype=torch.float64) for _ in range(steps)]
    return w, grads


@pytest.mark.parametrize("split,rows", [(3, (8, 8, 8)), (12, (2,) * 12), ((8, 4, 4), (8, 4, 4))],
                         ids=["q k v", "per head", "GQA row sizes"])
def test_muon_split_orthogonalizes_each_block_of_a_fused_leaf_as_its_own_matrix(split, rows):
    w, grads = _fused(rows=rows)
    kw = dict(ns_dtype=torch.float64, weight_decay=0.1, adjust_lr="match_rms_adamw")
    fused, _ = run_purestep(ps.muon(0.05, split=split, **kw), {"qkv": w}, [{"qkv": g} for g in grads])
    blocks = lambda x: dict(zip((f"b{i}" for i in range(len(rows))), x.split(list(rows))))  # noqa: E731
    separate, _ = run_purestep(ps.muon(0.05, **kw), blocks(w), [blocks(g) for g in grads])
    want = torch.cat([separate[-1][f"b{i}"] for i in range(len(rows))])
    torch.testing.assert_close(fused[-1]["qkv"], want, rtol=1e-12, atol=1e-12)
    whole, _ = run_purestep(ps.muon(0.05, **kw), {"qkv": w}, [{"qkv": g} for g in grads])
    assert not torch.allclose(whole[-1]["qkv"], fused[-1]["qkv"])  # without split: one 24 x 8 matrix


def test_muon_split_with_batch_dims_by_path_and_bad_values_name_the_leaf():
    # Experts of fused leaves: (E, 3·r, c) with batch_dims=1 and split=3 is E·3 matrices of r x c.
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 12, 4, generator=g, dtype=torch.float64)
    grads = [torch.randn(2, 12, 4, generator=g, dtype=torch.float64) for _ in range(4)]
    kw = dict(ns_dtype=torch.float64)
    fused, _ = run_purestep(ps.muon(0.05, batch_dims=1, split={"e": 3}, **kw), {"e": w}, [{"e": x} for x in grads])
    parts = lambda x: {f"e{i}.{j}": x[i, 4 * j: 4 * j + 4] for i in range(2) for j in range(3)}  # noqa: E731
    separate, _ = run_purestep(ps.muon(0.05, **kw), parts(w), [parts(x) for x in grads])
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(fused[-1]["e"][i, 4 * j: 4 * j + 4], separate[-1][f"e{i}.{j}"], rtol=1e-12, atol=1e-12)
    params = {"attn.qkv": torch.zeros(12, 4), "mlp.w": torch.zeros(5, 4)}
    with pytest.raises(ValueError, match="'mlp.w'"):
        ps.muon(0.05, split=3).init(params)  # 5 rows do not split into 3
    with pytest.raises(ValueError, match="'attn.qkv'"):
        ps.muon(0.05, split=lambda path, x: (4, 4) if "qkv" in path else None).init(params)  # sizes sum to 8, not 12
    ps.muon(0.05, split=lambda path, x: 3 if "qkv" in path else None).init(params)


def test_muon_adamw_split_compiled_on_flat_buffers_equals_eager_and_injected_stays_static():
    """Same-shape leaves split differently are told apart on flat buffers; compiled and
    donated equals eager, with no recompile; under inject_hyperparams a callable split is static."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    params = {"layers.0.qkv": torch.randn(12, 4, generator=g), "layers.1.qkv": torch.randn(12, 4, generator=g),
              "layers.0.proj": torch.randn(12, 4, generator=g), "layers.0.bias": torch.randn(4, generator=g)}
    by_path = lambda path, x: 3 if path.endswith("qkv") else None  # noqa: E731
    as_tree = {"layers.0.qkv": 3, "layers.1.qkv": 3, "layers.0.proj": None, "layers.0.bias": None}
    for split in (by_path, as_tree, 3):  # a callable, a tree by path, one value for every leaf
        torch._dynamo.reset()
        opt = ps.inject_hyperparams(ps.muon_adamw)(lr=0.05, ns_dtype=torch.float32, split=split)
        compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
        p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
        p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
        for i in range(3):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                compiled(p, grads, s)
            p_ref, s_ref = eager(p_ref, grads, s_ref)
        assert compiled.explain().startswith("flat"), compiled.explain()
        groups = sorted(sorted(v) for v in compiled.layout().values())
        assert ["layers.0.qkv", "layers.1.qkv"] in groups or split == 3, groups
        assert ["layers.0.proj"] in groups or split == 3, groups  # split apart from the qkv stack
        for k in params:
            torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6)
