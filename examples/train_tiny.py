"""Train a tiny byte-level language model with purestep.core and print its falling loss.

The text is the Python standard library's own source, so nothing is downloaded.
"""

from __future__ import annotations

import pathlib
import sysconfig

import torch
import torch.nn.functional as F

import purestep.core as ps


def load_corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def init_params(dim: int = 64, context: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, dim, generator=g) * 0.02,
        "mlp.weight": torch.randn(context * dim, 4 * dim, generator=g) / (context * dim) ** 0.5,
        "mlp.bias": torch.zeros(4 * dim),
        "head.weight": torch.randn(4 * dim, 256, generator=g) / (4 * dim) ** 0.5,
        "head.bias": torch.zeros(256),
    }


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = params["embed.weight"][x].flatten(1)  # (B, context*dim)
    h = F.gelu(h @ params["mlp.weight"] + params["mlp.bias"])
    logits = h @ params["head.weight"] + params["head.bias"]
    return F.cross_entropy(logits, y)


def main(steps: int = 300, batch: int = 256, context: int = 8) -> None:
    torch.manual_seed(0)
    data = load_corpus()
    params = init_params(context=context)
    schedule = lambda step: 3e-3 * torch.clamp((step + 1) / 30, max=1.0)  # noqa: E731
    opt = ps.adamw(lr=schedule, weight_decay=0.1, mask={k: k.endswith("weight") and "embed" not in k for k in params})
    state = opt.init(params)
    grad_fn = torch.func.grad_and_value(loss_fn)
    for step in range(steps):
        idx = torch.randint(0, len(data) - context - 1, (batch,))
        x = torch.stack([data[i : i + context] for i in idx.tolist()])
        y = data[idx + context]
        grads, loss = grad_fn(params, x, y)
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  bits/byte {loss.item() / 0.6931:.3f}")


if __name__ == "__main__":
    main()
