"""`ps.diloco` against the algorithm written per tensor with torch.optim's AdamW (inner) and
SGD (outer), on several workers in one process (threads, a mean over them as `reduce`), and
compiled and donated against eager, with no recompile and no collective between syncs."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
import torch.distributed as dist

import purestep.core as ps

SHAPES = {"w": (4, 3), "b": (3,)}


def _data(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


def _loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x @ p["w"] + p["b"] - y) ** 2).mean()


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}


class _ThreadMean:
    """An all-reduce mean over worker threads: `reduce_for(k)` is worker k's `reduce`. Every
    worker sums the same trees in the same order, so all get the same bits."""

    def __init__(self, workers: int) -> None:
        self.workers, self.barrier = workers, threading.Barrier(workers)
        self.slots: list = [None] * workers
        self.calls = [0] * workers

    def reduce_for(self, k: int):
        def reduce(tree):
            self.calls[k] += 1
            self.slots[k] = tree
            self.barrier.wait()
            mean = ps.tree_map(lambda *xs: sum(xs[1:], xs[0]) / self.workers, *self.slots)
            self.barrier.wait()
            return mean

        return reduce


def _reference(workers: int, steps: int, sync_every: int) -> tuple[list[dict], dict]:
    """DiLoCo per tensor: each worker an AdamW of torch.optim on its data; every H steps the
    anchor takes torch.optim.SGD's Nesterov step along mean(anchor - θ_k) and every worker
    restarts from it (the inner AdamW state kept)."""
    anchor = {k: v.clone() for k, v in _params().items()}
    local = [{k: v.clone().requires_grad_() for k, v in anchor.items()} for _ in range(workers)]
    inner = [torch.optim.AdamW(p.values(), lr=0.05, weight_decay=0.1) for p in local]
    global_params = {k: v.clone().requires_grad_() for k, v in anchor.items()}
    outer = torch.optim.SGD(global_params.values(), lr=0.7, momentum=0.9, nesterov=True)
    for t in range(1, steps + 1):
        for k in range(workers):
            inner[k].zero_grad()
            _loss(local[k], *_data(k, t)).backward()
            inner[k].step()
        if t % sync_every == 0:
            with torch.no_grad():
                for name, gp in global_params.items():
                    gp.grad = sum(gp.detach() - local[k][name].detach() for k in range(workers)) / workers
                outer.step()
                for k in range(workers):
                    for name, gp in global_params.items():
                        local[k][name].copy_(gp)
    return [{k: v.detach() for k, v in p.items()} for p in local], {k: v.detach() for k, v in global_params.items()}


def test_diloco_on_three_workers_equals_the_per_tensor_algorithm_with_torch_optim():
    workers, steps, sync_every = 3, 11, 4  # syncs at 4 and 8; 3 local steps after the last
    mean = _ThreadMean(workers)
    results: list = [None] * workers

    def work(k: int) -> None:
        opt = ps.diloco(
            ps.adamw(0.05, weight_decay=0.1),
            ps.sgd(0.7, momentum=0.9, nesterov=True),
            sync_every,
            reduce=mean.reduce_for(k),
        )
        params = _params()
        state = opt.init(params)
        update = ps.make_update(opt)
        for t in range(1, steps + 1):
            grads = torch.func.grad(_loss)(params, *_data(k, t))
            params, state = update(params, grads, state)
        results[k] = (params, state)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ref_local, ref_global = _reference(workers, steps, sync_every)
    assert mean.calls == [2] * workers  # one reduce per sync, none between
    anchors = [r[1].anchor for r in results]
    for name in SHAPES:
        torch.testing.assert_close(anchors[0][name], ref_global[name], rtol=1e-12, atol=1e-12)
        assert all(torch.equal(a[name], anchors[0][name]) for a in anchors)  # the same bits on every worker
        for k in range(workers):
            torch.testing.assert_close(results[k][0][name], ref_local[k][name], rtol=1e-12, atol=1e-12)
    assert int(results[0][1].count) == steps


def _streaming_reference(workers: int, steps: int, sync_every: int, fragments: list[list[str]], delay: int, alpha: float):
    """Streaming DiLoCo per tensor, as torchft's `DiLoCo` runs it: a local step counter;
    at H/F - τ the next fragment's pseudo-gradient (backup - θ) is averaged over the workers,
    at H/F its params are restored to the backup, torch.optim.SGD (one optimizer, grads set
    on that fragment only) steps them, the backup takes them, and the params become
    lerp(global, θ at that step, α)."""
    period, F = sync_every // len(fragments), len(fragments)
    backup = {k: v.clone() for k, v in _params().items()}
    local = [{k: v.clone().requires_grad_() for k, v in backup.items()} for _ in range(workers)]
    inner = [torch.optim.AdamW(p.values(), lr=0.05, weight_decay=0.1) for p in local]
    global_params = {k: v.clone().requires_grad_() for k, v in backup.items()}
    outer = torch.optim.SGD(global_params.values(), lr=0.7, momentum=0.9, nesterov=True)
    local_step, syncs, averaged = 0, 0, {}
    for t in range(1, steps + 1):
        for k in range(workers):
            inner[k].zero_grad()
            _loss(local[k], *_data(k, t)).backward()
            inner[k].step()
        local_step += 1
        frag = fragments[syncs % F]
        with torch.no_grad():
            if local_step == period - delay:
                averaged = {n: sum(backup[n] - local[k][n].detach() for k in range(workers)) / workers for n in frag}
            if local_step == period:
                outer.zero_grad(set_to_none=True)
                for n in frag:
                    global_params[n].copy_(backup[n])
                    global_params[n].grad = averaged[n].clone()
                outer.step()
                for n in frag:
                    backup[n] = global_params[n].detach().clone()
                    for k in range(workers):
                        local[k][n].copy_(torch.lerp(backup[n], local[k][n].detach(), alpha))
                local_step, syncs = 0, syncs + 1
    return [{k: v.detach() for k, v in p.items()} for p in local], backup


def _run_workers(workers: int, steps: int, make) -> tuple[list, _ThreadMean]:
    mean = _ThreadMean(workers)
    results: list = [None] * workers

    def work(k: int) -> None:
        opt = make(mean.reduce_for(k))
        params = _params()
        state = opt.init(params)
        update = ps.make_update(opt)
        for t in range(1, steps + 1):
            grads = torch.func.grad(_loss)(params, *_data(k, t))
            params, state = update(params, grads, state)
        results[k] = (params, state)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, mean


@pytest.mark.parametrize("delay,alpha", [(0, 0.0), (1, 0.5), (1, 0.0)])
def test_streaming_diloco_equals_torchfts_algorithm_per_tensor(delay, alpha):
    """Two fragments (w: 12 elements, b: 3: w alone is past half), H = 4: w syncs at calls
    2, 6, 10, b at 4, 8; each pseudo-gradient averaged `delay` calls before its outer step."""
    workers, steps, sync_every = 2, 11, 4

    def make(reduce):
        outer = ps.sgd(0.7, momentum=0.9, nesterov=True)
        inner = ps.adamw(0.05, weight_decay=0.1)
        return ps.diloco(inner, outer, sync_every, reduce, fragments=2, delay=delay, alpha=alpha)

    results, mean = _run_workers(workers, steps, make)
    ref_local, ref_global = _streaming_reference(workers, steps, sync_every, [["w"], ["b"]], delay, alpha)
    # one reduce per fragment sync (w at 2, 6, 10, b at 4, 8); with a delay, b's third (for 12) is taken at 11
    assert mean.calls == [5 if delay == 0 else 6] * workers
    for name in SHAPES:
        torch.testing.assert_close(results[0][1].anchor[name], ref_global[name], rtol=1e-12, atol=1e-12)
        for k in range(workers):
            torch.testing.assert_close(results[k][0][name], ref_local[k][name], rtol=1e-12, atol=1e-12, msg=name)
    assert isinstance(results[0][1].outer_state, tuple) and len(results[0][1].outer_state) == 2


def test_streaming_arguments_are_checked_by_name():
    inner, outer = ps.sgd(0.1), ps.sgd(1.0)
    with pytest.raises(ValueError, match="fragments must divide sync_every"):
        ps.diloco(inner, outer, 6, fragments=4)
    with pytest.raises(ValueError, match="delay"):
        ps.diloco(inner, outer, 6, fragments=2, delay=3)
    with pytest.raises(ValueError, match="alpha"):
        ps.diloco(inner, outer, 6, alpha=1.5)
    opt = ps.diloco(inner, outer, 6, fragments=3)
    with pytest.raises(ValueError, match="fragments=3 is more than the 2 leaves"):
        opt.init(_params())


def test_a_sync_puts_the_params_on_the_new_anchor_and_plain_averaging_is_local_sgd():
    """With outer = sgd(1.0) and one worker, a sync is the identity: θ is the anchor; with
    two workers it is the average of their params."""
    opt = ps.diloco(ps.sgd(0.1, momentum=0.9), ps.sgd(1.0), sync_every=2)
    params = _params()
    state = opt.init(params)
    update = ps.make_update(opt)
    inner_only, inner_state = {k: v.clone() for k, v in params.items()}, ps.sgd(0.1, momentum=0.9).init(params)
    for t in range(1, 5):
        grads = torch.func.grad(_loss)(params, *_data(0, t))
        params, state = update(params, grads, state)
        u, inner_state = ps.sgd(0.1, momentum=0.9).update(grads, inner_state, inner_only)
        inner_only = ps.apply_updates(inner_only, u)
        for name in SHAPES:
            torch.testing.assert_close(params[name], inner_only[name], rtol=1e-14, atol=1e-14)
            if t % 2 == 0:
                torch.testing.assert_close(state.anchor[name], params[name], rtol=1e-14, atol=1e-14)


def test_diloco_refuses_bad_arguments_by_name():
    with pytest.raises(ValueError, match="sync_every"):
        ps.diloco(ps.sgd(0.1), ps.sgd(1.0), 0)
    with pytest.raises(ValueError, match="reduce"):
        ps.diloco(ps.sgd(0.1), ps.sgd(1.0), 2, reduce="mean")
    opt = ps.diloco(ps.sgd(0.1), ps.sgd(1.0), 2)
    with pytest.raises(ValueError, match="needs params"):
        opt.update({"w": torch.ones(2)}, opt.init({"w": torch.ones(2)}))


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, in this process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _all_reduce_mean(tree):
    import torch.distributed._functional_collectives as fc

    world = dist.get_world_size()
    return ps.tree_map(lambda x: fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD)) / world, tree)


def _collectives(fn) -> int:
    """How many all_reduce kernels `fn()` runs (the profiler's count)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if "all_reduce" in e.key and "wait" not in e.key)


@pytest.mark.parametrize(
    "options,syncs",
    [
        ({}, [False, True, False, False, True, False]),  # H = 3: a sync at calls 3 and 6
        # three fragments of H = 6, each averaged a call early: at calls 3, 5, 7 (and 1: compiling)
        ({"fragments": 3, "delay": 1, "alpha": 0.5}, [False, True, False, True, False, True]),
    ],
)
def test_compiled_donated_diloco_equals_eager_without_recompiles_and_communicates_only_at_syncs(
    one_rank_group, options, syncs
):
    """MuLoCo's recipe in small (Muon inner, Nesterov outer), plain and streaming, through
    make_update(compile=True, donate=True) with a real collective as `reduce`: the same params
    as eager, one graph, an all_reduce on sync calls only."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 8, generator=g), "w2": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g)}
    inner, outer = ps.muon_adamw(0.02, adamw_lr=0.01), ps.sgd(0.7, momentum=0.9, nesterov=True)
    opt = ps.diloco(inner, outer, 6 if options else 3, _all_reduce_mean, **options)
    compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    counts = []
    for i in range(7):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        with torch.compiler.set_stance("fail_on_recompile" if i >= 2 else "default"):
            counts.append(_collectives(lambda: compiled(p, grads, s)))
        p_ref, s_ref = eager(p_ref, grads, s_ref)
    assert compiled.explain().startswith("flat"), compiled.explain()
    assert [c > 0 for c in counts[1:]] == syncs, counts  # (the first call compiles: tracing dispatches it too)
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(s.anchor[k], s_ref.anchor[k], rtol=1e-5, atol=1e-6, msg=k)
