"""Run by tests/api/test_fsdp_step.py under torchrun: the sharded update on FSDP2 vs one process.

Each case trains a small model whose matrices shard unevenly over 2 ranks (5, 3 and 1
rows: one rank holds an empty block) with FSDP2 and `ps.make_update(donate=True)`, and the
same model in this process with the pure update; after every step the full params must
agree. At step 2 rank 1 writes a NaN into its own grad block: every rank must skip together.
Prints one line per case; exits non-zero on the first disagreement.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile

import torch
import torch.distributed as dist

import purestep.core as ps
from purestep.api.cli import leave

CASES = {
    "adamw+clip+skip": lambda: ps.apply_if_finite(ps.chain(ps.clip_by_global_norm(0.05), ps.adamw(0.02, weight_decay=0.1))),
    "muon_adamw": lambda: ps.apply_if_finite(ps.muon_adamw(lr=0.02, adamw_lr=0.01, ns_dtype=torch.float32)),
    "normuon_adamw": lambda: ps.apply_if_finite(ps.normuon_adamw(lr=0.02, adamw_lr=0.01, ns_dtype=torch.float32)),
    "normuon_original": lambda: ps.apply_if_finite(
        ps.normuon_adamw(lr=0.02, adamw_lr=0.01, ns_dtype=torch.float32, adjust_lr="original")),
    "lamb": lambda: ps.apply_if_finite(ps.lamb(0.02, weight_decay=0.1)),
    "adaptive_clip": lambda: ps.apply_if_finite(ps.chain(ps.adaptive_clip(0.05), ps.sgd(0.1, momentum=0.9))),
    "cautious_adamw": lambda: ps.apply_if_finite(ps.cautious_adamw(0.02, weight_decay=0.1)),  # per-leaf counts
    # d-estimate: two tree-wide sums (⟨g, x₀ - x⟩, ‖s‖₁) over the shards
    "prodigy": lambda: ps.apply_if_finite(ps.prodigy(d0=1e-3, weight_decay=0.1)),
    "mars": lambda: ps.apply_if_finite(ps.mars(0.02, weight_decay=0.1)),  # a norm per leaf
    "adopt/laprop/adamc": lambda: ps.apply_if_finite(ps.partition(
        {"a": ps.adopt(0.02, weight_decay=0.1), "l": ps.laprop(0.02, weight_decay=0.1),
         "c": ps.adamc(lambda t: 0.02 / (1 + t), weight_decay=0.1)},
        lambda p: {k: "alc"[i % 3] for i, k in enumerate(p)})),
    "muon_batch_dims": lambda: ps.apply_if_finite(ps.muon_adamw(
        lr=0.02, adamw_lr=0.01, ns_dtype=torch.float32, batch_dims=lambda path, x: int(x.dim() == 3), cautious_weight_decay=True)),
    # Fused leaves in blocks: 5-row matrices as 2 + 3 rows, each its own matrix (on the owner rank).
    "muon_split": lambda: ps.apply_if_finite(ps.muon_adamw(
        lr=0.02, adamw_lr=0.01, ns_dtype=torch.float32, split=lambda path, x: (2, 3) if x.shape[0] == 5 else None)),
    "normuon_batch_dims": lambda: ps.apply_if_finite(ps.normuon_adamw(
        lr=0.02, adamw_lr=0.01, ns_dtype=torch.float32, batch_dims=lambda path, x: int(x.dim() == 3))),
    # Per-leaf factors: each leaf's momentum and factors at its owner, which refits and preconditions
    "kron": lambda: ps.apply_if_finite(ps.kron(0.02, weight_decay=0.1, update_prob=0.5)),
    # SOAP's moments, factors and bases at each leaf's owner: eigh at step 0, a refresh at step 3
    "soap": lambda: ps.apply_if_finite(ps.soap(0.02, weight_decay=0.1, precondition_frequency=3)),
    # QK-clip's heads on FSDP2's row blocks (5 heads of 1 row: uneven blocks), each rank its rows' factors.
    "qk_clip_rows": lambda: ps.apply_if_finite(ps.chain(ps.adamw(0.02), ps.qk_clip(
        5.0, {"attn": ps.QKHeads(q="0.weight", k="2.weight", heads=5)}))),
    # A branch that gets no leaf still reduces (its zero partials made on the params' device).
    "empty_branch": lambda: ps.apply_if_finite(ps.partition(
        {"a": ps.chain(ps.clip_by_global_norm(0.05), ps.adamw(0.02, weight_decay=0.1)),
         "none": ps.chain(ps.clip_by_global_norm(1.0), ps.sgd(0.1))},
        lambda p: {k: "a" for k in p})),
}
WHOLE = ("kron", "soap")  # the per-leaf DTensor path: each leaf's math at its owner (engine.owners)
COMPILED = ("adamw+clip+skip", "muon_adamw", "normuon_adamw", "prodigy", "normuon_batch_dims")  # compile costs seconds per case


class Payloads:
    """Every collective of an update, checked (issue 39): its tensors lie on the params' device
    (NCCL refuses a CPU tensor), and no object collective runs inside a step.

    The params are on the CPU here, so a payload made without `device=` would pass unseen: the
    updates run with "meta" as the default device (`torch.device("meta")`), where such a payload
    lands on meta and is named. Wraps torch.distributed's and its functional collectives (the
    engine's, DTensor's), in eager code and, at trace time, in compiled code."""

    TENSOR_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                  "broadcast", "reduce", "all_to_all")
    OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")

    def __init__(self, device: str) -> None:
        import torch.distributed._functional_collectives as fc

        self.device, self.bad, self.seen, self.in_step = device, [], 0, False
        ops = [(dist, n) for n in self.TENSOR_OPS] + [
            (fc, n) for n in ("all_reduce", "all_to_all_single", "all_gather_tensor", "reduce_scatter_tensor",
                              "all_reduce_coalesced", "all_gather_into_tensor_coalesced")
        ]
        for module, name in ops:
            if hasattr(module, name):
                setattr(module, name, self._checked(getattr(module, name), f"{module.__name__}.{name}"))
        for name in self.OBJECT_OPS:
            setattr(dist, name, self._refused(getattr(dist, name), f"torch.distributed.{name}"))

    def _checked(self, fn, name):
        def checked(*args, **kwargs):
            if self.in_step:
                for t in [*args, *kwargs.values()]:
                    for x in t if isinstance(t, (list, tuple)) else [t]:
                        if isinstance(x, torch.Tensor):
                            self.seen += 1
                            if x.device.type != self.device:
                                self.bad.append(f"{name} was handed a tensor on {x.device}")
            return fn(*args, **kwargs)

        return checked

    def _refused(self, fn, name):
        def refused(*args, **kwargs):
            if self.in_step:
                self.bad.append(f"{name} inside a step")
            return fn(*args, **kwargs)

        return refused

    def step(self, off_device: bool):
        """A context for one update; `off_device`: with "meta" as the default device."""
        payloads = self

        @contextlib.contextmanager
        def inside():
            payloads.in_step = True
            try:
                with torch.device("meta") if off_device else contextlib.nullcontext():
                    yield
            except Exception as e:  # what the misplaced payload broke next (a meta flag read)
                if payloads.bad:
                    raise AssertionError("; ".join(sorted(set(payloads.bad)))) from e
                raise
            finally:
                payloads.in_step = False
            if payloads.bad:
                raise AssertionError("; ".join(sorted(set(payloads.bad))))

        return inside()


PAYLOADS: Payloads | None = None


class Experts(torch.nn.Module):
    """3 expert matrices of 5 x 5 in one (3, 5, 5) leaf, summed: a leaf Muon sees as 3 matrices with batch_dims=1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 5, 5) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.einsum("bi,eij->bj", x, self.w))


def model(experts: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5, bias=False), torch.nn.Tanh(),
        *([Experts()] if experts else []), torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1),
    )


EXPERTS = ("muon_batch_dims", "normuon_batch_dims")  # the cases whose model has the experts leaf


def run(name: str, compile: bool, flat: bool = True, mesh=None, over_replicas: bool | str = False) -> float:
    """One case; `mesh` a 2-D (replicate, shard) mesh for HSDP, else FSDP2 over every rank;
    `over_replicas`: HSDP with the state sharded across the replicas (True), or "mesh": FSDP2
    over mesh["shard"] in each replica, each replica on its own half of the batch, the update
    given the mesh (it averages the replicas' grads)."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank() if mesh is None else mesh.get_local_rank("shard")  # the NaN goes to shard rank 1
    ref, net = model(name in EXPERTS), model(name in EXPERTS)
    apart = over_replicas == "mesh"
    for layer in net:
        if isinstance(layer, (torch.nn.Linear, Experts)):
            fully_shard(layer, mesh=mesh["shard"] if apart else mesh)
    fully_shard(net, mesh=mesh["shard"] if apart else mesh)
    opt = CASES[name]()
    params = dict(net.named_parameters())
    state = opt.init(params)
    update = ps.make_update(opt, compile=compile, donate=True, flat=flat, metrics=True,
                            shard_state_over_replicas=mesh if apart else bool(over_replicas))
    whole_state_bytes = ps.state_bytes(opt.init({k: p.detach().full_tensor() for k, p in params.items()}))
    ref_params = {k: p.detach().clone() for k, p in ref.named_parameters()}
    ref_state = opt.init(ref_params)
    pure = ps.make_update(opt)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(4):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen)
        half = slice(4 * mesh.get_local_rank("replicate"), 4 * mesh.get_local_rank("replicate") + 4) if apart else slice(None)
        ((net(x[half]) - y[half]) ** 2).mean().backward()
        grads = {k: p.grad for k, p in params.items()}
        ref_grads = torch.func.grad(lambda p: ((torch.func.functional_call(ref, p, (x,)) - y) ** 2).mean())(ref_params)
        if step == 2:  # a NaN in the block of "0.weight" rank 1 holds (rows 3-4)
            ref_grads["0.weight"][4, 0] = float("nan")
            if rank == 1:
                grads["0.weight"].to_local()[1, 0] = float("nan")
        inputs = {"max_logits": {"attn": torch.tensor([8.0, 3.0, 6.0, 1.0, 9.0])}} if name == "qk_clip_rows" else {}
        # The per-leaf path's own probes (kron's seeds) follow the default device: only the payloads' check there.
        with PAYLOADS.step(off_device=name not in WHOLE and flat) if PAYLOADS is not None else contextlib.nullcontext():
            metrics = update(params, grads, state, **inputs)[-1]
        if bool(metrics["skipped"]) != (step == 2):
            raise AssertionError(f"{name} compile={compile} step {step}: skipped={bool(metrics['skipped'])}")
        if step != 2 and not torch.allclose(metrics["grad_norm"], ps.tree_global_norm(ref_grads), rtol=1e-5):
            raise AssertionError(f"{name} compile={compile} step {step}: grad_norm {float(metrics['grad_norm'])} "
                                 f"is not one process's {float(ps.tree_global_norm(ref_grads))}")
        ref_params, ref_state = pure(ref_params, ref_grads, ref_state, **inputs)
        net.zero_grad(set_to_none=False)
        for k, p in params.items():
            full = p.detach().full_tensor()
            err = float((full - ref_params[k]).abs().max())
            if not err <= 2e-6 * max(1.0, float(ref_params[k].abs().max())):
                raise AssertionError(f"{name} compile={compile} step {step}: '{k}' is {err:.3g} from one process")
            worst = max(worst, err)
    if over_replicas:  # the state: the global tensors of one process's, 1/4 of its bytes per rank (+ scalars)
        for i, (x, want) in enumerate(zip(ps.tree_leaves(state), ps.tree_leaves(ref_state))):
            got = x.full_tensor() if hasattr(x, "full_tensor") else x
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"{name} compile={compile}: state leaf {i} is not one process's")
        mine = ps.state_bytes(state)
        if not mine <= whole_state_bytes / 4 + 256:
            raise AssertionError(f"{name}: {mine} state bytes on this rank, one process holds {whole_state_bytes}")
    if mesh is not None:  # HSDP: the replicas hold bitwise the same params (and state, unless sharded over them)
        group = mesh.get_group("replicate")
        own = [] if over_replicas else [(f"state {i}", x) for i, x in enumerate(ps.tree_leaves(state))
                                        if not (hasattr(x, "device_mesh") and x.device_mesh.size() == 1)]  # at owners
        for k, x in [*params.items(), *own]:
            mine = x.to_local() if hasattr(x, "to_local") else x
            theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(theirs, mine.contiguous(), group=group)
            if not all(torch.equal(t, theirs[0]) for t in theirs):
                raise AssertionError(f"{name} compile={compile}: the replicas differ in {k}")
    if name in WHOLE:  # each leaf's state held whole by one rank (its owner), one process's there
        held, placed = 0, 0
        for i, (x, want) in enumerate(zip(ps.tree_leaves(state), ps.tree_leaves(ref_state))):
            if not hasattr(x, "to_local") or x.device_mesh.size() != 1 or not want.numel():
                continue
            placed += 1
            mine = x.to_local()
            if mine.numel():
                held += 1
                if not torch.allclose(mine, want, rtol=1e-4, atol=1e-5):
                    raise AssertionError(f"{name}: state leaf {i} at its owner is not one process's")
        counts = torch.tensor([held, ps.state_bytes(state)])
        dist.all_reduce(counts)
        if placed == 0 or int(counts[0]) != placed:
            raise AssertionError(f"{name}: {int(counts[0])} owners hold the {placed} per-leaf state tensors")
        whole = ps.state_bytes(ref_state) + 64 * dist.get_world_size()  # the counters on every rank
        if not int(counts[1]) <= whole:
            raise AssertionError(f"{name}: the ranks hold {int(counts[1])} state bytes, one process {whole}")
    if name in WHOLE and mesh is None:  # a checkpoint holds the whole state; it resumes here and in one process
        from purestep.api.checkpoint import load_checkpoint, load_distributed, save_checkpoint

        where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where)
        path = save_checkpoint(f"{where[0]}/ck", params=params, opt_state=state, step=4, distributed=True)
        back = load_distributed(path, params=params, opt_state=opt.init(params)).opt_state
        for i, (x, y) in enumerate(zip(ps.tree_leaves(back), ps.tree_leaves(state))):
            if not torch.equal(x.to_local() if hasattr(x, "to_local") else x, y.to_local() if hasattr(y, "to_local") else y):
                raise AssertionError(f"{name}: state leaf {i} resumed on the same ranks differs")
        if dist.get_rank() == 0:
            alone = load_checkpoint(path, opt_state_like=opt.init(ref_params)).opt_state
            for i, (x, want) in enumerate(zip(ps.tree_leaves(alone), ps.tree_leaves(ref_state))):
                if not torch.allclose(x, want, rtol=1e-4, atol=1e-5):
                    raise AssertionError(f"{name}: state leaf {i} resumed in one process is not one process's")
        dist.barrier()
    skipped = int(ps.tree_get(state, "total_notfinite"))
    assert skipped == 1, f"{name}: {skipped} skipped steps, expected the NaN step only"
    sharded = flat and name not in WHOLE
    assert update.explain().startswith("sharded" if sharded else "per-leaf DTensor"), update.explain()
    label = "the optimizer state over its 2 replicas x 2 shards" if over_replicas else "HSDP, 2 replicas x 2 shards"
    assert mesh is None or not sharded or label in update.explain(), update.explain()
    # A forward after the last update reads it: FSDP2 all-gathers from the flat buffers.
    x = torch.randn(4, 6, generator=gen)
    torch.testing.assert_close(net(x), torch.func.functional_call(ref, ref_params, (x,)), rtol=1e-5, atol=1e-5)
    return worst


HSDP = ("adamw+clip+skip", "muon_adamw", "normuon_adamw", "lamb", "prodigy", "soap")
HSDP_COMPILED = ("adamw+clip+skip", "muon_adamw")
OVER_REPLICAS = ("adamw+clip+skip", "muon_adamw", "normuon_adamw", "muon_split")


def main_hsdp() -> None:
    """4 ranks: HSDP on a (replicate 2, shard 2) mesh, then FSDP+TP on (dp 2, tp 2) and TP alone."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for name in HSDP:
        for compile in (False, True) if name in HSDP_COMPILED else (False,):
            worst = run(name, compile, mesh=mesh)
            if dist.get_rank() == 0:
                print(f"ok hsdp {name} compile={compile} max_err={worst:.2e}", flush=True)
    for name in OVER_REPLICAS:
        for compile in (False, True) if name == "adamw+clip+skip" else (False,):
            worst = run(name, compile, mesh=mesh, over_replicas=True)
            if dist.get_rank() == 0:
                print(f"ok over-replicas {name} compile={compile} max_err={worst:.2e}", flush=True)
    for name, compile in (("adamw+clip+skip", True), ("muon_adamw", False)):
        worst = run(name, compile, mesh=mesh, over_replicas="mesh")
        if dist.get_rank() == 0:
            print(f"ok replicas-apart {name} compile={compile} max_err={worst:.2e}", flush=True)
    for layout in ("fsdp+tp", "tp"):
        for name in TP_CASES:
            for compile in (False, True) if name in TP_COMPILED else (False,):
                worst, why = run_tp(name, layout, compile)
                if dist.get_rank() == 0:
                    print(
                        f"ok {layout} {name} compile={compile} max_err={worst:.2e} path={why.split(':')[0]!r} why={why!r}",
                        flush=True,
                    )
    dist.barrier()
    dist.destroy_process_group()
    leave(0)


class MLP(torch.nn.Module):
    """The demo GPT's MLP shape in small: up (colwise under TP), down (rowwise), and a head TP leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6), torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.down(torch.tanh(self.up(x)))))


TP_CASES = ("adamw+clip+skip", "muon_adamw", "normuon_adamw", "lamb", "qk_clip", "kron", "soap")
TP_COMPILED = ("adamw+clip+skip", "muon_adamw", "normuon_adamw")
# QK-clip's head rows on TP's colwise (Shard(0)) and rowwise (Shard(1)) weights, on whole DTensors.
TP_ONLY = {"qk_clip": lambda: ps.chain(ps.adamw(0.02), ps.qk_clip(5.0, {"attn": ps.QKHeads(q="up.weight", k="down.weight", heads=2)}))}


def run_tp(name: str, layout: str, compile: bool = False) -> tuple[float, str]:
    """One case on tensor parallelism: "fsdp+tp" (TP over mesh["tp"], then FSDP2 over mesh["dp"]
    on a (dp 2, tp 2) mesh: params on two meshes) or "tp" (TP alone over every rank: DTensor
    params beside plain ones). Elementwise math and reductions run on the ranks' blocks (the
    sharded path), whole-matrix math on whole DTensors; either way it must equal one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ref, net = MLP(), MLP()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], plan)
        for m in (net.up, net.down, net.head):
            fully_shard(m, mesh=mesh["dp"])
        fully_shard(net, mesh=mesh["dp"])
    else:
        parallelize_module(net, init_device_mesh("cpu", (dist.get_world_size(),)), plan)
    opt = {**CASES, **TP_ONLY}[name]()
    params = dict(net.named_parameters())
    state = opt.init(params)
    update = ps.make_update(opt, donate=True, metrics=True, compile=compile)
    ref_params = {k: p.detach().clone() for k, p in ref.named_parameters()}
    ref_state, pure = opt.init(ref_params), ps.make_update(opt)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen)
        ((net(x) - y) ** 2).mean().backward()
        grads = {k: p.grad for k, p in params.items()}
        ref_grads = torch.func.grad(lambda p: ((torch.func.functional_call(ref, p, (x,)) - y) ** 2).mean())(ref_params)
        if name == "soap":  # the same grads (TP's partial sums differ by float noise, which rotates
            # the null space of SOAP's rank-deficient first factors: eigh's basis there is arbitrary)
            ref_grads = {k: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for k, g in grads.items()}
        inputs = {"max_logits": {"attn": torch.tensor([8.0, 3.0])}} if name == "qk_clip" else {}
        metrics = update(params, grads, state, **inputs)[-1]
        ref_params, ref_state = pure(ref_params, ref_grads, ref_state, **inputs)
        net.zero_grad(set_to_none=False)
        if not torch.allclose(metrics["grad_norm"], ps.tree_global_norm(ref_grads), rtol=1e-5):
            raise AssertionError(f"{layout} {name} step {step}: grad_norm {float(metrics['grad_norm'])}")
        for k, p in params.items():
            full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
            err = float((full - ref_params[k]).abs().max())
            if not err <= 2e-6 * max(1.0, float(ref_params[k].abs().max())):
                raise AssertionError(f"{layout} {name} step {step}: '{k}' is {err:.3g} from one process")
            worst = max(worst, err)
    return worst, update.explain()


def main() -> None:
    if sys.argv[1:] == ["hsdp"]:
        return main_hsdp()
    dist.init_process_group("gloo")
    global PAYLOADS
    PAYLOADS = Payloads("cpu")
    for name in CASES:
        for compile in (False, True) if name in COMPILED else (False,):
            worst = run(name, compile)
            if dist.get_rank() == 0:
                print(f"ok {name} compile={compile} max_err={worst:.2e}", flush=True)
    # flat=False: the per-leaf fallback on whole DTensors (eager), reductions' Partial results included.
    worst = run("adamw+clip+skip", False, flat=False)
    if dist.get_rank() == 0:
        print(f"ok per-leaf-DTensor compile=False max_err={worst:.2e}", flush=True)
    # Every case's reductions went through the wrappers (none imported a collective by name past them).
    assert PAYLOADS.seen >= len(CASES), f"only {PAYLOADS.seen} collective payloads were seen"
    if dist.get_rank() == 0:
        print(f"ok payloads checked: {PAYLOADS.seen} tensors, all on the params' device", flush=True)
    dist.barrier()  # no rank leaves while another still talks to it (gloo aborts at exit otherwise)
    dist.destroy_process_group()
    leave(0)  # as the purestep command ends a torchrun rank


if __name__ == "__main__":
    sys.exit(main())
