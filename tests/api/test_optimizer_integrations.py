"""The adapter inside the training loops torch users run it in: HF transformers' `Trainer` and
Lightning's (issue 23). Optional: each test runs where its package is installed
(`pip install transformers accelerate` / `pip install lightning`) and is skipped elsewhere,
since neither is a test dependency (both are large).

Each checks, against torch.optim.AdamW run by the same loop: the trajectory (to float32
rounding), a resume from the loop's own checkpoint (exact), and the loop's saved optimizer
state loading both ways between the adapter and torch's class.
"""

from __future__ import annotations

import copy

import pytest
import torch

import purestep.core as ps
from purestep.api import Optimizer

STEPS, HALF, BATCH = 10, 5, 4


def _data(n: int = HALF * BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, generator=g)


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _ours(params) -> torch.optim.Optimizer:
    return Optimizer(params, ps.adamw, lr=1e-2, weight_decay=0.1)


def _torchs(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _assert_params(a: torch.nn.Module, b: torch.nn.Module, exact: bool) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- transformers


class _Regression(torch.nn.Module):
    """A model as HF's Trainer takes one: keyword inputs in, a dict holding the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def _hf_train(tmp_path, make_opt, *, max_steps: int, resume: str | None = None) -> _Regression:
    transformers = pytest.importorskip("transformers")
    x, y = _data()
    rows = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    model = _Regression()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=BATCH, save_strategy="steps",
        save_steps=HALF, logging_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    return model


def test_hf_trainer_runs_the_adapter_as_torchs_adamw_and_resumes_exactly(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ours = _hf_train(tmp_path / "ours", _ours, max_steps=STEPS)
    theirs = _hf_train(tmp_path / "torch", _torchs, max_steps=STEPS)
    _assert_params(ours, theirs, exact=False)

    resumed = _hf_train(tmp_path / "ours", _ours, max_steps=STEPS, resume=str(tmp_path / "ours" / f"checkpoint-{HALF}"))
    _assert_params(resumed, ours, exact=True)

    # The optimizer.pt each loop wrote loads into the other class, and continues as it would.
    for src, make in (("ours", _torchs), ("torch", _ours)):
        saved = torch.load(tmp_path / src / f"checkpoint-{HALF}" / "optimizer.pt", weights_only=True)
        model = _Regression()
        opt = make(model.parameters())
        opt.load_state_dict(saved)
        assert len(opt.state_dict()["state"]) == len(list(model.parameters()))
        assert all(int(s["step"]) == HALF for s in opt.state_dict()["state"].values())


# --------------------------------------------------------------------------- Lightning


def _lightning_train(make_opt, *, epochs: int, ckpt_in=None, ckpt_out=None) -> torch.nn.Module:
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch, index):
            x, y = batch
            return ((self.net(x).squeeze(-1) - y) ** 2).mean()

        def configure_optimizers(self):
            opt = make_opt(self.parameters())
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    module = Module()
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    # One epoch is HALF steps, and runs stop at an epoch's end: Lightning resumes a run that
    # stopped mid-epoch (max_steps) from a non-stateful loader with its first batch twice.
    trainer.fit(module, loader, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return module.net


def test_lightning_runs_the_adapter_as_torchs_adamw_and_resumes_exactly(tmp_path):
    ours = _lightning_train(_ours, epochs=2)
    theirs = _lightning_train(_torchs, epochs=2)
    _assert_params(ours, theirs, exact=False)

    half = tmp_path / "half.ckpt"
    _lightning_train(_ours, epochs=1, ckpt_out=half)
    resumed = _lightning_train(_ours, epochs=2, ckpt_in=half)
    _assert_params(resumed, ours, exact=True)

    # Lightning's checkpoint holds the adapter's state_dict in torch's layout: torch's AdamW takes it.
    saved = torch.load(half, weights_only=False)["optimizer_states"][0]
    net = _net()
    ref = _torchs(net.parameters())
    ref.load_state_dict(copy.deepcopy(saved))
    assert all(int(s["step"]) == HALF for s in ref.state_dict()["state"].values())
