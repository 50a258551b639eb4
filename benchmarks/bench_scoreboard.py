"""A scoreboard: LightBench's pass/fail tasks, every purestep family a peer also implements
against HeavyBall's and pytorch_optimizer's implementations of the same algorithm (and
torch.optim's where it has one), on the CPU, with the same budget for each.

    python benchmarks/bench_scoreboard.py               # ~10 min on 2 cores: 26 tasks x 3 lrs x 1000 steps
    python benchmarks/bench_scoreboard.py --full        # 5 lrs, 3000 steps
    python benchmarks/bench_scoreboard.py --out auto    # also results/<date>-scoreboard-cpu.{md,json,png}

The tasks are LightBench's own (HomebrewML/LightBench, `lightbench` 0.1.1): each task
module builds its model, data, loss and win condition in `main()` and hands them to
`lightbench.utils.trial`, which runs on CUDA only. Here `main()` runs with `trial` replaced
by a function that keeps its arguments (and `.cuda()` / `device="cuda"` sent to the CPU), and
this file's loop trains a fresh copy of the model with each contender: nothing of a task is
copied. A contender wins a task when, at one of the learning rates of the grid, the win
condition holds after some step within the budget (checked every step: the loss the step
computed and the params after it). Every run starts from the task's model as built with the
global RNG seeded (LightBench's data closures draw from it), so the same command gives the
same table on the same machine.

Hyperparameters: the learning rate from the grid (Prodigy: its multiplier, the grid / 3e-2);
no weight decay; betas as each algorithm's paper and purestep's default (Adam family
(0.9, 0.999), SOAP (0.95, 0.95)), pinned in every library so that only the implementation
differs; Muon's Newton-Schulz in bfloat16 (purestep's default, pytorch_optimizer's);
everything else each library's default.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import inspect
import json
import math
import multiprocessing
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402

# (task module, tier): LightBench's trivial and easy tiers, where a task can be won on the CPU
# in 1000 steps by some optimizer at some lr (tasks that cannot be won as written are left out:
# wide_linear and minimax (their win condition is not the optimum), quadratic_flip (unbounded
# below), the quantization-aware and constrained ones, memory_constrained (CUDA only)).
TASKS = [
    ("rosenbrock", "trivial"),
    ("quadratic_varying_scale", "trivial"),
    ("quadratic_varying_scale", "easy"),
    ("quadratic_varying_target", "easy"),
    ("saddle_point", "trivial"),
    ("saddle_point", "easy"),
    ("plateau_navigation", "trivial"),
    ("plateau_navigation", "easy"),
    ("scale_invariant", "trivial"),
    ("momentum_utilization", "trivial"),
    ("momentum_utilization", "easy"),
    ("batch_size_scaling", "trivial"),
    ("layer_wise_scale", "trivial"),
    ("layer_wise_scale", "easy"),
    ("gradient_delay", "trivial"),
    ("gradient_delay", "easy"),
    ("dynamic_landscape", "trivial"),
    ("sparse_parameters", "trivial"),
    ("ill_conditioned", "trivial"),
    ("ill_conditioned_mismatched", "trivial"),
    ("quadratic_sparse", "trivial"),
    ("quadratic_quantized_gradient", "trivial"),
    ("class_imbalance_rare", "trivial"),
    ("xor_sequence_rnn", "trivial"),
    ("xor_sequence", "trivial"),
    ("parameter_scale", "easy"),
]
SEED = 0x12312  # LightBench's per-trial seed


# -- LightBench's tasks on the CPU -----------------------------------------------------------
class _CudaToCpu(TorchFunctionMode):
    """Factory calls asking for device="cuda" get the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and not isinstance(dev, int) and torch.device(dev).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _on_cpu():
    saved = torch.nn.Module.cuda, torch.Tensor.cuda
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.nn.Module.cuda, torch.Tensor.cuda = saved


def _seed(seed: int) -> None:
    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@dataclasses.dataclass
class Task:
    name: str
    tier: str
    model: torch.nn.Module  # as built; each run trains a deep copy
    data: Callable | None  # () -> (input, target); None when the model's forward is the loss
    loss_fn: Callable | None
    win: Callable  # (model, loss) -> (bool, info)


class _Taken(Exception):
    pass


def load_task(name: str, tier: str) -> Task:
    """Run the task module's `main()` up to its `trial(...)` call and keep what it hands over."""
    import typer.models

    saved = (torch.get_float32_matmul_precision(), torch._dynamo.config.cache_size_limit)
    mod = importlib.import_module(f"lightbench.{name}")
    got: dict[str, Any] = {}

    def take(model, data, loss_fn, win_condition, steps, opt, weight_decay, *args, **kwargs):
        got.update(model=model, data=data, loss_fn=loss_fn, win=win_condition, dtype=kwargs.get("dtype"))
        raise _Taken

    kwargs = {}
    for pname, p in inspect.signature(mod.main).parameters.items():  # typer's defaults, unwrapped
        kwargs[pname] = p.default.default if isinstance(p.default, typer.models.OptionInfo) else p.default
    kwargs.update(config=tier, steps=1000)
    real, mod.trial = mod.trial, take
    _seed(0)
    try:
        with _on_cpu():
            mod.main(**kwargs)
    except _Taken:
        pass
    finally:
        mod.trial = real
        # importing a task sets torch's globals for its own harness: put them back
        torch.set_float32_matmul_precision(saved[0])
        torch._dynamo.config.cache_size_limit = saved[1]
    from lightbench.utils import _resolve_dtype

    model, dtype = got["model"], _resolve_dtype(got["dtype"])
    if dtype is not None:
        model = model.to(dtype=dtype)
    return Task(name, tier, model, got["data"], got["loss_fn"], got["win"])


# -- contenders --------------------------------------------------------------------------------
class PureStep:
    """A purestep transform through the functional API: `make_update(..., donate=True)` on
    the model's params (by name), grads from `loss.backward()` (a param without a grad this
    step gets zeros), the win checked on `eval_params` where the family has them."""

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        transform: ps.Transform,
        evaluate: bool = False,
        compile: bool = False,
    ):
        self.params = dict(params)
        self.transform, self.evaluate = transform, evaluate
        self.state = transform.init({k: p.detach() for k, p in self.params.items()})
        self.update = ps.make_update(transform, compile=compile, donate=True)
        self.kept: dict[str, torch.Tensor] | None = None
        # Eagerly the update writes through `.data` (as torch.optim does: a task's stored graph
        # must not see a version bump); compiled, the Parameters themselves (bound once).
        self.bound = dict(self.params) if compile else None

    def step(self, closure: Callable) -> torch.Tensor:
        self.train()
        with torch.enable_grad():
            loss = closure()
        grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in self.params.items()}
        with torch.no_grad():
            self.update(self.bound or {k: p.data for k, p in self.params.items()}, grads, self.state)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            p.grad = None

    def train(self) -> None:
        if self.kept is not None:  # back to the params the update runs on
            for k, p in self.params.items():
                p.data.copy_(self.kept[k])
            self.kept = None

    def eval(self) -> None:
        if self.evaluate and self.kept is None:  # schedule-free: the win is judged at x
            self.kept = {k: p.detach().clone() for k, p in self.params.items()}
            x = ps.schedule_free_eval_params(self.state, self.kept)
            for k, p in self.params.items():
                p.data.copy_(x[k])


def _purestep(make: Callable[[float], ps.Transform], evaluate: bool = False) -> Callable:
    return lambda named, lr, compile=False: PureStep(named, make(lr), evaluate, compile)


def _peer(make: Callable) -> Callable:
    return lambda named, lr: make([p for _, p in named], lr)


def _po_muon(params: list, lr: float) -> Any:
    import pytorch_optimizer as po

    mats, rest = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    groups = ([{"params": mats, "use_muon": True, "lr": lr}] if mats else []) + (
        [{"params": rest, "use_muon": False, "lr": lr, "adamw_lr": lr}] if rest else []
    )
    return po.Muon(groups, adamw_wd=0.0, weight_decay=0.0)


def contenders() -> dict[str, dict[str, Callable]]:
    """algorithm -> library -> factory(named params, lr) -> an optimizer with `step(closure)`."""
    import heavyball
    import heavyball.utils
    import pytorch_optimizer as po

    heavyball.utils.compile_mode = None  # eager, as the others: no compile per task shape on the CPU
    adam = (0.9, 0.999)
    return {
        "AdamW": {
            "purestep": _purestep(lambda lr: ps.adamw(lr, weight_decay=0.0)),
            "heavyball": _peer(lambda p, lr: heavyball.AdamW(p, lr=lr, betas=adam)),
            "torch": _peer(lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.0)),
        },
        "Lion": {
            "purestep": _purestep(lambda lr: ps.lion(lr)),
            "pytorch_optimizer": _peer(lambda p, lr: po.Lion(p, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)),
        },
        "Muon (+AdamW)": {
            "purestep": _purestep(lambda lr: ps.muon_adamw(lr, weight_decay=0.0, adamw_lr=lr, adamw_weight_decay=0.0)),
            "heavyball": _peer(lambda p, lr: heavyball.MuonAdamW(p, lr=lr, betas=(0.9, 0.95))),
            "pytorch_optimizer": _peer(_po_muon),
        },
        "SOAP": {
            "purestep": _purestep(lambda lr: ps.soap(lr, weight_decay=0.0)),
            "heavyball": _peer(lambda p, lr: heavyball.SOAP(p, lr=lr, betas=(0.95, 0.95), weight_decay=0.0)),
            "pytorch_optimizer": _peer(lambda p, lr: po.SOAP(p, lr=lr, betas=(0.95, 0.95), weight_decay=0.0)),
        },
        "PSGD-Kron": {
            "purestep": _purestep(lambda lr: ps.kron(lr)),
            "heavyball": _peer(lambda p, lr: heavyball.PSGDKron(p, lr=lr)),
            "pytorch_optimizer": _peer(lambda p, lr: po.Kron(p, lr=lr)),
        },
        "Schedule-Free AdamW": {
            "purestep": _purestep(lambda lr: ps.schedule_free_adamw(lr), evaluate=True),
            "heavyball": _peer(lambda p, lr: heavyball.SFAdamW(p, lr=lr, betas=adam)),
            "pytorch_optimizer": _peer(lambda p, lr: po.ScheduleFreeAdamW(p, lr=lr, betas=adam)),
        },
        "ADOPT": {
            "purestep": _purestep(lambda lr: ps.adopt(lr)),
            "heavyball": _peer(lambda p, lr: heavyball.ADOPT(p, lr=lr, betas=(0.9, 0.9999))),
            "pytorch_optimizer": _peer(lambda p, lr: po.ADOPT(p, lr=lr, betas=(0.9, 0.9999))),
        },
        "LaProp": {
            "purestep": _purestep(lambda lr: ps.laprop(lr)),
            "heavyball": _peer(lambda p, lr: heavyball.LaProp(p, lr=lr, betas=adam)),
            "pytorch_optimizer": _peer(lambda p, lr: po.LaProp(p, lr=lr, betas=adam)),
        },
        "MARS": {
            "purestep": _purestep(lambda lr: ps.mars(lr)),
            "heavyball": _peer(lambda p, lr: heavyball.AdamW(p, lr=lr, betas=(0.95, 0.99), mars=True)),
            "pytorch_optimizer": _peer(lambda p, lr: po.MARS(p, lr=lr, optimize_1d=True, weight_decay=0.0)),
        },
        "AdEMAMix": {
            "purestep": _purestep(lambda lr: ps.ademamix(lr)),
            "heavyball": _peer(lambda p, lr: heavyball.AdEMAMix(p, lr=lr, alpha=5.0)),
            "pytorch_optimizer": _peer(lambda p, lr: po.AdEMAMix(p, lr=lr, alpha=5.0)),
        },
        "Prodigy": {
            "purestep": _purestep(lambda lr: ps.prodigy(lr)),
            "pytorch_optimizer": _peer(lambda p, lr: po.Prodigy(p, lr=lr)),
        },
        "cautious AdamW": {
            "purestep": _purestep(lambda lr: ps.cautious_adamw(lr, weight_decay=0.0)),
            "heavyball": _peer(lambda p, lr: heavyball.AdamW(p, lr=lr, betas=adam, caution=True)),
        },
    }


# -- one run -----------------------------------------------------------------------------------
def run(task: Task, make: Callable, lr: float, steps: int) -> int | str | None:
    """The first step after which the task is won, "nan" if the loss stopped being finite, None."""
    _seed(SEED)
    model = copy.deepcopy(task.model)
    opt = make([(n, p) for n, p in model.named_parameters() if p.requires_grad], lr)
    modes = hasattr(opt, "train") and hasattr(opt, "eval")
    data = task.data or (lambda: (None, None))
    for step in range(1, steps + 1):
        with _CudaToCpu():
            x, y = data()

        def closure():
            out = model() if x is None else model(x)
            loss = task.loss_fn(out, y) if task.loss_fn is not None else out
            loss.backward()
            return loss

        if modes:
            opt.train()
        loss = float(opt.step(closure).detach())
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss):
            return "nan"
        if modes:
            opt.eval()
        with torch.no_grad(), _CudaToCpu():
            if bool(task.win(model, loss)[0]):
                return step
    return None


def run_task(job: tuple[int, str, str, list[float], int]) -> list[dict]:
    """Every contender on one task (a worker process's share)."""
    _, name, tier, lrs, steps = job
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    task = load_task(name, tier)
    out = []
    for algo, libs in contenders().items():
        for lib, make in libs.items():
            grid = [lr / 3e-2 for lr in lrs] if algo == "Prodigy" else lrs
            start, wins, error = time.process_time(), {}, None
            for lr in grid:
                try:
                    wins[f"{lr:g}"] = run(task, make, lr, steps)
                except Exception as e:  # noqa: BLE001 - a contender that cannot run the task: recorded
                    error = f"{type(e).__name__}: {str(e)[:120]}"
                    break
            out.append(
                {
                    "task": f"{name}:{tier}",
                    "algo": algo,
                    "lib": lib,
                    "wins": wins,
                    "error": error,
                    "cpu_s": round(time.process_time() - start, 2),
                }
            )
    return out


# -- step time on identical shapes ---------------------------------------------------------------
def step_times(reps: int) -> dict[tuple[str, str], float]:
    """Each contender's optimizer step on the same params and grads (a 4-layer MLP's, 0.53M
    params), interleaved in one process (`_common.interleaved`): seconds per step. purestep
    twice: eager (as on the tasks) and compiled (`make_update(compile=True, donate=True)`)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = [(512, 256), (512,), (512, 512), (512,), (256, 512), (256,), (16, 256), (16,)]
    fns: dict[str, Callable] = {}
    names: dict[str, tuple[str, str]] = {}
    runs = [(algo, lib, make, False) for algo, libs in contenders().items() for lib, make in libs.items()]
    runs += [(algo, "purestep compiled", libs["purestep"], True) for algo, libs in contenders().items()]
    for algo, lib, make, compiled in runs:
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
        grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
        named = [(f"p{i}", p) for i, p in enumerate(params)]
        lr = 3e-3 if algo != "Prodigy" else 1.0
        opt = make(named, lr, compile=True) if compiled else make(named, lr)
        if hasattr(opt, "train"):
            opt.train()

        def closure(params=params, grads=grads):
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            return torch.zeros(())

        key = f"{algo} / {lib}"
        fns[key], names[key] = (lambda opt=opt, closure=closure: opt.step(closure)), (algo, lib)
        if compiled:
            C.first_call(fns[key], torch.device("cpu"))  # the compile, outside the timing
    times = C.interleaved(fns, torch.device("cpu"), reps=reps)
    return {names[k]: t for k, t in times.items()}


# -- the report ------------------------------------------------------------------------------------
def _cell(wins: dict, error: str | None) -> str:
    if error:
        return "err"
    won = [v for v in wins.values() if isinstance(v, int)]
    return str(min(won)) if won else ("nan" if "nan" in wins.values() else "✗")


def report(rows: list[dict], times: dict, args: argparse.Namespace, wall: float, chosen: list) -> tuple[str, dict]:
    tasks = [f"{n}:{t}" for n, t in chosen]
    columns = sorted({(r["algo"], r["lib"]) for r in rows}, key=lambda c: (list(contenders()).index(c[0]), c[1]))
    cell = {(r["task"], r["algo"], r["lib"]): _cell(r["wins"], r["error"]) for r in rows}
    won = {k: v.isdigit() for k, v in cell.items()}
    lines = ["| algorithm | library | tasks won | of |", "|---|---|---|---|"]
    summary = {}
    for algo, lib in columns:
        n = sum(won[(t, algo, lib)] for t in tasks)
        summary[f"{algo} / {lib}"] = n
        lines.append(f"| {algo} | {lib} | {n} | {len(tasks)} |")
    speed = ["| algorithm | library | ms / step | / fastest peer |", "|---|---|---|---|"]
    for algo in dict.fromkeys(a for a, _ in columns):
        peers = [t for (a, lib), t in times.items() if a == algo and not lib.startswith("purestep")]
        for (a, lib), t in sorted(times.items(), key=lambda kv: kv[0][1]):
            if a == algo:
                speed.append(
                    f"| {algo} | {lib} | {t * 1e3:.3f} | {t / min(peers):.2f} |"
                    if peers
                    else f"| {algo} | {lib} | {t * 1e3:.3f} | |"
                )
    matrix = ["| task | " + " | ".join(f"{a} / {lib}" for a, lib in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for t in tasks:
        matrix.append(f"| {t} | " + " | ".join(cell.get((t, a, lib), "") for a, lib in columns) + " |")
    errors = sorted({f"{r['algo']} / {r['lib']} on {r['task']}: {r['error']}" for r in rows if r["error"]})
    body = (
        f"Budget: learning rates {args.lrs} (Prodigy: those / 3e-2, its multiplier), {args.steps} steps per run, "
        f"{len(tasks)} tasks; wall time {wall / 60:.1f} min on {args.workers} processes.\n\n"
        + "\n".join(lines)
        + "\n\nStep time on identical shapes (a 4-layer MLP's 0.53M params, one thread, interleaved in one "
        "process; purestep eager as on the tasks, and compiled):\n\n"
        + "\n".join(speed)
        + "\n\nPer task: the first step after which the task was won, at the best learning rate of the grid "
        "(✗: not won within the budget at any; nan: the loss stopped being finite; err: the contender "
        "cannot run the task).\n\n"
        + "\n".join(matrix)
        + ("\n\nErrors:\n\n" + "\n".join(f"- {e}" for e in errors) if errors else "")
        + "\n\n## The LM table\n\n"
        + lm_table()
    )
    return body, {"columns": columns, "tasks": tasks, "cell": cell, "summary": summary}


def lm_table() -> str:
    """The LM quality table's latest rows: the demo GPT per family at its tuned lr
    (`bench_families.py quality`), from the newest committed results file that has them."""
    marker = "### At each optimizer's best lr"
    files = sorted(f for f in C.RESULTS.glob("*-families-quality-*-cpu.md") if marker in f.read_text())
    if not files:
        return "(no committed LM quality table: `python benchmarks/bench_families.py quality`)"
    text = files[-1].read_text().split(marker, 1)[1].strip().splitlines()
    rows = [
        line
        for line in text[: next((i for i, x in enumerate(text) if x.startswith("#")), len(text))]
        if line.startswith("|")
    ]
    return (
        f"From `{files[-1].name}` (the demo GPT, 480 steps, 3 seeds, each family at its best lr of a grid):\n\n"
        + "\n".join(rows)
    )


def draw(data: dict, path: Path) -> None:
    """The task x contender matrix: won (green, brighter when sooner), not won (grey), nan/err (red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks, columns, cell = data["tasks"], data["columns"], data["cell"]
    grid = np.zeros((len(tasks), len(columns), 3))
    for i, t in enumerate(tasks):
        for j, (a, lib) in enumerate(columns):
            v = cell.get((t, a, lib), "")
            if v.isdigit():
                shade = 0.25 + 0.6 * min(1.0, math.log10(int(v)) / 3)
                grid[i, j] = (shade * 0.6, 0.45 + 0.4 * (1 - shade), shade * 0.6)
            elif v in ("nan", "err"):
                grid[i, j] = (0.8, 0.2, 0.2)
            else:
                grid[i, j] = (0.85, 0.85, 0.85)
    fig, ax = plt.subplots(figsize=(0.32 * len(columns) + 4, 0.28 * len(tasks) + 3))
    ax.imshow(grid, aspect="auto")
    ax.set_xticks(range(len(columns)), [f"{a} / {lib}" for a, lib in columns], rotation=90, fontsize=7)
    ax.set_yticks(range(len(tasks)), tasks, fontsize=7)
    ax.set_title(
        "LightBench tasks on the CPU: won (green, brighter = sooner), not won (grey), nan/error (red)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="5 lrs, 3000 steps")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tasks", nargs="*", default=None, help="task:tier names (default: all of TASKS)")
    ap.add_argument("--reps", type=int, default=20, help="step-time repetitions")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.lrs = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1] if a.full else [3e-3, 3e-2, 3e-1]
    a.steps = 3000 if a.full else 1000
    chosen = [t for t in TASKS if a.tasks is None or f"{t[0]}:{t[1]}" in a.tasks]
    start = time.time()
    jobs = [(i, n, t, a.lrs, a.steps) for i, (n, t) in enumerate(chosen)]
    jobs.sort(key=lambda j: j[1].startswith("xor") or j[1] == "sparse_parameters", reverse=True)  # long ones first
    with multiprocessing.get_context("spawn").Pool(a.workers) as pool:
        rows = [r for part in pool.imap_unordered(run_task, jobs) for r in part]
    times = step_times(a.reps)
    body, data = report(rows, times, a, time.time() - start, chosen)
    print(body)
    if a.out:
        path = C.write_result(
            "scoreboard", "A scoreboard: LightBench's tasks, every family against its peers", torch.device("cpu"), body
        )
        stem = path.with_suffix("")
        draw(data, stem.with_suffix(".png"))
        stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        print(path)


if __name__ == "__main__":
    main()
