"""Parameter-group rules: decay_mask, layerwise_lr_decay, scale_per_leaf, scheduled weight decay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import purestep.core as ps


# named_parameters() names and shapes of common models (taken from the models' own layouts).
GPT2 = {  # Hugging Face GPT-2 / nanoGPT
    "transformer.wte.weight": ((50, 8), False),
    "transformer.wpe.weight": ((16, 8), False),
    "transformer.h.0.ln_1.weight": ((8,), False),
    "transformer.h.0.ln_1.bias": ((8,), False),
    "transformer.h.0.attn.c_attn.weight": ((8, 24), True),
    "transformer.h.0.attn.c_attn.bias": ((24,), False),
    "transformer.h.0.mlp.c_fc.weight": ((8, 32), True),
    "transformer.ln_f.weight": ((8,), False),
    "lm_head.weight": ((50, 8), True),
}
LLAMA = {  # Hugging Face LLaMA and torchtitan
    "model.embed_tokens.weight": ((50, 8), False),
    "model.layers.0.self_attn.q_proj.weight": ((8, 8), True),
    "model.layers.0.self_attn.q_norm.weight": ((8,), False),
    "model.layers.0.input_layernorm.weight": ((8,), False),
    "model.layers.0.post_attention_layernorm.weight": ((8,), False),
    "model.layers.0.mlp.gate_proj.weight": ((16, 8), True),
    "model.norm.weight": ((8,), False),
    "tok_embeddings.weight": ((50, 8), False),
    "layers.0.attention.wq.weight": ((8, 8), True),
    "layers.0.attention_norm.weight": ((8,), False),
    "layers.0.ffn_norm.weight": ((8,), False),
    "norm.weight": ((8,), False),
    "output.weight": ((50, 8), True),
}
VISION = {  # timm ViT, torchvision ResNet, BERT
    "cls_token": ((1, 1, 8), False),
    "pos_embed": ((1, 5, 8), False),
    "patch_embed.proj.weight": ((8, 3, 4, 4), True),
    "blocks.0.norm1.weight": ((8,), False),
    "blocks.0.attn.qkv.weight": ((24, 8), True),
    "blocks.0.attn.relative_position_bias_table": ((9, 2), False),
    "conv1.weight": ((8, 3, 7, 7), True),
    "bn1.weight": ((8,), False),
    "layer1.0.bn2.bias": ((8,), False),
    "fc.weight": ((10, 8), True),
    "bert.embeddings.word_embeddings.weight": ((50, 8), False),
    "bert.embeddings.LayerNorm.weight": ((8,), False),
    "bert.encoder.layer.0.attention.self.query.weight": ((8, 8), True),
    "stacked_norm.weight": ((4, 8), False),  # a scanned model's norms: 2-D, excluded by name
    "scale": ((), False),
}


@pytest.mark.parametrize("table", [GPT2, LLAMA, VISION], ids=["gpt2", "llama", "vision"])
def test_decay_mask_decays_only_weight_matrices(table):
    params = {name: torch.zeros(shape) for name, (shape, _) in table.items()}
    mask = ps.decay_mask(params)
    assert mask == {name: want for name, (_, want) in table.items()}


def test_decay_mask_can_keep_decaying_embeddings():
    params = {name: torch.zeros(shape) for name, (shape, _) in GPT2.items()}
    mask = ps.decay_mask(params, exclude_embeddings=False)
    assert mask["transformer.wte.weight"] and mask["transformer.wpe.weight"]
    assert not mask["transformer.h.0.ln_1.weight"] and not mask["transformer.h.0.attn.c_attn.bias"]


def test_decay_mask_on_a_real_module():
    model = nn.ModuleDict({
        "tok_embeddings": nn.Embedding(20, 8),
        "layers": nn.ModuleList([nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)]),
        "conv": nn.Conv2d(3, 8, 3),
        "bn": nn.BatchNorm2d(8),
        "norm": nn.RMSNorm(8),
        "head": nn.Linear(8, 20),
    })
    params = dict(model.named_parameters())
    decayed = {k for k, v in ps.decay_mask(params).items() if v}
    assert decayed == {
        "layers.0.self_attn.in_proj_weight",
        "layers.0.self_attn.out_proj.weight",
        "layers.0.linear1.weight",
        "layers.0.linear2.weight",
        "conv.weight",
        "head.weight",
    }


@pytest.mark.parametrize("table", [GPT2, LLAMA, VISION], ids=["gpt2", "llama", "vision"])
def test_decay_mask_and_muon_labels_classify_every_name_alike(table):
    # One classifier: Muon takes exactly the decayed weight matrices except the output head.
    params = {name: torch.zeros(shape) for name, (shape, _) in table.items()}
    mask, labels = ps.decay_mask(params), ps.muon_labels(params)
    heads = {"lm_head.weight", "output.weight", "fc.weight"}
    assert {k for k, v in labels.items() if v == "muon"} == {k for k, v in mask.items() if v} - heads


def test_a_vit_patch_embedding_is_a_matrix_and_its_cls_token_an_embedding():
    params = {name: torch.zeros(shape) for name, (shape, _) in VISION.items()}
    labels = ps.muon_labels(params)
    assert labels["patch_embed.proj.weight"] == "muon" and ps.decay_mask(params)["patch_embed.proj.weight"]
    assert labels["cls_token"] == "adamw" and not ps.decay_mask(params)["cls_token"]
    assert labels["pos_embed"] == "adamw" and labels["blocks.0.attn.relative_position_bias_table"] == "adamw"


def _adamw_groups_trajectory(params0, mask, steps, wd=0.1, lr=1e-2):
    torch_params = {k: nn.Parameter(v.clone()) for k, v in params0.items()}
    opt = torch.optim.AdamW(
        [
            {"params": [p for k, p in torch_params.items() if mask[k]], "weight_decay": wd},
            {"params": [p for k, p in torch_params.items() if not mask[k]], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    ours = ps.adamw(lr, weight_decay=wd, mask=ps.decay_mask)
    params = {k: v.clone() for k, v in params0.items()}
    state = ours.init(params)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
        for k, p in torch_params.items():
            p.grad = grads[k].clone()
        opt.step()
        updates, state = ours.update(grads, state, params)
        params = ps.apply_updates(params, updates)
    return params, torch_params


def test_adamw_with_decay_mask_matches_torch_adamw_with_two_param_groups():
    params0 = {name: torch.randn(shape, dtype=torch.float64) for name, (shape, _) in GPT2.items()}
    params, torch_params = _adamw_groups_trajectory(params0, ps.decay_mask(params0), 12)
    for k in params:
        torch.testing.assert_close(params[k], torch_params[k].detach(), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- #
# Weight decay that follows a schedule.
# --------------------------------------------------------------------------- #


def test_scheduled_weight_decay_with_zero_grads_shrinks_params_by_one_minus_lr_wd():
    lr = 0.1
    wd = ps.cosine_schedule(0.5, 10)
    t = ps.chain(ps.add_decayed_weights(wd), ps.scale_by_lr(lr))
    params = {"w": torch.randn(3, 4, dtype=torch.float64)}
    state = t.init(params)
    for step in range(14):
        updates, state = t.update({"w": torch.zeros(3, 4, dtype=torch.float64)}, state, params)
        new = ps.apply_updates(params, updates)
        torch.testing.assert_close(new["w"], params["w"] * (1 - lr * wd(step)), rtol=1e-14, atol=0)
        params = new


def test_adamw_with_a_weight_decay_schedule_matches_torch_adamw_stepping_weight_decay():
    wd = ps.linear_schedule(0.2, 0.0, 8)  # decay to 0 over training
    lr = ps.warmup_cosine_schedule(1e-2, 2, 10)
    p0 = torch.randn(4, 5, dtype=torch.float64)
    tp = nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([tp], lr=lr(0), weight_decay=wd(0))
    ours = ps.adamw(lr, weight_decay=wd)
    params = {"w": p0.clone()}
    state = ours.init(params)
    g = torch.Generator().manual_seed(1)
    for step in range(10):
        grad = torch.randn(4, 5, generator=g, dtype=torch.float64)
        opt.param_groups[0]["lr"] = lr(step)
        opt.param_groups[0]["weight_decay"] = wd(step)
        tp.grad = grad.clone()
        opt.step()
        updates, state = ours.update({"w": grad}, state, params)
        params = ps.apply_updates(params, updates)
    torch.testing.assert_close(params["w"], tp.detach(), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- #
# Layer-wise lr decay.
# --------------------------------------------------------------------------- #


def test_layerwise_lr_decay_counts_layers_from_the_top():
    names = [
        "transformer.wte.weight", "transformer.h.0.attn.weight", "transformer.h.1.attn.weight",
        "transformer.h.2.mlp.weight", "transformer.ln_f.weight", "lm_head.weight",
    ]
    m = ps.layerwise_lr_decay({n: torch.zeros(2) for n in names}, 0.5)
    assert m == {
        "transformer.wte.weight": 0.0625,
        "transformer.h.0.attn.weight": 0.125,
        "transformer.h.1.attn.weight": 0.25,
        "transformer.h.2.mlp.weight": 0.5,
        "transformer.ln_f.weight": 1.0,
        "lm_head.weight": 1.0,
    }
    blocks = ps.layerwise_lr_decay({"blocks.0.w": 0, "blocks.11.w": 0, "layers.3.x": 0, "encoder.layer.1.q": 0}, 0.9)
    assert blocks["blocks.11.w"] == pytest.approx(0.9) and blocks["blocks.0.w"] == pytest.approx(0.9**12)
    assert blocks["layers.3.x"] == pytest.approx(0.9**9) and blocks["encoder.layer.1.q"] == pytest.approx(0.9**11)


def test_scale_per_leaf_with_llrd_matches_torch_adam_with_per_layer_param_groups():
    names = ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w", "head.weight", "head.bias"]
    g = torch.Generator().manual_seed(3)
    params0 = {n: torch.randn(3, 2, generator=g, dtype=torch.float64) for n in names}
    mult = ps.layerwise_lr_decay(params0, 0.7)
    lr = 1e-2
    torch_params = {k: nn.Parameter(v.clone()) for k, v in params0.items()}
    opt = torch.optim.Adam([{"params": [p], "lr": lr * mult[k]} for k, p in torch_params.items()], lr=lr)
    ours = ps.chain(ps.scale_by_adam(), ps.scale_per_leaf(lambda tree: ps.layerwise_lr_decay(tree, 0.7)), ps.scale_by_lr(lr))
    params = {k: v.clone() for k, v in params0.items()}
    state = ours.init(params)
    for _ in range(8):
        grads = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
        for k, p in torch_params.items():
            p.grad = grads[k].clone()
        opt.step()
        updates, state = ours.update(grads, state, params)
        params = ps.apply_updates(params, updates)
    for k in params:
        torch.testing.assert_close(params[k], torch_params[k].detach(), rtol=1e-10, atol=1e-12)


def test_scale_per_leaf_takes_trees_floats_and_tensors_and_checks_structure():
    g = {"a": torch.ones(2), "b": torch.ones(3, dtype=torch.float64)}
    t = ps.scale_per_leaf({"a": 0.5, "b": torch.tensor(3.0, dtype=torch.float64)})
    out, _ = t.update(g, t.init(g))
    assert torch.equal(out["a"], torch.full((2,), 0.5)) and torch.equal(out["b"], torch.full((3,), 3.0, dtype=torch.float64))
    out, _ = ps.scale_per_leaf(2.0).update(g, ps.EmptyState())
    assert torch.equal(out["b"], torch.full((3,), 2.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="structure"):
        ps.scale_per_leaf({"a": 1.0}).update(g, ps.EmptyState())


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: ps.layerwise_lr_decay({"w": torch.zeros(1)}, 0.0), "decay"),
        (lambda: ps.layerwise_lr_decay({"w": torch.zeros(1)}, 1.5), "decay"),
        (lambda: ps.scale_per_leaf({"w": float("inf")}), "multipliers"),
        (lambda: ps.scale_per_leaf({"w": lambda t: 1.0}), "multipliers"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


# --------------------------------------------------------------------------- #
# Invariant over drawn schedules: zero grads shrink params by exactly (1 - lr·wd).
# --------------------------------------------------------------------------- #

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_WD_SCHEDULES = {
    "constant": lambda wd: wd,
    "linear_to_zero": lambda wd: ps.linear_schedule(wd, 0.0, 6),
    "cosine": lambda wd: ps.cosine_schedule(wd, 5, final=0.1 * wd),
    "wsd": lambda wd: ps.wsd_schedule(wd, 2, 8, 3, shape="sqrt"),
}


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(_WD_SCHEDULES)), st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.sampled_from(["adamw", "lion"]))
def test_decoupled_decay_with_zero_grads_shrinks_params_by_one_minus_lr_wd(kind, wd, lr, opt_name):
    weight_decay = _WD_SCHEDULES[kind](wd)
    opt = getattr(ps, opt_name)(lr, weight_decay=weight_decay)
    params = {"w": torch.randn(3, 2, dtype=torch.float64), "s": torch.randn((), dtype=torch.float64)}
    state = opt.init(params)
    for step in range(9):
        zeros = {k: torch.zeros_like(v) for k, v in params.items()}
        updates, state = opt.update(zeros, state, params)
        new = ps.apply_updates(params, updates)
        w = weight_decay(step) if callable(weight_decay) else weight_decay
        for k in params:
            torch.testing.assert_close(new[k], params[k] * (1 - lr * w), rtol=1e-14, atol=1e-300)
        params = new


# --------------------------------------------------------------------------- #
# Cautious weight decay (Chen et al. 2025).
# --------------------------------------------------------------------------- #


def _reference_cautious_adamw(params, grads_list, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    history = []
    for t, grads in enumerate(grads_list, start=1):
        for k, g in grads.items():
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            u = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
            same = (torch.sign(u) == torch.sign(p[k])).to(p[k].dtype)
            p[k] = p[k] - lr * (u + wd * same * p[k])
        history.append({k: x.clone() for k, x in p.items()})
    return history


def test_cautious_weight_decay_on_adamw_matches_the_per_tensor_reference():
    from tests.core.test_alias import assert_histories_close, grad_stream, make_params, run_purestep

    params = make_params()
    grads = grad_stream(params, steps=30)
    ours, _ = run_purestep(ps.adamw(1e-2, weight_decay=0.5, cautious_weight_decay=True), params, grads)
    assert_histories_close(ours, _reference_cautious_adamw(params, grads, 1e-2, 0.5), rtol=1e-10)
    plain, _ = run_purestep(ps.adamw(1e-2, weight_decay=0.5), params, grads)
    assert not torch.allclose(plain[-1]["bias"], ours[-1]["bias"])


@pytest.mark.parametrize("make", [lambda **kw: ps.lion(1e-2, **kw), lambda **kw: ps.muon(1e-2, ns_dtype=torch.float64, **kw)])
def test_cautious_weight_decay_decays_only_where_the_direction_has_the_params_sign(make):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 5, generator=g, dtype=torch.float64)}
    grads = {"w": torch.randn(6, 5, generator=g, dtype=torch.float64)}
    without = make(weight_decay=0.0)
    u0, _ = without.update(grads, without.init(params), params)  # -η·u
    cautious = make(weight_decay=0.5, cautious_weight_decay=True)
    u, _ = cautious.update(grads, cautious.init(params), params)
    same = torch.sign(-u0["w"]) == torch.sign(params["w"])
    assert 0 < int(same.sum()) < same.numel()
    torch.testing.assert_close(u["w"], u0["w"] - 1e-2 * 0.5 * params["w"] * same, rtol=1e-12, atol=1e-15)


def test_add_decayed_weights_cautious_refuses_a_non_bool():
    with pytest.raises(ValueError, match="cautious"):
        ps.add_decayed_weights(0.1, cautious=1)
