"""sgd, adam and adamw against torch.optim over the configurations torch's own optimizer tests use.

The configurations come from `torch.testing._internal.common_optimizers.optim_db` (the CPU and
the CUDA lists), read in a subprocess: importing torch's internal test modules here would load
their hypothesis profile over ours and freeze `torch.backends` flags for every later test.

Which entries are changed or skipped, and why:
- `capturable` is dropped: it only moves the step counter onto the device for CUDA graphs
  (torch refuses it for CPU params); the math is the same.
- betas given as tensors of more than 0 dims (`tensor([[[0.9]]])`) are skipped: purestep takes
  a float, a schedule or a 0-d tensor per hyperparameter.
- `foreach`, `fused` and `differentiable` select torch implementations, not semantics; the
  lists hold none of them as kwargs (they are `supported_impls`), so nothing is skipped for them.
A tensor lr is kept: purestep takes a 0-d tensor lr too.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import torch

import purestep.core as ps

STEPS = 30
CLASSES = {"SGD": (torch.optim.SGD, ps.sgd), "Adam": (torch.optim.Adam, ps.adam), "AdamW": (torch.optim.AdamW, ps.adamw)}
# torch.optim buffer name -> purestep state field (both per parameter).
BUFFERS = {"exp_avg": "mu", "exp_avg_sq": "nu", "max_exp_avg_sq": "nu_max", "momentum_buffer": "trace"}

_READ_DB = """
import json, torch
from torch.testing._internal.common_optimizers import optim_db
def enc(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": v.tolist(), "dtype": str(v.dtype).replace("torch.", "")}
    if isinstance(v, (tuple, list)):
        return [enc(x) for x in v]
    return v
out = []
for info in optim_db:
    if info.optim_cls.__name__ in %r:
        for device in ("cpu", "cuda"):
            for inp in info.optim_inputs_func(device=device, dtype=torch.float64):
                out.append([info.optim_cls.__name__, inp.desc, {k: enc(v) for k, v in inp.kwargs.items()}])
print(json.dumps(out))
"""


def _decode(v):
    if isinstance(v, dict) and "tensor" in v:
        return torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]))
    if isinstance(v, list):
        return tuple(_decode(x) for x in v)
    return v


def _torch_configs() -> list:
    run = subprocess.run(
        [sys.executable, "-c", _READ_DB % (tuple(CLASSES),)], capture_output=True, text=True, timeout=300
    )
    if run.returncode != 0:
        raise RuntimeError(f"reading torch's optim_db failed (pip install expecttest?):\n{run.stderr[-2000:]}")
    seen, cases = set(), []
    for name, desc, kwargs in json.loads(run.stdout):
        kwargs = {k: _decode(v) for k, v in kwargs.items()}
        key = (name, desc)
        if key in seen:
            continue
        seen.add(key)
        kwargs.pop("capturable", None)
        betas = kwargs.get("betas", ())
        skip = any(isinstance(b, torch.Tensor) and b.dim() > 0 for b in betas)
        marks = [pytest.mark.skip(reason="betas as >0-d tensors: purestep takes floats or 0-d tensors")] if skip else []
        cases.append(pytest.param(name, kwargs, id=f"{name}-{desc}", marks=marks))
    return cases


CONFIGS = _torch_configs()


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"bias": (5,), "w": (4, 3), "conv": (2, 3, 2, 2), "scalar": ()}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def test_the_torch_configurations_cover_maximize_and_amsgrad():
    covered = {(c.values[0], k) for c in CONFIGS for k, v in c.values[1].items() if v is True}
    assert {("SGD", "maximize"), ("Adam", "maximize"), ("AdamW", "maximize")} <= covered
    assert {("Adam", "amsgrad"), ("AdamW", "amsgrad"), ("SGD", "nesterov")} <= covered
    assert len(CONFIGS) >= 20


@pytest.mark.parametrize("name, kwargs", CONFIGS)
def test_optimizer_matches_torch_optim_on_its_own_test_configurations(name, kwargs):
    torch_cls, factory = CLASSES[name]
    ours = dict(kwargs)
    ours.setdefault("lr", inspect.signature(torch_cls).parameters["lr"].default)
    opt = factory(**ours)
    params = _params()
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    ref = torch_cls(list(tensors.values()), foreach=False, **kwargs)
    g = torch.Generator().manual_seed(1)
    state = opt.init(params)
    # float32 0-d tensor hyperparameters are rounded to float32 by torch in places; float64 otherwise.
    rtol = 1e-6 if any(isinstance(v, torch.Tensor) for v in ps.tree_leaves(kwargs)) else 1e-10
    for step in range(STEPS):
        grads = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in params.items()}
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
        for k, p in tensors.items():
            p.grad = grads[k].clone()
        ref.step()
        for k, p in tensors.items():
            torch.testing.assert_close(params[k], p.detach(), rtol=rtol, atol=1e-12, msg=lambda m: f"step {step}, {k}: {m}")
    for i, (k, p) in enumerate(tensors.items()):
        theirs = ref.state[p]
        if "step" in theirs:
            assert int(ps.step_count(state)) == int(theirs["step"]) == STEPS
        for buffer, field in BUFFERS.items():
            if theirs.get(buffer) is None:
                continue
            mine = ps.tree_get(state, field)[k]
            torch.testing.assert_close(mine, theirs[buffer], rtol=rtol, atol=1e-12, msg=lambda m: f"{buffer} of {k}: {m}")
    assert not torch.equal(params["w"], _params()["w"])


@pytest.mark.parametrize("factory", [ps.sgd, ps.adam, ps.adamw])
def test_maximize_ascends_the_objective(factory):
    # f(p) = -‖p - 3‖²: its maximum is at 3; with maximize the optimizer climbs to it.
    params = {"p": torch.zeros(4, dtype=torch.float64)}
    opt = factory(0.1, maximize=True)
    state = opt.init(params)
    for _ in range(200):
        grads = {"p": -2 * (params["p"] - 3.0)}
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
    torch.testing.assert_close(params["p"], torch.full((4,), 3.0, dtype=torch.float64), rtol=0, atol=0.1)


def test_amsgrad_keeps_the_running_max_of_the_second_moment():
    opt = ps.adam(0.1, amsgrad=True)
    params = {"p": torch.zeros(1, dtype=torch.float64)}
    state = opt.init(params)
    for g in (10.0, 0.0, 0.0):
        _, state = opt.update({"p": torch.tensor([g], dtype=torch.float64)}, state, params)
    nu, nu_max = ps.tree_get(state, "nu")["p"], ps.tree_get(state, "nu_max")["p"]
    assert nu_max.item() == pytest.approx(0.001 * 100.0) and nu.item() < nu_max.item()
    assert isinstance(ps.tree_get(state, "nu_max"), dict) and type(state[1]) is ps.ScaleByAmsgradState
