"""`ps.diloco` over torchft (meta-pytorch/torchft) on the CPU with gloo: replica groups that
die and come back (`purestep.api.TorchFT`), and the adapter as torchft's own DiLoCo's inner
and outer optimizer, against torchft's DiLoCo over torch.optim."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import purestep.core as ps

from . import _torchft_worker as W

os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum logs (read when torchft loads)
torchft = pytest.importorskip("torchft")


def _lighthouse(**kwargs):
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, **kwargs)
    return server, f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"


def test_a_replica_group_that_dies_and_comes_back_heals_from_the_live_one_and_both_follow_diloco(tmp_path):
    """Two replica groups (one process each) run `ps.diloco` (AdamW inside, Nesterov outside,
    a sync every 3 calls) with torchft's Manager as its reduce and its vote. Group 1 dies
    after call 5; group 0 syncs alone at call 6 and trains on; group 1 comes back from its
    initial params, heals from group 0 at its first quorum (group 0's sync at call 9), and
    both sync together to the end. Each group's params and anchor equal a replay of the
    algorithm in one process with the same participants (float64)."""
    server, address = _lighthouse(join_timeout_ms=20000, quorum_tick_ms=20, heartbeat_timeout_ms=300)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    script = str(Path(__file__).with_name("_torchft_worker.py"))

    def start(replica: int, life: int) -> subprocess.Popen:
        cmd = [sys.executable, script, str(replica), address, str(tmp_path), str(life)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    try:
        first = [start(0, 0), start(1, 0)]
        assert first[1].wait(timeout=120) == 17, first[1].communicate()[0][-3000:]
        deadline = time.time() + 120
        while not (tmp_path / "alone").exists():  # group 0 synced without group 1
            assert time.time() < deadline and first[0].poll() is None, first[0].communicate()[0][-3000:]
            time.sleep(0.05)
        back = start(1, 1)
        for proc in (first[0], back):
            assert proc.wait(timeout=120) == 0, proc.communicate()[0][-3000:]
    finally:
        for proc in [*first, *([back] if "back" in locals() else [])]:
            if proc.poll() is None:
                proc.kill()
        server.shutdown()
    got = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert [tuple(x) for x in got[0]["syncs"]] == [(3, 2), (6, 1), (9, 2), (12, 2)], got[0]["syncs"]
    assert [tuple(x) for x in got[1]["syncs"]] == [(9, 2), (12, 2)], got[1]["syncs"]

    # The replay: the same transform, its reduce the mean over the participants' pseudo-gradients.
    class Exchange:
        mean = None

        def __call__(self, tree):
            if self.mean is None:  # a dry run: what this worker would send
                self.sent = tree
                return tree
            return self.mean

    exchange = Exchange()
    opt = ps.diloco(*W.inner_outer(), W.H, exchange)
    workers = {r: (W.init_params(), opt.init(W.init_params())) for r in (0, 1)}
    participants = dict(tuple(x) for x in got[0]["syncs"])
    for call in range(1, W.STEPS + 1):
        if call == W.BACK_AT:  # healed: group 0's params and state as they are before this call
            workers[1] = copy.deepcopy(workers[0])
        alive = [0, 1] if call <= 3 or call >= W.BACK_AT else [0]
        grads = {r: W.grads_at(workers[r][0], r, call) for r in alive}
        if call in participants:
            assert participants[call] == len(alive)
            sent = []
            for r in alive:
                exchange.mean = None
                opt.update(grads[r], workers[r][1], workers[r][0])
                sent.append(exchange.sent)
            exchange.mean = ps.tree_map(lambda *xs: sum(xs) / len(xs), *sent)
        for r in alive:
            updates, state = opt.update(grads[r], workers[r][1], workers[r][0])
            workers[r] = (ps.apply_updates(workers[r][0], updates), state)
    for r in (0, 1):
        params, state = workers[0]  # both groups end on the same point: group 0's
        for k in params:
            torch.testing.assert_close(
                torch.tensor(got[r]["params"][k], dtype=torch.float64), params[k], rtol=0, atol=1e-12
            )
            torch.testing.assert_close(
                torch.tensor(got[r]["anchor"][k], dtype=torch.float64), state.anchor[k], rtol=0, atol=1e-12
            )
    assert not torch.allclose(workers[0][0]["w"], W.init_params()["w"])


def _manager(address: str, name: str, stores: list):
    """A one-process replica group's manager; its store is kept alive in `stores`."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores.append(store)
    return W.make_manager(address, name, store.port)


class _Fragment(torch.nn.Module):
    def __init__(self, name: str, value: torch.Tensor) -> None:
        super().__init__()
        self.register_parameter(name, torch.nn.Parameter(value))


class _Linear(torch.nn.Module):
    """`W.init_params()` as a module of two fragments (torchft's streaming syncs modules):
    `w` then `b`, the leaves `ps.diloco(fragments=2)` cuts the same params into."""

    def __init__(self) -> None:
        super().__init__()
        p = W.init_params()
        self.fw, self.fb = _Fragment("w", p["w"]), _Fragment("b", p["b"])

    def params(self) -> dict[str, torch.Tensor]:
        return {"w": self.fw.w, "b": self.fb.b}


@pytest.mark.parametrize(
    "sync_every, streaming",
    [(3, {}), (4, {"fragments": 2, "delay": 1, "alpha": 0.5})],
    ids=["diloco", "streaming"],
)
def test_the_adapter_runs_as_torchfts_optimizers_and_ps_diloco_over_torchft_equals_torchfts_diloco(
    sync_every, streaming
):
    """torchft's own DiLoCo (hooks on the inner optimizer, the pseudo-gradient written into
    `.grad`, `outer.step()`) with `purestep.api.Optimizer` as both optimizers, and `ps.diloco`
    through `TorchFT`, against torchft's DiLoCo over torch.optim's AdamW and Nesterov SGD: one
    replica group, 3 rounds of H calls, the same params (float64). Streaming: 2 fragments, the
    exchange a call before the outer step, alpha 0.5 (torchft's `fragment_sync_delay`,
    `fragment_update_alpha`), where `TorchFT` keeps the quorum open from exchange to vote."""
    from torchft.local_sgd import DiLoCo

    from purestep.api import Optimizer, TorchFT

    server, address = _lighthouse(join_timeout_ms=100, quorum_tick_ms=10, heartbeat_timeout_ms=1000)
    calls, fragments = 3 * sync_every, streaming.get("fragments", 1)
    syncs = 3 * fragments  # each fragment once per round: one manager step each
    options = {"fragment_sync_delay": streaming.get("delay", 0), "fragment_update_alpha": streaming.get("alpha", 0.0)}
    ends, stores = {}, []
    try:
        for run in ("torch.optim", "adapter"):
            manager, model = _manager(address, run, stores), _Linear()
            parts = [model.fw, model.fb] if fragments > 1 else [model]
            if run == "torch.optim":
                inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
                outer = [torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True) for m in parts]
            else:
                inner = Optimizer(model.named_parameters(), ps.adamw, lr=0.05, weight_decay=0.01)
                outer = [Optimizer(m.named_parameters(), ps.sgd, lr=0.7, momentum=0.9, nesterov=True) for m in parts]
            cpu = torch.device("cpu")
            with DiLoCo(manager, parts, inner, outer, sync_every, backup_device=cpu, pin_memory=False, **options):
                for call in range(1, calls + 1):
                    inner.zero_grad()
                    grads = W.grads_at(model.params(), 0, call)
                    model.fw.w.grad, model.fb.b.grad = grads["w"], grads["b"]
                    inner.step()
            assert manager.current_step() == syncs  # every sync committed
            if run == "adapter":  # its state dict is torch's: a group healing from it loads it as such
                saved = outer[0].state_dict()
                torch.optim.SGD(parts[0].parameters(), lr=0.7, momentum=0.9, nesterov=True).load_state_dict(saved)
            ends[run] = {k: v.detach().clone() for k, v in model.params().items()}
            manager.shutdown(wait=False)
        manager = _manager(address, "functional", stores)
        ft = TorchFT(manager)
        opt = ft.diloco(*W.inner_outer(), sync_every, **streaming)
        params = W.init_params()
        state = opt.init(params)
        update = ps.make_update(opt, donate=True)
        for call in range(1, calls + 1):
            ft.begin(state)
            update(params, W.grads_at(params, 0, call), state)
        assert manager.current_step() == syncs
        ends["ps.diloco"] = params
        manager.shutdown(wait=False)
    finally:
        server.shutdown()
    start = W.init_params()
    assert not torch.allclose(ends["torch.optim"]["w"], start["w"])
    for run in ("adapter", "ps.diloco"):
        for k in start:
            torch.testing.assert_close(ends[run][k], ends["torch.optim"][k], rtol=0, atol=1e-12, msg=f"{run} {k}")
