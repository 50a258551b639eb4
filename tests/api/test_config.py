"""Configs: TOML/YAML/JSON load identically, overrides parse to the field's type, errors name the field."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import torch

import purestep.core as ps
from purestep.api import ConfigError, Optimizer, TrainConfig, apply_overrides, load_config
from purestep.api.config import resume_changes

TOML = """
steps = 200
seed = 3
batch_size = 64
grad_accum = 2
checkpoint_every = 50
keep_last = 2
strategy = "ddp"
precision = "bf16"
compile = true
time_budget = 60.5
ema_decay = 0.999

[optimizer]
name = "adamw"
lr = 1e-3
clip_grad_norm = 0.5

[optimizer.kwargs]
weight_decay = 0.1
betas = [0.9, 0.95]
mask = "decay_mask"

[schedule]
name = "warmup_cosine"
warmup_steps = 10
final_lr = 1e-5

[model]
n_layer = 2
n_embd = 64

[data]
source = "stdlib"
val_fraction = 0.1
"""

YAML = """
steps: 200
seed: 3
batch_size: 64
grad_accum: 2
checkpoint_every: 50
keep_last: 2
strategy: ddp
precision: bf16
compile: true
time_budget: 60.5
ema_decay: 0.999
optimizer:
  name: adamw
  lr: 1e-3
  clip_grad_norm: 0.5
  kwargs:
    weight_decay: 0.1
    betas: [0.9, 0.95]
    mask: decay_mask
schedule:
  name: warmup_cosine
  warmup_steps: 10
  final_lr: 1e-5
model:
  n_layer: 2
  n_embd: 64
data:
  source: stdlib
  val_fraction: 0.1
"""

JSON = {
    "steps": 200, "seed": 3, "batch_size": 64, "grad_accum": 2, "checkpoint_every": 50, "keep_last": 2,
    "strategy": "ddp", "precision": "bf16", "compile": True, "time_budget": 60.5, "ema_decay": 0.999,
    "optimizer": {
        "name": "adamw", "lr": 1e-3, "clip_grad_norm": 0.5,
        "kwargs": {"weight_decay": 0.1, "betas": [0.9, 0.95], "mask": "decay_mask"},
    },
    "schedule": {"name": "warmup_cosine", "warmup_steps": 10, "final_lr": 1e-5},
    "model": {"n_layer": 2, "n_embd": 64},
    "data": {"source": "stdlib", "val_fraction": 0.1},
}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "run.toml").write_text(TOML)
    (tmp_path / "run.yaml").write_text(YAML)
    (tmp_path / "run.json").write_text(json.dumps(JSON))
    return tmp_path


def test_the_same_config_loads_identically_from_toml_yaml_and_json(files):
    configs = [load_config(files / name) for name in ("run.toml", "run.yaml", "run.json")]
    assert configs[0] == configs[1] == configs[2]
    cfg = configs[0]
    assert cfg.optimizer.lr == 1e-3 and cfg.schedule.final_lr == 1e-5  # YAML's 1e-3 is a float too
    assert cfg.strategy == "ddp" and cfg.model.n_layer == 2 and cfg.model.n_head == 4
    with pytest.raises(AttributeError):
        cfg.steps = 5  # frozen


def test_defaults_load_from_an_empty_file(tmp_path):
    (tmp_path / "empty.toml").write_text("")
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.toml") == TrainConfig() == load_config(tmp_path / "empty.yaml")


def test_overrides_are_parsed_to_the_field_type(files):
    cfg = load_config(
        files / "run.toml",
        [
            "steps=300", "optimizer.lr=2e-3", "compile=false", "keep_last=none", "model.name=tiny",
            "optimizer.kwargs.betas=[0.8, 0.9]", "optimizer.kwargs.mask=decay_mask", "data.source=123",
            "schedule.name=cosine", "schedule.warmup_steps=null",
        ],
    )
    assert cfg.steps == 300 and isinstance(cfg.steps, int)
    assert cfg.optimizer.lr == 2e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.compile is False and cfg.keep_last is None
    assert cfg.model.name == "tiny"
    assert cfg.optimizer.kwargs["betas"] == [0.8, 0.9]
    assert cfg.data.source == "123"  # a str field keeps the text
    assert apply_overrides(cfg, ["optimizer.lr=1"]).optimizer.lr == 1.0


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["bogus=1"], "bogus: unknown field"),
        (["optimizer.bogus=1"], "optimizer.bogus: unknown field"),
        (["steps=many"], "steps: Expected `int`"),
        (["compile=3"], "compile: Expected `bool`"),
        (["optimizer.lr=-0.1"], "optimizer.lr: Expected `float` >= 0.0"),
        (["strategy=fsdp2x"], "strategy: Invalid enum value 'fsdp2x'"),
        (["precision=fp8"], "precision: Invalid enum value 'fp8'"),
        (["precision=fp16"], "precision: 'fp16' needs loss scaling"),
        (["precision=bf16-true", "strategy=fsdp"], "precision: 'bf16-true' is not supported with strategy='fsdp'"),
        (["batch_size=0"], "batch_size: Expected `int` >= 1"),
        (["grad_accum=3"], "grad_accum: 3 does not divide batch_size=64"),
        (["model.n_head=3"], "model.n_embd: 64 is not divisible by model.n_head=3"),
        (["data.val_fraction=1.5"], "data.val_fraction: Expected `float` < 1.0"),
        (["optimizer.name=nonesuch"], "optimizer.name: 'nonesuch' is not a public purestep.core optimizer"),
        (["optimizer.name=tree_get"], "optimizer.name: 'tree_get' is not a purestep optimizer"),
        (["optimizer.kwargs.bogus=1"], "optimizer.kwargs.bogus: adamw has no argument 'bogus'"),
        (["optimizer.kwargs.weight_decay=-1"], "optimizer.kwargs.weight_decay: weight_decay must be >= 0"),
        (["optimizer.kwargs.betas=[0.9, 1.5]"], r"optimizer.kwargs.betas: betas\[1\] must be in \[0, 1\)"),
        (["optimizer.kwargs.mask=nonesuch"], "optimizer.kwargs.mask: 'nonesuch' is not a public purestep.core"),
        (["schedule.name=nonesuch"], "schedule.name: 'nonesuch' is not a purestep schedule"),
        (["schedule.name=cosine"], "schedule.warmup_steps: cosine_schedule takes no such argument"),
        (["schedule.name=constant", "schedule.warmup_steps=null"], "schedule.final_lr: a constant lr takes no such"),
        (["schedule.name=wsd"], "schedule.decay_steps: wsd_schedule needs 'decay_steps'"),
        (["optimizer.lr.x=1"], "optimizer.lr.x: optimizer.lr is a value, not a table"),
        (["steps"], "expected key.sub=value"),
    ],
)
def test_bad_configs_raise_naming_the_field(files, overrides, field):
    with pytest.raises(ConfigError, match=field) as e:
        load_config(files / "run.toml", overrides)
    assert e.value.field == field.split(":")[0].replace("\\", "") or field == "expected key.sub=value"
    assert e.value.source.startswith(f"--set {overrides[0]}")  # an override's error names the override, not the file


@pytest.mark.parametrize(
    "precision, autocast, bf16_params",
    [("fp32", False, False), ("bf16", True, False), ("bf16-mixed", True, False), ("bf16-true", False, True)],
)
def test_precision_says_whether_to_autocast_or_keep_bf16_params(precision, autocast, bf16_params):
    cfg = apply_overrides(TrainConfig(), [f"precision={precision}"])
    assert (cfg.precision, cfg.autocast, cfg.bf16_params) == (precision, autocast, bf16_params)


def test_errors_in_the_file_name_the_file_and_the_field(files):
    (files / "bad.toml").write_text(TOML.replace('[optimizer]\nname = "adamw"\nlr = 1e-3', '[optimizer]\nname = "adamw"\nlr = -1e-3'))
    with pytest.raises(ConfigError, match=r"bad.toml: optimizer.lr: Expected `float` >= 0.0"):
        load_config(files / "bad.toml")
    (files / "bad.yaml").write_text(YAML.replace("  n_layer: 2", "  n_layer: 2\n  n_layers: 3"))
    with pytest.raises(ConfigError, match=r"bad.yaml: model.n_layers: unknown field \(fields: name, vocab_size"):
        load_config(files / "bad.yaml")
    (files / "bad.json").write_text(json.dumps({**JSON, "strategy": "fsdp2x"}))
    with pytest.raises(ConfigError, match=r"bad.json: strategy: Invalid enum value 'fsdp2x'"):
        load_config(files / "bad.json")
    (files / "broken.toml").write_text("steps = = 3")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(files / "broken.toml")
    with pytest.raises(ConfigError, match="missing.toml: no such config file"):
        load_config(files / "missing.toml")
    (files / "run.ini").write_text("")
    with pytest.raises(ConfigError, match="run.ini: unknown config format"):
        load_config(files / "run.ini")


def test_the_optimizer_section_builds_the_transform_it_names(files):
    cfg = load_config(files / "run.toml", ["schedule.name=constant", "schedule.warmup_steps=none", "schedule.final_lr=0"])
    params = {"h.weight": torch.randn(4, 4, dtype=torch.float64), "h.bias": torch.randn(4, dtype=torch.float64)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    ours = cfg.build_optimizer()
    theirs = ps.chain(
        ps.clip_by_global_norm(0.5), ps.adamw(1e-3, betas=(0.9, 0.95), weight_decay=0.1, mask=ps.decay_mask)
    )
    s1, s2 = ours.init(params), theirs.init(params)
    p1, p2 = params, params
    for _ in range(3):
        u1, s1 = ours.update(grads, s1, p1)
        u2, s2 = theirs.update(grads, s2, p2)
        p1, p2 = ps.apply_updates(p1, u1), ps.apply_updates(p2, u2)
    for k in params:
        # Injected hyperparameters are 0-d tensors, plain ones Python floats: the kernels
        # differ (lerp with a float weight, mul-add with a tensor one), so equal to rounding.
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-14, atol=1e-16, msg=k)
    assert float(ps.tree_get(s1, "lr")) == 1e-3  # injected: the lr in use is in the state


def test_the_schedule_section_shapes_the_lr(files):
    cfg = load_config(files / "run.toml")
    schedule = cfg.build_schedule()
    expected = ps.warmup_cosine_schedule(1e-3, 10, 200, final=1e-5)
    for step in (0, 5, 10, 100, 199, 250):
        assert float(schedule(torch.tensor(float(step), dtype=torch.float64))) == float(
            expected(torch.tensor(float(step), dtype=torch.float64))
        )
    assert TrainConfig().build_schedule() == TrainConfig().optimizer.lr  # constant: a plain float


def test_muon_config_resolves_names_and_dtypes():
    cfg = apply_overrides(
        TrainConfig(),
        ["optimizer.name=muon_adamw", "optimizer.lr=0.02", "optimizer.kwargs.ns_dtype=float32",
         "optimizer.kwargs.labels=muon_labels"],
    )
    opt = cfg.build_optimizer()
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
    adapter = Optimizer(model.named_parameters(), opt)
    model(torch.arange(8)).sum().backward()
    adapter.step()
    with pytest.raises(ConfigError, match="optimizer.kwargs.ns_dtype: 'float33' is not a torch dtype"):
        apply_overrides(cfg, ["optimizer.kwargs.ns_dtype=float33"])


def test_the_config_round_trips_through_plain_data():
    cfg = apply_overrides(TrainConfig(), ["optimizer.kwargs.betas=[0.9, 0.95]", "seed=7"])
    assert msgspec.convert(msgspec.to_builtins(cfg), TrainConfig) == cfg
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=TrainConfig) == cfg


# --------------------------------------------------------------------------- #
# Errors carry the field; config files are data.
# --------------------------------------------------------------------------- #


def test_an_error_in_the_file_carries_field_and_file_and_one_from_set_names_set(files):
    (files / "bad.toml").write_text("steps = 10\n[optimizer.kwargs]\nweight_decay = -1.0\n")
    with pytest.raises(ConfigError) as e:
        load_config(files / "bad.toml", ["steps=20"])
    assert (e.value.field, e.value.source) == ("optimizer.kwargs.weight_decay", str(files / "bad.toml"))
    with pytest.raises(ConfigError) as e:
        load_config(files / "run.toml", ["steps=20", "optimizer.kwargs.eps=0"])
    assert (e.value.field, e.value.source) == ("optimizer.kwargs.eps", "--set optimizer.kwargs.eps=0")
    assert str(e.value).startswith("--set optimizer.kwargs.eps=0: optimizer.kwargs.eps: eps must be > 0")
    # Overrides are applied together: an intermediate state may be invalid, the result is not.
    assert load_config(files / "run.toml", ["batch_size=10", "grad_accum=5"]).grad_accum == 5
    with pytest.raises(ConfigError) as e:
        load_config(files / "run.toml", ["batch_size=10", "steps=5"])  # grad_accum=2 is the file's
    assert e.value.field == "schedule" and e.value.source == "--set batch_size=10 --set steps=5"


def alias_bomb(levels: int) -> str:
    """YAML whose last alias expands to 10**levels nodes, under a field that is read whole."""
    lines = ["optimizer:", "  kwargs:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, detail",
    [
        (alias_bomb(6), "aliases expand to more than 100,000 nodes"),  # 10**6: slow, not endless, unguarded
        ("optimizer: &o\n  kwargs: *o\n", "an alias refers to the node that contains it"),
        ("a: &a [1, *a]\n", "an alias refers to the node that contains it"),
        ("optimizer:\n  kwargs: [1, 2]\n", "optimizer.kwargs: Expected `object`, got `array`"),
        ("schedule:\n  kwargs: 3\n", "schedule.kwargs: Expected `object`, got `int`"),
        ("- 1\n- 2\n", "expected a table of fields, got list"),
        ("steps: [1,\n", "not valid YAML"),
    ],
)
def test_hostile_or_malformed_yaml_fails_fast_in_one_line(tmp_path, text, detail):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert len(text) < 500
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert time.perf_counter() - start < 2.0
    assert detail in str(e.value) and "\n" not in str(e.value) and e.value.source == str(path)


def test_yaml_anchors_within_bounds_still_load(tmp_path):
    (tmp_path / "ok.yaml").write_text("optimizer: {lr: &lr 0.001}\nschedule: {name: cosine, final_lr: *lr}\n")
    assert load_config(tmp_path / "ok.yaml").schedule.final_lr == 0.001


def test_every_other_lr_follows_the_schedule_shape():
    cfg = apply_overrides(TrainConfig(), [
        "steps=20", "optimizer.name=muon_adamw", "optimizer.lr=0.02", 'optimizer.kwargs={"adamw_lr": 0.004}',
        "schedule.name=warmup_cosine", "schedule.warmup_steps=4", "schedule.final_lr=0.002",
    ])
    opt = cfg.build_optimizer()
    params = {"h.0.w": torch.randn(4, 4, dtype=torch.float64), "head.weight": torch.randn(3, 4, dtype=torch.float64)}
    state = opt.init(params)
    expected = ps.warmup_cosine_schedule(0.02, 4, 20, final=0.002)
    for step in range(12):
        _, state = opt.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
        hp = ps.get_hyperparams(state)
        assert float(hp["lr"]) == pytest.approx(expected(step), rel=1e-12)
        assert float(hp["adamw_lr"]) == pytest.approx(expected(step) * 0.2, rel=1e-12)


def test_resume_changes_apply_or_refuse_naming_the_field():
    saved = msgspec.to_builtins(apply_overrides(TrainConfig(), ["schedule.name=cosine", "schedule.warmup_steps=none"]))
    new = apply_overrides(TrainConfig(), ["schedule.name=cosine", "schedule.warmup_steps=none", "steps=2000",
                                          "optimizer.lr=1e-3", "log_every=5"])
    said = resume_changes(saved, new, 500)
    assert said[:2] == ["log_every changed from 10 to 5: applied", "optimizer.lr changed from 0.0003 to 0.001: applied"]
    assert said[2].startswith("steps changed from 1000 to 2000: reshapes the lr schedule: the lr at step 500 is 0.000854")
    for change, field in (("batch_size=64", "batch_size"), ("data.source=x.txt", "data.source"), ("seed=1", "seed")):
        with pytest.raises(ConfigError) as e:
            resume_changes(saved, apply_overrides(msgspec.convert(saved, TrainConfig), [change]), 500)
        assert e.value.field == field


def test_ademamix_cautious_adamw_and_mup_adamw_build_from_their_names():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    base = {k: [d // 2 if d == 8 else d for d in v.shape] for k, v in params.items()}
    cases = {
        "ademamix": (["optimizer.kwargs.b3=0.99", "optimizer.kwargs.alpha=2.0"], ps.ademamix(1e-2, b3=0.99, alpha=2.0)),
        "cautious_adamw": (["optimizer.kwargs.rescale=mean"], ps.cautious_adamw(1e-2, rescale="mean")),
        "mup_adamw": ([f"optimizer.kwargs.base_shapes={json.dumps(base)}"], ps.mup_adamw(1e-2, base_shapes=base)),
    }
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    for name, (overrides, theirs) in cases.items():
        cfg = apply_overrides(TrainConfig(), [f"optimizer.name={name}", "optimizer.lr=0.01", "optimizer.clip_grad_norm=none",
                                                 *overrides])
        ours = cfg.build_optimizer()
        u1, _ = ours.update(grads, ours.init(params), params)
        u2, _ = theirs.update(grads, theirs.init(params), params)
        for k in params:
            torch.testing.assert_close(u1[k], u2[k], rtol=1e-12, atol=0, msg=f"{name}: {k}")
    # Names are checked against the params when they first meet, at the first update.
    opt = apply_overrides(TrainConfig(), ["optimizer.name=mup_adamw", 'optimizer.kwargs.base_shapes={"x": [1]}']).build_optimizer()
    with pytest.raises(ValueError, match="base_shapes has no entry for leaf '0.weight'"):
        opt.update(grads, opt.init(params), params)


def test_a_config_stays_data_and_its_optimizer_is_checked_where_it_is_read_or_used():
    from purestep.api import DataConfig, OptimizerConfig, Trainer

    cfg = TrainConfig(optimizer=OptimizerConfig(name="nope"))  # building a Struct builds no transform
    with pytest.raises(ConfigError, match="optimizer.name: 'nope' is not a public purestep.core optimizer"):
        apply_overrides(cfg, [])
    with pytest.raises(ConfigError, match="--set optimizer.name=nope: optimizer.name"):
        apply_overrides(TrainConfig(), ["optimizer.name=nope"])
    with pytest.raises(ConfigError, match="optimizer.name"):
        Trainer(config=TrainConfig(optimizer=OptimizerConfig(name="nope"), data=DataConfig(max_bytes=100_000)))


def test_fourth_release_optimizers_build_from_their_names_and_kwargs():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    cases = {
        "adopt": (["optimizer.kwargs.clip=false"], ps.adopt(1e-2, clip=False)),
        "prodigy": (["optimizer.kwargs.d0=0.001", "optimizer.kwargs.safeguard_warmup=true"],
                    ps.prodigy(1e-2, d0=1e-3, safeguard_warmup=True)),
        "mars": (["optimizer.kwargs.gamma=0.05"], ps.mars(1e-2, gamma=0.05)),
        "laprop": (["optimizer.kwargs.b1=0.8"], ps.laprop(1e-2, b1=0.8)),
        "adamc": (["optimizer.kwargs.weight_decay=0.2"], ps.adamc(1e-2, weight_decay=0.2)),
        "kron": (["optimizer.kwargs.update_prob=0.5", "optimizer.kwargs.memory_save_mode=one_diag"],
                 ps.kron(1e-2, update_prob=0.5, memory_save_mode="one_diag")),
        "adamw": (["optimizer.kwargs.cautious_weight_decay=true", "optimizer.kwargs.weight_decay=0.5"],
                  ps.adamw(1e-2, weight_decay=0.5, cautious_weight_decay=True)),
    }
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    for name, (overrides, theirs) in cases.items():
        cfg = apply_overrides(TrainConfig(), [f"optimizer.name={name}", "optimizer.lr=0.01", "optimizer.clip_grad_norm=none",
                                                 "optimizer.kwargs={}", *overrides])
        ours = cfg.build_optimizer()
        u1, _ = ours.update(grads, ours.init(params), params)
        u2, _ = theirs.update(grads, theirs.init(params), params)
        for k in params:
            torch.testing.assert_close(u1[k], u2[k], rtol=1e-12, atol=0, msg=f"{name}: {k}")
    with pytest.raises(ConfigError) as e:
        apply_overrides(TrainConfig(), ["optimizer.name=mars", "optimizer.kwargs={}", "optimizer.kwargs.gamma=-1"]).build_optimizer()
    assert e.value.field == "optimizer.kwargs.gamma"


def test_a_mask_labels_or_batch_dims_kwarg_of_the_wrong_kind_names_the_field_and_the_file(tmp_path):
    for key, value in (("mask", "2"), ("labels", "3.5"), ("batch_dims", "true"), ("mask", '"no_such_function"')):
        path = tmp_path / f"{key}.toml"
        path.write_text(f'steps = 2\n[optimizer]\nname = "muon_adamw"\nlr = 0.01\n[optimizer.kwargs]\n{key} = {value}\n')
        if key == "mask":
            path.write_text(path.read_text().replace("muon_adamw", "adamw"))
        with pytest.raises(ConfigError) as e:
            load_config(path).build_optimizer()
        assert e.value.field == f"optimizer.kwargs.{key}" and str(path) in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kwargs, field, says",
    [
        ({"mlp_ratio": -10}, "model.kwargs.mlp_ratio", "mlp_ratio=-10 must be a number > 0"),
        ({"mlp_ratio": 1e-4}, "model.kwargs.mlp_ratio", "no hidden unit"),
        ({"n_layer": 2}, "model.kwargs.n_layer", "the GPT takes no such argument"),
        ({"dim": 64}, "model.kwargs.dim", "set it as model.n_embd"),
    ],
)
def test_a_bad_model_kwarg_names_its_own_field(kwargs, field, says):
    from purestep.api.models import build_model

    with pytest.raises(ConfigError) as e:
        build_model(TrainConfig().model.__class__(kwargs=kwargs))
    assert e.value.field == field and says in e.value.message, (e.value.field, e.value.message)
    with pytest.raises(ConfigError, match="model.n_embd: .*n_heads=4"):  # a section field under the GPT's name
        build_model(TrainConfig().model.__class__(n_head=4, n_embd=6))
