"""Shared benchmark plumbing: interleaved timing, machine description, markdown results."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch._inductor.config

RESULTS = Path(__file__).parent / "results"

# Compile times are compared cold: a warm FX-graph cache from an earlier run would make
# whichever contender ran before look fast.
torch._inductor.config.force_disable_caches = True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def first_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds taken by the first call (compile time for compiled contenders)."""
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def warm_compiler(device: torch.device) -> None:
    """Compile and run one tiny elementwise and one matmul function, so that the one-time
    costs of a process (imports, the C++/Triton toolchain, thread pools) are not charged to
    the first contender timed."""
    x = torch.randn(4, 4, device=device)
    torch.compile(lambda a: (a * 2 + 1).sin() @ a, fullgraph=True)(x)
    sync(device)
    torch._dynamo.reset()


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, *, warmup: int = 3, reps: int = 20) -> dict[str, float]:
    """Median seconds per call of each contender, measured round-robin so that load
    from other processes hits every contender alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        cpu = platform.processor() or platform.machine()
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        what = f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{what}; torch {torch.__version__}; Python {platform.python_version()}"


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def write_result(name: str, title: str, device: torch.device, body: str) -> Path:
    """Write `benchmarks/results/<date>-<name>-<device>.md` and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = RESULTS / f"{date}-{name}-{device.type}.md"
    command = "python " + " ".join([os.path.relpath(sys.argv[0], Path.cwd())] + sys.argv[1:])
    text = (
        f"# {title}\n\n"
        f"- date: {date}\n- machine: {machine(device)}\n- command: `{command}`\n"
        "- inductor caches: disabled (compile times are cold)\n"
        f"- load average at the end (1, 5, 15 min): {load_average()}\n\n{body}\n"
    )
    path.write_text(text)
    return path


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)
