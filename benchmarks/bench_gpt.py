"""End to end, side by side: a small GPT training step with `ps.make_step(compile=True,
donate=True)` against the same nn.Module compiled with `torch.compile` + fused
`torch.optim.AdamW` (loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)).

    python benchmarks/bench_gpt.py

Prints tokens/s (interleaved in one process) and peak memory: on CUDA
`torch.cuda.max_memory_allocated` per contender; on CPU the peak resident set of a
fresh child process that runs only that contender (`--only NAME`), as the CPU
allocator has no peak counter of its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402

CONFIG = dict(vocab=256, d=256, layers=4, heads=4, seq=128, batch=16)
LR, WD = 3e-4, 0.1


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, d, layers, heads, seq, **_):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batch(device, step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CONFIG["vocab"], (CONFIG["batch"], CONFIG["seq"] + 1), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def torch_contender(device):
    torch.manual_seed(0)
    model = GPT(**CONFIG).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    compiled = torch.compile(model)
    data = [batch(device, i) for i in range(4)]
    i = [0]

    def step():
        x, y = data[i[0] % 4]
        i[0] += 1
        loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def purestep_contender(device):
    torch.manual_seed(0)
    model = GPT(**CONFIG).to(device)
    apply_fn, params, buffers = ps.functional_model(model)

    def loss_fn(params, batch):
        x, y = batch
        logits, _ = apply_fn(params, buffers, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    opt = ps.adamw(LR, weight_decay=WD)
    state = opt.init(params)
    train_step = ps.make_step(loss_fn, opt, compile=True, donate=True)
    data = [batch(device, i) for i in range(4)]
    i = [0]

    def step():
        train_step(params, state, data[i[0] % 4])
        i[0] += 1

    return step


CONTENDERS = {"torch compiled module + fused AdamW": torch_contender, "purestep make_step": purestep_contender}


def peak_memory_child(name: str, device: torch.device, steps: int) -> tuple[float, float]:
    """MiB: peak RSS (CPU) or peak allocated (CUDA) over `steps` steps after warm-up of a child
    running only `name`, and (CPU) its RSS when those steps began."""
    out = subprocess.run(
        [sys.executable, __file__, "--only", name, "--device", str(device), "--steps", str(steps)],
        capture_output=True, text=True, check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["peak_mib"], got["base_mib"]


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def only(name: str, device: torch.device, steps: int) -> None:
    step = CONTENDERS[name](device)
    for _ in range(2):  # compile and warm up first: compilation's own memory is not the step's
        step()
    C.sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _status_kib("VmRSS") / 1024 if device.type == "cpu" else 0.0
    for _ in range(steps):
        step()
    C.sync(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _status_kib("VmHWM") / 1024
    print(json.dumps({"peak_mib": peak, "base_mib": base}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="steps of each memory child")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.only:
        return only(args.only, device, args.steps)
    fns, compile_s = {}, {}
    for name, make in CONTENDERS.items():
        fns[name] = make(device)
        compile_s[name] = C.first_call(fns[name], device)
    t = C.interleaved(fns, device, warmup=2, reps=args.reps)
    peaks = {name: peak_memory_child(name, device, args.steps) for name in CONTENDERS}
    tokens = CONFIG["batch"] * CONFIG["seq"]
    n_params = sum(p.numel() for p in GPT(**CONFIG).parameters())
    ref = list(CONTENDERS)[0]
    rows = [
        [name, f"{sec * 1e3:.1f}", f"{tokens / sec:,.0f}", f"{t[ref] / sec:.3f}", f"{peaks[name][0]:.0f}",
         f"{peaks[name][0] / peaks[ref][0]:.3f}", f"{peaks[name][0] - peaks[name][1]:.0f}",
         f"{(peaks[name][0] - peaks[name][1]) / max(peaks[ref][0] - peaks[ref][1], 1e-9):.3f}", f"{compile_s[name]:.1f}"]
        for name, sec in t.items()
    ]
    header = ["contender", "ms / step", "tokens/s", "throughput / torch", "peak MiB", "peak / torch",
              "peak above start MiB", "above start / torch", "first call s"]
    mem = (
        "peak RSS (VmHWM, reset after 2 warm-up steps) of a child process running only that contender; "
        "'above start' subtracts the RSS when the measured steps began (params, state, compiled code)"
        if device.type == "cpu" else "torch.cuda.max_memory_allocated after 2 warm-up steps"
    )
    body = (
        f"GPT {CONFIG}, {n_params / 1e6:.2f}M params, AdamW lr={LR} wd={WD}, {args.reps} timed steps; "
        f"memory: {mem}.\n\n" + C.table(header, rows)
        + "\n\ntargets: throughput / torch >= 0.95, peak / torch <= 1.05\n"
    )
    print(body)
    if not args.no_write:
        print(C.write_result("gpt", "End-to-end small GPT training step", device, body))


if __name__ == "__main__":
    main()
