"""No host reads in an eager update: every 0-d tensor a step computes (counts, bias
corrections, injected hyperparameters, clip factors) stays on the device.

On CUDA a read of a device value (`.item()`, `bool(t)`, or a 0-d tensor bound where an op
takes a Python number, as `torch._foreach_add_(xs, t)` binds it) waits for the GPU. Every
such read goes through `aten._local_scalar_dense`, which a dispatch mode sees on the CPU
too, so these tests catch on any machine what `torch.cuda.set_sync_debug_mode("error")`
catches on a GPU (tests/api/test_trainer.py runs that one where CUDA is present).
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import purestep.core as ps
from purestep.core import _foreach
from tests.registry import TRANSFORMS

# Their refit (SOAP's preconditioner refresh, Kron's draw) or DiLoCo's sync is a data-dependent
# branch: eager, torch.cond reads the predicate on the host; compiled, it stays a device-side cond.
READS_A_BRANCH = {"soap", "scale_by_soap", "kron", "scale_by_kron", "diloco"}


class HostRead(AssertionError):
    pass


class _NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.line}" for f in traceback.extract_stack()[:-1]]
            raise HostRead("a device value read on the host at\n  " + "\n  ".join(where[-4:]))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch):
    """Fail on any read of a tensor's value by the host, on the code path a GPU takes (the
    eager CPU shortcut that runs AdamW leaf by leaf is switched off)."""
    monkeypatch.setattr(_foreach, "leafwise", lambda *a, **k: False)
    with _NoHostReads():
        yield


def _run(t: ps.Transform, monkeypatch: pytest.MonkeyPatch, extra_trees=(), matrices_only=False, steps=3):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 6, generator=g), "m": torch.randn(6, 4, generator=g)}
    if not matrices_only:
        params["b"] = torch.randn(6, generator=g)
    state = t.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        extra = {k: {n: torch.rand(v.shape, generator=g) for n, v in params.items()} for k in extra_trees}
        with no_host_reads(monkeypatch):
            updates, state = t.update(grads, state, params, **extra)
        params = ps.apply_updates(params, updates)


@pytest.mark.parametrize("name", sorted(set(TRANSFORMS) - READS_A_BRANCH))
def test_an_eager_update_reads_no_device_value(name, monkeypatch):
    case = TRANSFORMS[name]
    _run(case.make(), monkeypatch, case.extra_trees, case.matrices_only)


def test_injected_hyperparameters_are_read_on_the_device(monkeypatch):
    # Every hyperparameter a 0-d float64 tensor: eps went into torch._foreach_add_ as a number
    # (s.item()), a sync per step on CUDA, until `alpha=` picked the overload taking a tensor.
    for make in (
        lambda: ps.inject_hyperparams(ps.adamw)(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
        lambda: ps.inject_hyperparams(ps.prodigy)(lr=1.0),
        lambda: ps.chain(ps.clip_by_global_norm(1.0), ps.inject_hyperparams(ps.lion)(lr=1e-4)),
    ):
        _run(make(), monkeypatch)


def test_the_detector_sees_a_read_through_an_op_binding():
    xs = [torch.ones(3)]
    with pytest.raises(HostRead), _NoHostReads():
        torch._foreach_add_(xs, torch.tensor(1.0, dtype=torch.float64))  # the `.Scalar` overload: .item()
    with _NoHostReads():
        torch._foreach_add_(xs, torch.tensor(1.0, dtype=torch.float64), alpha=1)
