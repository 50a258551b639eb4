"""The demo's model: a small GPT (RMSNorm, rotary positions, SwiGLU), and its loss.

Names follow the conventions `ps.muon_labels` and `ps.decay_mask` read: `embed.*`,
`blocks.<i>.*`, `norm.*`, `lm_head.*`. `flops_per_token()` lets the Trainer report MFU.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import purestep.core as ps
from purestep.core.engine.dtensor import is_dtensor

from .errors import ConfigError

if torch.distributed.is_available():
    from torch.distributed.tensor.parallel.style import ParallelStyle
else:  # a torch built without distributed: nothing to split experts over
    ParallelStyle = object  # type: ignore[misc,assignment]


def rope_tables(seq_len: int, head_dim: int, base: float = 10_000.0) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each (seq_len, head_dim // 2)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs of channels of x (B, H, T, D) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary positions. q, k and v are projections of their own
    (torchtitan's layout): tensor parallelism splits each by heads (column-wise), `proj` by
    its input (row-wise), and Muon and QK-clip see W_q and W_k as the matrices they are."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.track_max_logits = False  # QK-clip: record each head's max pre-softmax logit
        self.max_logits: Tensor | None = None  # (heads,), the max over the forwards since the last take

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        # (B, H, T, D); H is this rank's heads under tensor parallelism (the projections' local columns)
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.track_max_logits:
            self._record_max_logits(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    @torch.no_grad()
    def _record_max_logits(self, q: Tensor, k: Tensor) -> None:
        """Each head's max of q·k/√d over the causal positions of this batch (one more q·kᵀ
        than the fused attention computes: the price of an exact max)."""
        T = q.shape[2]
        scores = (q @ k.transpose(-2, -1)).float() * (q.shape[-1] ** -0.5)  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        now = scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
        self.max_logits = now if self.max_logits is None else torch.maximum(self.max_logits, now)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Experts(nn.Module):
    """E SwiGLU experts as (E, m, n) leaves (`gate`, `up`: (E, hidden, dim); `down`: (E, dim,
    hidden)): Muon orthogonalizes each expert's matrix on its own (`batch_dims` 1,
    `GPT.batch_dims`). `forward(xs, counts)` runs expert e on its `counts[e]` rows of `xs`
    (the token slots sorted by expert).

    Under expert parallelism (`ExpertParallel`: each weight a DTensor split by experts,
    `Shard(0)`, over the `ep` ranks) a rank holds E/N of them: the slot counts are exchanged
    first (an all_to_all of E integers, read on the host), then every slot travels to the rank
    of its expert and its output back (torchtitan's token dispatch: an all_to_all each way,
    both differentiable). An expert's grad then sums the tokens of every rank of the EP
    group; it is scaled to their mean, as data parallelism's grads are."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(experts, hidden, dim))
        self.up = nn.Parameter(torch.empty(experts, hidden, dim))
        self.down = nn.Parameter(torch.empty(experts, dim, hidden))

    def forward(self, xs: Tensor, counts: list[int]) -> Tensor:
        if is_dtensor(self.gate):
            return self._parallel(xs, counts)
        return _swiglu_experts(xs, counts, self.gate, self.up, self.down)

    def _parallel(self, xs: Tensor, counts: list[int]) -> Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        mesh = cast(Any, self.gate).device_mesh
        group, n = mesh.get_group(), mesh.size()
        # each expert's grad sums the tokens of every rank of the group: scaled to their mean,
        # the grads data parallelism expects (FSDP2 then averages over the other ranks)
        gate, up, down = (_GradScale.apply(cast(Any, w).to_local(), 1 / n) for w in (self.gate, self.up, self.down))
        local = gate.shape[0]  # this rank's experts: [rank·local, (rank + 1)·local)
        mine = torch.tensor(counts, dtype=torch.int64, device=xs.device)
        theirs = torch.empty_like(mine)  # (source rank, my expert): the slots each rank sends each of mine
        dist.all_to_all_single(theirs, mine, group=group)
        got = theirs.view(n, local).tolist()
        send = [sum(counts[r * local : (r + 1) * local]) for r in range(n)]
        recv = [sum(row) for row in got]
        x = fc.all_to_all_single_autograd(xs, recv, send, group)
        pieces = x.split([c for row in got for c in row])  # by source rank, then by expert
        by_expert = torch.cat([pieces[s * local + e] for e in range(local) for s in range(n)])
        y = _swiglu_experts(by_expert, [sum(row[e] for row in got) for e in range(local)], gate, up, down)
        outs = y.split([got[s][e] for e in range(local) for s in range(n)])  # by expert, then by source rank
        back = torch.cat([outs[e * n + s] for s in range(n) for e in range(local)])
        return fc.all_to_all_single_autograd(back, send, recv, group)


class _GradScale(torch.autograd.Function):
    """Identity forward; the gradient times `factor` backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def _swiglu_experts(xs: Tensor, counts: list[int], gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    outs = []
    for i, chunk in enumerate(xs.split(counts)):
        h = F.silu(chunk @ gate[i].T) * (chunk @ up[i].T)
        outs.append(h @ down[i].T)
    return torch.cat(outs)


class ExpertParallel(ParallelStyle):
    """The experts of a module split over a mesh (`parallelize_module(model, mesh["ep"],
    {name: ExpertParallel()})`, `GPT.ep_plan`): each of its params a DTensor `Shard(0)`, E/N
    experts per rank (rank 0's values scattered)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

        def split(name: str, mod: nn.Module, mesh: Any) -> None:
            for key, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, split)


class MoE(nn.Module):
    """Routed SwiGLU experts (torchtitan's MoE layer, dropless): the router's softmax scores
    pick each token's `top_k` of `experts`, their weights renormalized over the chosen; the
    token slots are sorted by expert and each expert runs once on its slots (`Experts`, over
    the ranks under expert parallelism); the outputs, weighted, are summed back per token.

    `balance_loss` (after a forward): Switch Transformer's load-balancing term
    E·Σ_e f_e·P_e, f_e the share of token slots routed to expert e, P_e its mean router
    probability (1 when balanced). The expert sizes are read on the host to split the slots
    (one sync per layer: a grouped matmul would avoid it on CUDA)."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(dim, hidden, experts)
        self.balance_loss: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        n, e, k = t.shape[0], self.n_experts, self.top_k
        probs = self.router(t).float().softmax(dim=-1)  # (tokens, experts)
        weight, chosen = probs.topk(k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        slots = chosen.reshape(-1)  # token t's j-th choice at t·k + j
        order = slots.argsort(stable=True)  # the slots by expert
        counts = torch.bincount(slots, minlength=e)
        token = order // k
        y = self.experts(t[token], counts.tolist()) * weight.reshape(-1)[order, None].to(t.dtype)
        self.balance_loss = e * torch.sum(counts.to(probs.dtype) / (n * k) * probs.mean(dim=0))
        return torch.zeros_like(t).index_add_(0, token, y).reshape(shape)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int, experts: int = 0, top_k: int = 2) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp: nn.Module = MoE(dim, hidden, experts, top_k) if experts else SwiGLU(dim, hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer over bytes (vocab 256 by default).

    `forward(input)` maps (B, T) int64 tokens to (B, T, vocab) logits. `blocks` is the
    list FSDP2 shards one by one. With `experts=E` every block's MLP is a mixture of E
    routed SwiGLU experts, each token to `top_k` of them (`MoE`), and `lm_loss` adds
    `balance` x their load-balancing loss.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        mlp_ratio: float = 8 / 3,
        experts: int = 0,
        top_k: int = 2,
        balance: float = 0.01,
    ) -> None:
        super().__init__()
        sizes = dict(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len)
        for name, value in dict(experts=experts, top_k=top_k).items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name}={value!r} must be a whole number >= 0")
        if experts and not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
        if isinstance(balance, bool) or not isinstance(balance, (int, float)) or balance < 0:
            raise ValueError(f"balance={balance!r} must be a number >= 0")
        self.experts, self.balance = int(experts), float(balance)
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}={value!r} must be a whole number >= 1")
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio={mlp_ratio!r} must be a number > 0")
        if dim % n_heads or (dim // n_heads) % 2:
            raise ValueError(f"model.dim={dim} must split into n_heads={n_heads} heads of even size")
        hidden = int(mlp_ratio * dim + 63) // 64 * 64
        if hidden == 0:
            raise ValueError(f"mlp_ratio={mlp_ratio!r} leaves the MLP no hidden unit at dim={dim} (it rounds to 64s)")
        self.vocab_size, self.dim, self.n_layers, self.seq_len = vocab_size, dim, n_layers, seq_len
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, hidden, experts, top_k) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = rope_tables(seq_len, dim // n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
        for block in self.blocks:
            b: Any = block
            nn.init.zeros_(b.attn.proj.weight)
            nn.init.zeros_(b.mlp.experts.down if self.experts else b.mlp.down.weight)

    def forward(self, input: Tensor) -> Tensor:
        x = self.embed(input)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.lm_head(self.norm(x))

    def batch_dims(self) -> dict[str, int]:
        """Per param, its leading dims that index separate matrices (Muon's `batch_dims`): 1
        for the experts' (E, m, n) weights, 0 elsewhere."""
        return {name: int(p.dim() == 3) for name, p in self.named_parameters()}

    def extra_loss(self) -> Tensor | None:
        """`balance` x the last forward's load-balancing losses, summed over the blocks (None without experts)."""
        if not self.experts:
            return None
        losses = [cast(MoE, cast(Block, b).mlp).balance_loss for b in self.blocks]
        return self.balance * torch.stack([x for x in losses if x is not None]).sum()

    def qk_heads(self) -> dict[str, ps.QKHeads]:
        """Each block's W_q and W_k, for `ps.qk_clip`."""
        return {
            f"blocks.{i}.attn": ps.QKHeads(
                q=f"blocks.{i}.attn.q.weight",
                k=f"blocks.{i}.attn.k.weight",
                heads=cast(Attention, cast(Block, b).attn).n_heads,
            )
            for i, b in enumerate(self.blocks)
        }

    def tp_plan(self, degree: int) -> dict[str, Any]:
        """torchtitan's tensor-parallel plan for the blocks, over `degree` ranks: q, k, v and
        the MLP's gate and up split column-wise (by heads, by hidden units), `proj` and `down`
        row-wise (their outputs summed over the ranks); embeddings, norms and the head stay
        whole. For `parallelize_module(model, tp_mesh, plan)`."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if self.experts:
            raise ValueError("tensor parallelism over the experts is not built (the MoE GPT runs on FSDP2)")
        block = cast(Block, self.blocks[0])
        heads, hidden = cast(Attention, block.attn).n_heads, cast(SwiGLU, block.mlp).down.in_features
        if heads % degree or hidden % degree:
            raise ValueError(
                f"tensor parallelism over {degree} ranks splits model.n_heads={heads} heads and the MLP's "
                f"{hidden} hidden units: pick a degree that divides both"
            )
        plan: dict[str, Any] = {}
        for i in range(self.n_layers):
            for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.proj", "mlp.down"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        return plan

    def ep_plan(self, degree: int) -> dict[str, Any]:
        """Expert parallelism over `degree` ranks: every block's experts split by experts
        (`ExpertParallel`, E/degree per rank), the rest untouched. For
        `parallelize_module(model, ep_mesh, plan)`; the Trainer's `ep` (FSDP2 shards the
        experts over the other ranks, everything else over all of them)."""
        if not self.experts:
            raise ValueError("expert parallelism needs a GPT with experts (model.kwargs experts=E)")
        if self.experts % degree:
            raise ValueError(
                f"expert parallelism over {degree} ranks splits the model's {self.experts} experts: "
                "pick a degree that divides them"
            )
        return {f"blocks.{i}.mlp.experts": ExpertParallel() for i in range(self.n_layers)}

    def track_max_logits(self, on: bool = True) -> None:
        """Record each attention head's max pre-softmax logit in every forward (for QK-clip)."""
        for b in self.blocks:
            cast(Attention, cast(Block, b).attn).track_max_logits = on

    def take_max_logits(self) -> dict[str, Tensor]:
        """The max logits recorded since the last take, `{"blocks.{i}.attn": (heads,)}`, and reset."""
        out = {}
        for i, b in enumerate(self.blocks):
            attn = cast(Attention, cast(Block, b).attn)
            if attn.max_logits is not None:
                out[f"blocks.{i}.attn"] = attn.max_logits
            attn.max_logits = None
        return out

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per matmul weight plus attention (PaLM, appendix B)."""
        matmul = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and not n.startswith("embed"))
        return 6.0 * matmul + 12.0 * self.n_layers * self.dim * self.seq_len

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        new_tokens: int,
        *,
        temperature: float = 0.8,
        top_k: int = 20,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Sample `new_tokens` after `prompt` ((T,) int64), returning the (T + new_tokens,) sequence."""
        seq = prompt.clone()
        for _ in range(new_tokens):
            logits = self(seq[-self.seq_len :][None])[0, -1].float() / max(temperature, 1e-5)
            top, idx = logits.topk(min(top_k, logits.numel()))
            choice = torch.multinomial(top.softmax(-1).cpu(), 1, generator=generator).to(idx.device)
            seq = torch.cat([seq, idx[choice]])
        return seq


# Peak dense bf16 FLOP/s of common accelerators, for MFU (per device).
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    """The peak dense bf16 FLOP/s of a known GPU (None elsewhere): MFU's denominator."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_FLOPS.items() if k in name), None)


def lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Summed next-token cross-entropy and the number of tokens it sums over.

    The Trainer divides by the token count of the whole global batch, so gradient
    accumulation and data parallelism weight every token equally.
    """
    logits = model(batch["input"])
    target = batch["target"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum", ignore_index=-100)
    tokens = (target != -100).sum()
    inner: Any = model
    while hasattr(inner, "module") or hasattr(inner, "_orig_mod"):  # DDP, torch.compile
        inner = getattr(inner, "module", None) or inner._orig_mod
    extra_loss = getattr(inner, "extra_loss", None)
    extra = extra_loss() if callable(extra_loss) else None
    if extra is not None:  # a per-batch mean (MoE's balance), weighted by this batch's tokens as the loss is
        loss = loss + extra * tokens
    return loss, tokens


def build_model(section: Any) -> GPT:
    """The GPT the `model` section of a `TrainConfig` describes."""
    if section.name != "gpt":
        raise ConfigError(
            "model.name", f"{section.name!r} is not a model purestep builds ('gpt'); pass model= to the Trainer"
        )
    if section.vocab_size < 256:
        raise ConfigError("model.vocab_size", f"{section.vocab_size} is too small for byte tokens (needs 256)")
    if section.dropout:
        raise ConfigError("model.dropout", "the GPT has no dropout; set it to 0")
    takes = [n for n in inspect.signature(GPT).parameters if n not in _SECTION_FIELDS.values()]
    for arg in section.kwargs:
        if arg not in takes:
            field = next((f"model.{f}" for f, a in _SECTION_FIELDS.items() if a == arg), None)
            why = f"set it as {field}" if field else "the GPT takes no such argument"
            raise ConfigError(f"model.kwargs.{arg}", f"{why} (model.kwargs may set {takes})")
    try:
        return GPT(
            vocab_size=section.vocab_size,
            dim=section.n_embd,
            n_layers=section.n_layer,
            n_heads=section.n_head,
            seq_len=section.block_size,
            **section.kwargs,
        )
    except (TypeError, ValueError, RuntimeError) as e:  # RuntimeError: a size no tensor can take
        message = " ".join(str(e).split())
        # The field the message names first: a kwarg, or a section field under GPT's name for it.
        named = [(message.find(f"{a}="), f"model.kwargs.{a}") for a in section.kwargs]
        named += [(message.find(f"{arg}="), f"model.{field}") for field, arg in _SECTION_FIELDS.items()]
        found = sorted((at, field) for at, field in named if at >= 0)
        raise ConfigError(found[0][1] if found else "model", message) from None


# The model section's fields, by the GPT argument each one sets.
_SECTION_FIELDS = {"vocab_size": "vocab_size", "n_embd": "dim", "n_layer": "n_layers", "n_head": "n_heads",
                   "block_size": "seq_len"}  # fmt: skip
