"""Expert parallelism's token dispatch on real ranks (torchrun): each rank routes its own
tokens with top-2 of 4 experts (uneven splits, experts with no token from some rank), the
experts split over every rank (ep = world, no FSDP2); the output equals the same layer with
whole experts on this rank's tokens, and each rank's expert grads equal the whole layer's
grads averaged over the ranks (the mean data parallelism expects)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

from purestep.api.models import MoE, ExpertParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = MoE(dim=8, hidden=16, experts=4, top_k=2)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    split = copy.deepcopy(whole)
    from torch.distributed.device_mesh import init_device_mesh

    parallelize_module(split, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), {"experts": ExpertParallel()})
    torch.manual_seed(1 + rank)
    x = torch.randn(5 + 3 * rank, 8)  # a different number of tokens per rank
    y_whole, y_split = whole(x), split(x)
    torch.testing.assert_close(y_split, y_whole, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(y_whole)
    (y_whole * w).sum().backward()
    (y_split * w).sum().backward()
    local = 4 // world
    for name in ("gate", "up", "down"):
        g = getattr(whole.experts, name).grad
        dist.all_reduce(g)  # the whole layer's grads, summed over the ranks' tokens
        mine = getattr(split.experts, name).grad.to_local()
        torch.testing.assert_close(mine, g[rank * local : (rank + 1) * local] / world, rtol=1e-5, atol=1e-6)
    counts = torch.bincount(whole.router(x).softmax(-1).topk(2, dim=-1).indices.reshape(-1), minlength=4)
    print(f"rank {rank} ok, slots per expert {counts.tolist()}", flush=True)
    dist.barrier()  # no rank leaves while another still talks to it (gloo aborts at exit otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
