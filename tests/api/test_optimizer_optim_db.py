"""The adapter against torch.optim on torch's own optimizer-test configurations (issue 23).

Each SGD, Adam and AdamW entry of `torch.testing._internal.common_optimizers.optim_db` (as
`tests/core/test_optim_db.py` reads them, with the same two exceptions) is run through
`purestep.api.Optimizer` and the torch class side by side, checking what torch's generic
optimizer tests check of an optimizer class, in one scenario per configuration:

- two param groups (the second with its own lr and weight decay), a non-contiguous param,
  and a param frozen after two steps and unfrozen after the state_dict is saved (no grad in
  between: skipped, as torch skips it, its own step count held, so its bias correction
  after unfreezing is torch's);
- a closure step; params equal torch's after every step;
- `state_dict()` mid-run: loaded into a fresh adapter built from `named_parameters()` and
  into a fresh torch optimizer, both continue exactly as the original; the saved dict is
  not modified by the load; `state_dict()` is deterministic for equal params;
- `copy.deepcopy(opt)` continues exactly as the original;
- `state_dict` / `load_state_dict` hooks run;
- `optimizer.state[p]` holds torch's buffer names.

The adapter's default path (eager at this size) runs every configuration; `compile=True`
runs each class's defaults and each flag once (a compile costs seconds).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import purestep.core as ps
from purestep.api import Optimizer
from tests.core.test_optim_db import CONFIGS

FACTORIES = {
    "SGD": (torch.optim.SGD, ps.sgd),
    "Adam": (torch.optim.Adam, ps.adam),
    "AdamW": (torch.optim.AdamW, ps.adamw),
}
STEPS = 6


def _model(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return {
        "w": torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)),
        "strided": torch.nn.Parameter(wide[:, ::2]),  # non-contiguous
        "bias": torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64)),
        "frozen_after_two": torch.nn.Parameter(torch.randn(3, generator=g, dtype=torch.float64)),
    }


def _groups(params: dict, kwargs: dict, named: bool) -> list[dict]:
    lr = kwargs.get("lr", 1e-3)
    second_lr = lr * 0.5 if not isinstance(lr, torch.Tensor) else lr * 0.5
    pick = (lambda ks: [(k, params[k]) for k in ks]) if named else (lambda ks: [params[k] for k in ks])
    return [
        {"params": pick(["w", "strided"])},
        {"params": pick(["bias", "frozen_after_two"]), "lr": second_lr, "weight_decay": 0.05},
    ]


def _loss(params: dict, x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(params["w"].T @ x + params["strided"].T @ x)
    return (h.sum() + params["bias"].square().sum()) ** 2 / 10


def _step(opt, params: dict, k: int) -> None:
    x = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64) * (1 + k % 3)

    def closure():
        opt.zero_grad()
        loss = _loss(params, x)
        if k < 2 or k >= STEPS + 2:  # frozen in between: no grad, in a group whose other param has grads
            loss = loss + params["frozen_after_two"].square().sum()
        loss.backward()
        return loss

    opt.step(closure)


def _same(a: dict, b: dict, what: str, loose: bool) -> None:
    # float32 tensor hyperparameters: torch rounds some of its math to float32 (as in tests/core).
    rtol, atol = (1e-5, 1e-8) if loose else (1e-9, 1e-12)
    for k in a:
        torch.testing.assert_close(a[k].detach(), b[k].detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


def _build(name: str, kwargs: dict, params: dict, named: bool, compile: bool | None):
    torch_cls, factory = FACTORIES[name]
    ours = dict(kwargs)
    ours.setdefault("lr", inspect.signature(torch_cls).parameters["lr"].default)
    return Optimizer(_groups(params, ours, named), factory, compile=compile, **ours)


def _torch(name: str, kwargs: dict, params: dict):
    torch_cls, _ = FACTORIES[name]
    return torch_cls(_groups(params, kwargs, named=False), foreach=False, **kwargs)


def _compiled_cases() -> list:
    """Each class's defaults, and each flag that changes the step's code once (in the
    first class that has it alone): 7 compiles."""
    chosen, seen = [], set()
    for case in CONFIGS:
        name, kwargs = case.values
        if case.marks:
            continue
        flags = tuple(sorted(k for k, v in kwargs.items() if v is True or isinstance(v, torch.Tensor)))
        key = flags if flags else (name,)
        if key not in seen and len(flags) <= 1:
            seen.add(key)
            chosen.append(pytest.param(name, kwargs, id=case.id))
    return chosen


def _run(name: str, kwargs: dict, compile: bool | None) -> None:
    mine, theirs = _model(), _model()
    loose = any(isinstance(v, torch.Tensor) for v in ps.tree_leaves(kwargs))
    opt, ref = _build(name, kwargs, mine, False, compile), _torch(name, kwargs, theirs)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save"))
    for k in range(STEPS):
        _step(opt, mine, k)
        _step(ref, theirs, k)
        _same(mine, theirs, f"step {k}", loose)

    # state_dict mid-run, into a fresh adapter built from named params and a fresh torch optimizer.
    saved = opt.state_dict()
    frozen = copy.deepcopy(saved)
    named, plain_torch = _model(), _model()
    for src, dst in ((mine, named), (mine, plain_torch)):
        with torch.no_grad():
            for k in src:
                dst[k].copy_(src[k])
    reloaded = _build(name, kwargs, named, True, compile)
    reloaded.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    reloaded.load_state_dict(saved)
    as_torch = _torch(name, kwargs, plain_torch)
    as_torch.load_state_dict(copy.deepcopy(saved))
    torch.testing.assert_close(saved, frozen, rtol=0, atol=0)  # loading did not modify it
    twin = copy.deepcopy(opt)
    twin_params = {k: p for k, p in zip(mine, (p for g in twin.param_groups for p in g["params"]))}
    assert calls[:2] == ["save", "load"], calls
    for k in range(STEPS, 2 * STEPS):
        for o, p in ((opt, mine), (ref, theirs), (reloaded, named), (as_torch, plain_torch), (twin, twin_params)):
            _step(o, p, k)
        _same(mine, theirs, f"step {k}", loose)
        _same(named, theirs, f"reloaded (named), step {k}", loose)
        _same(plain_torch, theirs, f"loaded into torch, step {k}", loose)
        _same(twin_params, theirs, f"deepcopy, step {k}", loose)
    # Deterministic for equal params, and torch's buffer names in `state`.
    torch.testing.assert_close(reloaded.state_dict()["state"], opt.state_dict()["state"], rtol=1e-6, atol=1e-10)
    want = {k for k in ref.state[theirs["w"]]}
    assert set(opt.state[mine["w"]]) == want, (set(opt.state[mine["w"]]), want)


@pytest.mark.parametrize("name, kwargs", CONFIGS)
def test_adapter_matches_torch_on_its_test_configurations(name, kwargs):
    _run(name, kwargs, compile=None)


@pytest.mark.parametrize("name, kwargs", _compiled_cases())
def test_compiled_adapter_matches_torch_on_its_test_configurations(name, kwargs):
    _run(name, kwargs, compile=True)


_ERRORS = r"""
import re, warnings, torch
from torch.testing._internal.common_optimizers import optim_db, OptimizerErrorEnum
import purestep.core as ps
from purestep.api import Optimizer
FACTORIES = {"SGD": ps.sgd, "Adam": ps.adam, "AdamW": ps.adamw}
for info in optim_db:
    name = info.optim_cls.__name__
    if name not in FACTORIES:
        continue
    for ei in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        inp = ei.optimizer_error_input
        if "foreach" in inp.desc:  # torch's foreach implementation's own limits
            continue
        got = "nothing"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt = Optimizer(inp.params, FACTORIES[name], **inp.kwargs)
                if ei.error_on == OptimizerErrorEnum.STEP_ERROR:
                    opt.step()
            except Exception as e:
                got = f"{type(e).__name__}: {e}"
        got += "".join(f" | {w.category.__name__}: {w.message}" for w in caught)
        ok = ei.error_type.__name__ in got and re.search(ei.error_regex, got) is not None
        print("OK" if ok else "BAD", name, inp.desc, "| wanted", ei.error_type.__name__, ei.error_regex, "| got", got)
"""


def test_torchs_error_inputs_get_torchs_errors():
    # optim_db's error inputs (bad lr, betas, weight_decay, momentum, tensor lr shapes, params
    # that are not an iterable, duplicates, named and unnamed params mixed): the adapter
    # raises (or warns) what torch's class does. Read in a subprocess, as tests/core's.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _ERRORS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("OK", "BAD"))]
    assert len(lines) >= 20, run.stdout[-3000:]
    bad = [line for line in lines if line.startswith("BAD")]
    assert not bad, "\n".join(bad)


def test_a_mirrored_factory_without_lr_takes_torchs_default():
    mine, theirs = _model(), _model()
    opt = Optimizer(list(mine.values()), ps.adamw)
    ref = torch.optim.AdamW(list(theirs.values()), foreach=False)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-3
    for k in range(3):
        _step(opt, mine, k)
        _step(ref, theirs, k)
    _same(mine, theirs, "default lr", loose=False)
