"""A replica group of one process for tests/api/test_torchft.py: `ps.diloco` over torchft's
`Manager` (`purestep.api.TorchFT`), gloo on the CPU, against a lighthouse the test runs.

`python tests/api/_torchft_worker.py REPLICA LIGHTHOUSE OUTDIR LIFE`

The plan (the test's driver restarts group 1): syncs every H = 3 calls; group 1's first life
dies after its call 5, so group 0 syncs alone at call 6; group 1 comes back and, at its first
quorum (group 0's sync at call 9, which waits for it to be up), heals from group 0 and syncs
with it from there on. Group 0 waits for group 1 to ask for that quorum first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

import purestep.core as ps

H, STEPS, DIES_AFTER, ALONE_AT, BACK_AT = 3, 12, 5, 6, 9


def init_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3, generator=g, dtype=torch.float64),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
    }


def grads_at(params: dict[str, torch.Tensor], replica: int, call: int) -> dict[str, torch.Tensor]:
    """The grads of group `replica`'s batch of call `call` (its own data) at `params`."""
    g = torch.Generator().manual_seed(1000 * replica + call)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
    w, b = (params[k].detach().requires_grad_() for k in ("w", "b"))
    loss = ((x @ w + b - y) ** 2).mean()
    gw, gb = torch.autograd.grad(loss, (w, b))
    return {"w": gw, "b": gb}


def inner_outer() -> tuple[ps.Transform, ps.Transform]:
    return ps.adamw(0.05, weight_decay=0.01), ps.sgd(0.7, momentum=0.9, nesterov=True)


def make_manager(lighthouse: str, replica_id: str, store_port: int) -> Any:
    """A one-process replica group's torchft `Manager` on gloo (its TCPStore at `store_port`,
    which the caller keeps alive), for DiLoCo: synchronous quorum, no initial sync (every
    group starts from the same params), timeouts a loaded CI machine meets."""
    from torchft import Manager, ProcessGroupGloo

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        init_sync=False,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=40),
        connect_timeout=timedelta(seconds=20),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        hostname="127.0.0.1",
    )


def main(replica: int, lighthouse: str, out: Path, life: int) -> None:
    from torch.distributed import TCPStore

    from purestep.api import TorchFT

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = make_manager(lighthouse, f"replica_{replica}", store.port)
    ft = TorchFT(manager)
    opt = ft.diloco(*inner_outer(), H)
    params = init_params()
    state = opt.init(params)
    update = ps.make_update(opt, donate=True)
    ft.keep("train", params, state)

    def mark(name: str) -> None:
        (out / name).touch()

    def wait_for(name: str) -> None:
        while not (out / name).exists():
            time.sleep(0.02)

    if life == 0:  # both groups in the first quorum
        mark(f"ready{replica}")
        wait_for("ready0"), wait_for("ready1")
    syncs = []
    while int(state.count) < STEPS:
        if replica == 0 and int(state.count) + 1 == BACK_AT:
            # Group 1 asks for its first quorum: this one. (The lighthouse forms a quorum at once
            # when every member of the last one asks, so group 1 must ask first.)
            wait_for("joining")
            time.sleep(1.0)
        if replica == 1 and life == 1 and int(state.count) + 1 == H:
            mark("joining")
        synced = ft.begin(state)
        call = int(state.count) + 1  # after a heal, the live group's count
        update(params, grads_at(params, replica, call), state)
        if synced:
            syncs.append((call, manager.num_participants()))
        if replica == 1 and life == 0 and call == DIES_AFTER:
            os._exit(17)
        if replica == 0 and call == ALONE_AT:
            mark("alone")
    result = {
        "syncs": syncs,
        "params": {k: v.tolist() for k, v in params.items()},
        "anchor": {k: v.tolist() for k, v in state.anchor.items()},
    }
    (out / f"result{replica}.json").write_text(json.dumps(result))
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum logs
    torch.set_num_threads(1)
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
