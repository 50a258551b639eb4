"""`ps.diloco` against the algorithm written per tensor with torch.optim's AdamW (inner) and
SGD (outer), on several workers in one process (threads, a mean over them as `reduce`), and
compiled and donated against eager, with no recompile and no collective between syncs."""

from __future__ import annotations

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


class _ThreadGather(_ThreadMean):
    def reduce_for(self, k: int):
        def gather(tree):
            self.calls[k] += 1
            self.slots[k] = tree
            self.barrier.wait()
            out = ps.tree_map(lambda *xs: torch.stack(xs), *self.slots)
            self.barrier.wait()
            return out

        return gather


def _run_workers(workers: int, steps: int, make, exchange: type) -> tuple[list, _ThreadMean]:
    """Each worker a thread running `make(its exchange function)` on its own data."""
    mean = exchange(workers)
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

    def make(reduce):
        return ps.diloco(ps.adamw(0.05, weight_decay=0.1), ps.sgd(0.7, momentum=0.9, nesterov=True), sync_every, reduce)

    results, mean = _run_workers(workers, steps, make, _ThreadMean)
    ref_local, ref_global = _reference(workers, steps, sync_every)
    assert mean.calls == [2] * workers  # one reduce per sync, none between
    anchors = [r[1].anchor for r in results]
    for name in SHAPES:
        torch.testing.assert_close(anchors[0][name], ref_global[name], rtol=1e-12, atol=1e-12)
        assert all(torch.equal(a[name], anchors[0][name]) for a in anchors)  # the same bits on every worker
        for k in range(workers):
            torch.testing.assert_close(results[k][0][name], ref_local[k][name], rtol=1e-12, atol=1e-12)
    assert int(results[0][1].count) == steps


def _streaming_reference(
    workers: int, steps: int, sync_every: int, fragments: list[list[str]], delay: int, alpha: float
):
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


@pytest.mark.parametrize("delay,alpha", [(0, 0.0), (1, 0.5), (1, 0.0)])
def test_streaming_diloco_equals_torchfts_algorithm_per_tensor(delay, alpha):
    """Two fragments (w: 12 elements, b: 3: w alone is past half), H = 4: w syncs at calls
    2, 6, 10, b at 4, 8; each pseudo-gradient averaged `delay` calls before its outer step."""
    workers, steps, sync_every = 2, 11, 4

    def make(reduce):
        outer = ps.sgd(0.7, momentum=0.9, nesterov=True)
        inner = ps.adamw(0.05, weight_decay=0.1)
        return ps.diloco(inner, outer, sync_every, reduce, fragments=2, delay=delay, alpha=alpha)

    results, mean = _run_workers(workers, steps, make, _ThreadMean)
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


def _tiles_of(x: torch.Tensor, chunk: int) -> list[tuple]:
    """The tiles of `x` as index tuples (each dim of the 2-D view cut by its largest divisor <= chunk)."""
    m = x.view(1, -1) if x.dim() == 1 else x.reshape(x.shape[0], -1)
    tr = max(d for d in range(1, min(m.shape[0], chunk) + 1) if m.shape[0] % d == 0)
    tc = max(d for d in range(1, min(m.shape[1], chunk) + 1) if m.shape[1] % d == 0)
    return [(slice(i, i + tr), slice(j, j + tc)) for i in range(0, m.shape[0], tr) for j in range(0, m.shape[1], tc)]


def _sparseloco_send(e: torch.Tensor, chunk: int, density: float, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseLoCo's message of one tensor, written out: per tile the entries largest in
    magnitude, then all kept values of the tensor quantized together (centred on their mean,
    levels 6σ/2^bits apart, each code the mean of its values). Returns (dense message, mask)."""
    m = e.view(1, -1) if e.dim() == 1 else e.reshape(e.shape[0], -1)
    mask = torch.zeros_like(m, dtype=torch.bool)
    for tile in _tiles_of(e, chunk):
        block = m[tile]
        k = max(1, round(block.numel() * density))
        order = sorted(range(block.numel()), key=lambda i: -abs(float(block.reshape(-1)[i])))[:k]
        sub = torch.zeros(block.numel(), dtype=torch.bool)
        sub[order] = True
        mask[tile] = sub.view(block.shape)
    kept = m[mask]
    bins = 2**bits
    centred = kept - kept.mean()
    scale = 6.0 * centred.std() / bins
    codes = torch.clamp(torch.round(centred / scale + bins // 2), 0, bins - 1)
    decoded = torch.zeros_like(kept)
    for b in range(bins):
        if (codes == b).any():
            decoded[codes == b] = centred[codes == b].mean() + kept.mean()
    out = torch.zeros_like(m)
    out[mask] = decoded
    return out.view(e.shape), mask.view(e.shape)


def _sparseloco_reference(workers: int, steps: int, sync_every: int, chunk: int, density: float):
    """SparseLoCo per tensor (Sarfi et al. 2025): e ← 0.95·e + Δ; the message is e's top-k per
    tile, 2-bit quantized; e ← e − message; the mean per entry over the workers that sent it
    is the grad of torch.optim.SGD(lr=1) on the anchor; every worker restarts from it."""
    anchor = {k: v.clone() for k, v in _params().items()}
    local = [{k: v.clone().requires_grad_() for k, v in anchor.items()} for _ in range(workers)]
    inner = [torch.optim.AdamW(p.values(), lr=0.05, weight_decay=0.1) for p in local]
    error = [{k: torch.zeros_like(v) for k, v in anchor.items()} for _ in range(workers)]
    global_params = {k: v.clone().requires_grad_() for k, v in anchor.items()}
    outer = torch.optim.SGD(global_params.values(), lr=1.0)
    for t in range(1, steps + 1):
        for k in range(workers):
            inner[k].zero_grad()
            _loss(local[k], *_data(k, t)).backward()
            inner[k].step()
        if t % sync_every:
            continue
        with torch.no_grad():
            for name, gp in global_params.items():
                total, count = torch.zeros_like(gp), torch.zeros_like(gp)
                for k in range(workers):
                    error[k][name] = 0.95 * error[k][name] + (gp.detach() - local[k][name].detach())
                    sent, mask = _sparseloco_send(error[k][name], chunk, density, 2)
                    error[k][name] = error[k][name] - sent
                    total, count = total + sent, count + mask
                gp.grad = total / count.clamp(min=1)
            outer.step()
            for k in range(workers):
                for name, gp in global_params.items():
                    local[k][name].copy_(gp)
    return [{k: v.detach() for k, v in p.items()} for p in local], error


def test_sparseloco_equals_its_algorithm_per_tensor_on_three_workers():
    """w (4, 3) in 2 x 3 tiles, 4 of 6 kept; b (3,) in one tile of 3, 2 kept; 2-bit values."""
    workers, steps, sync_every, chunk, density = 3, 8, 2, 3, 0.67

    def make(gather):
        compression = ps.TopK(density=density, chunk=chunk, bits=2, error_decay=0.95)
        return ps.diloco(
            ps.adamw(0.05, weight_decay=0.1), ps.sgd(1.0), sync_every, compression=compression, gather=gather
        )

    results, exchange = _run_workers(workers, steps, make, _ThreadGather)
    ref_local, ref_error = _sparseloco_reference(workers, steps, sync_every, chunk, density)
    assert exchange.calls == [4] * workers
    for name in SHAPES:
        for k in range(workers):
            torch.testing.assert_close(results[k][0][name], ref_local[k][name], rtol=1e-10, atol=1e-12, msg=name)
            torch.testing.assert_close(results[k][1].error[name], ref_error[k][name], rtol=1e-10, atol=1e-12, msg=name)
    assert all(bool(r[1].error[n].abs().sum() > 0) for r in results for n in SHAPES)  # something was held back


def test_topk_payload_is_small_and_decodes_to_at_most_four_values():
    c = ps.TopK(density=0.03125, chunk=64, bits=2)
    x = torch.randn(128, 192, dtype=torch.float64)
    idx, codes, table = c.compress(x)
    assert idx.shape == (6, 128) and idx.dtype == torch.int32 and codes.dtype == torch.uint8 and table.shape == (4,)
    dense = c.decompress((idx, codes, table), x)
    assert (dense != 0).sum() == 6 * 128 and len(set(dense[dense != 0].tolist())) <= 4
    kept = dense != 0
    assert x[kept].abs().min() >= x.abs().quantile(0.9)  # the largest entries of their tiles
    with pytest.raises(ValueError, match="density"):
        ps.TopK(density=0)
    with pytest.raises(ValueError, match="gather"):
        ps.diloco(ps.sgd(0.1), ps.sgd(1.0), 2, gather=lambda t: t)


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


def _all_reduce_mean(tree):
    import torch.distributed._functional_collectives as fc

    world = dist.get_world_size()
    return ps.tree_map(lambda x: fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD)) / world, tree)


def _all_gather(tree):
    import torch.distributed._functional_collectives as fc

    return ps.tree_map(lambda x: fc.wait_tensor(fc.all_gather_tensor(x.unsqueeze(0), 0, dist.group.WORLD)), tree)


def _collectives(fn) -> int:
    """How many all_reduce / all_gather kernels `fn()` runs (the profiler's count)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = ("all_reduce", "all_gather")
    return sum(e.count for e in prof.key_averages() if any(n in e.key for n in names) and "wait" not in e.key)


@pytest.mark.parametrize(
    "options,syncs",
    [
        ({}, [False, True, False, False, True, False]),  # H = 3: a sync at calls 3 and 6
        # three fragments of H = 6, each averaged a call early: at calls 3, 5, 7 (and 1: compiling)
        # three fragments of H = 6 compressed (SparseLoCo), each gathered a call early: at calls 3, 5, 7 (and 1)
        (
            {"fragments": 3, "delay": 1, "alpha": 0.5, "compression": ps.TopK(density=0.25, chunk=4)},
            [False, True, False, True, False, True],
        ),
    ],
)
def test_compiled_donated_diloco_equals_eager_without_recompiles_and_communicates_only_at_syncs(
    one_rank_group, options, syncs
):
    """MuLoCo's recipe in small (Muon inner, Nesterov outer), plain and streaming with SparseLoCo, through
    make_update(compile=True, donate=True) with a real collective as `reduce`: the same params
    as eager, two programs at most (the quiet calls', the syncs'), each compiled once, an
    all_reduce on sync calls only."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(8, 8, generator=g),
        "w2": torch.randn(8, 8, generator=g),
        "b": torch.randn(8, generator=g),
    }
    # Newton-Schulz in float32: what is checked here is the wrapper (bf16's emulation is Muon's own test)
    inner = ps.muon_adamw(0.02, adamw_lr=0.01, ns_dtype=torch.float32)
    outer = ps.sgd(0.7, momentum=0.9, nesterov=True)
    if options:
        opt = ps.diloco(inner, outer, 6, gather=_all_gather, **options)
    else:
        opt = ps.diloco(inner, outer, 3, _all_reduce_mean)
    compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    counts = []
    for i in range(7):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        with torch.compiler.set_stance("fail_on_recompile" if i >= 3 else "default"):
            counts.append(_collectives(lambda: compiled(p, grads, s)))
        p_ref, s_ref = eager(p_ref, grads, s_ref)
    assert compiled.explain().startswith("flat"), compiled.explain()
    assert [c > 0 for c in counts[1:]] == syncs, counts  # (the first call compiles: tracing dispatches it too)
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(s.anchor[k], s_ref.anchor[k], rtol=1e-5, atol=1e-6, msg=k)


def test_quiet_calls_run_a_program_of_their_own_and_the_host_count_follows_a_state_loaded_in_place():
    """The donated compiled step knows on the host which calls sync (`engine.clock`): the calls
    between syncs run a program of their own (no `torch.cond`: compiled at the first call,
    the sync calls' at the first sync, nothing after), and a state written in place (a
    checkpoint loaded into the same tensors, the count with it) is counted from its own
    count, not from the calls made so far."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    opt = ps.diloco(ps.adamw(0.05), ps.sgd(0.7, momentum=0.9, nesterov=True), 4)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(9)]
    compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    compiles = []
    for i in range(9):
        if i == 2:
            saved = ps.tree_map(lambda x: x.clone(), (p, s))  # after 2 calls
        before = counters["stats"]["unique_graphs"]
        compiled(p, grads[i], s)
        compiles.append(counters["stats"]["unique_graphs"] - before)
    assert compiled.explain().startswith("flat"), compiled.explain()
    assert compiles == [1, 0, 0, 1, 0, 0, 0, 0, 0], compiles  # call 1 (quiet) and call 4 (a sync) compile
    # Load the state after call 2 into the same tensors: calls 3 and 4 come next (4 syncs).
    with torch.no_grad():
        for dst, src in zip(ps.tree_leaves((p, s)), ps.tree_leaves(saved)):
            dst.copy_(src)
    p_ref, s_ref = saved
    for i in range(2, 8):
        compiled(p, grads[i], s)
        p_ref, s_ref = eager(p_ref, grads[i], s_ref)
    assert int(s.count) == 8
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(s.anchor[k], s_ref.anchor[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_sync_the_workers_do_not_commit_leaves_the_anchor_and_puts_the_params_back_on_it():
    """`commit` (torchft's should_commit): a sync voted down keeps the anchor and the outer
    state and drops the steps since the last sync (torchft's DiLoCo); the next sync counts
    from there. Compiled, a host vote is refused."""
    votes = iter([True, False, True])
    opt = ps.diloco(ps.adamw(0.1), ps.sgd(0.7, momentum=0.9, nesterov=True), 2, commit=lambda: next(votes))
    ref = ps.diloco(ps.adamw(0.1), ps.sgd(0.7, momentum=0.9, nesterov=True), 2)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=g)}
    grads = [{"w": torch.randn(3, 2, generator=g)} for _ in range(6)]
    p, s = dict(params), opt.init(params)
    q, r = dict(params), ref.init(params)
    for i in range(6):
        u, s = opt.update(grads[i], s, p)
        p = ps.apply_updates(p, u)
        if i == 3:  # the vote at the second sync: dropped
            torch.testing.assert_close(p["w"], s.anchor["w"])
            torch.testing.assert_close(s.anchor["w"], anchor_after_first["w"])
            torch.testing.assert_close(s.outer_state, outer_after_first)
            # the reference goes on from there (the inner update of the dropped call stays)
            r, q = s, dict(p)
            continue
        v, r = ref.update(grads[i], r, q)
        q = ps.apply_updates(q, v)
        if i == 1:
            anchor_after_first = {"w": s.anchor["w"].clone()}
            outer_after_first = ps.tree_map(lambda x: x.clone(), s.outer_state)
            assert not torch.equal(anchor_after_first["w"], params["w"])
    torch.testing.assert_close(p["w"], q["w"])
    torch.testing.assert_close(s.anchor["w"], r.anchor["w"])
    compiled = ps.make_update(opt, compile=True, donate=False)
    with pytest.raises(Exception, match="host vote"):
        compiled(params, grads[0], opt.init(params))
