"""The one registry of transforms and schedules under test, shared by tests/ and property_tests/.

Every name in `purestep.core.__all__` is either registered here or listed as not a
transform; `tests/core/test_public_api.py` fails when a new public name is neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import purestep.core as ps


@dataclass(frozen=True)
class Case:
    """A transform under test: how to build it, and which invariants it promises."""

    name: str
    make: Callable[[], ps.Transform]
    needs_params: bool = True
    decoupled_decay: bool = False  # update gains +lr·wd·p exactly (adamw, lion, lamb before trust ratio...)
    sign_based: bool = False  # |update| <= lr elementwise
    scale_invariant: bool = False  # update unchanged when grads are multiplied by c > 0 (up to eps)
    matrices_only: bool = False  # refuses 0-D/1-D leaves
    extra: dict[str, Any] = field(default_factory=dict)
    extra_trees: tuple[str, ...] = ()  # update keywords shaped like grads (sophia's hessian), drawn by the kit
    update_bound: float | None = None  # |update| <= update_bound at params = 0 (required when sign_based)
    reference: Callable[..., Any] | None = None  # list of params -> torch.optim optimizer, for random-step parity


def _half_width(params: Any) -> dict[str, tuple[int, ...]]:
    """μP base shapes for any tree: the first two dims of every leaf at half size (a leaf's
    dims of size 1 stay finite), so the kit's leaves are vectors and hidden matrices alike."""
    return {path: tuple(max(1, d // 2) if i < 2 else d for i, d in enumerate(leaf.shape))
            for path, leaf in ps.tree_flatten_with_path(params)[0]}


def _mup_reference(cls_name: str, **kwargs: Any) -> Callable[[list], torch.optim.Optimizer]:
    """`mup.MuAdamW` / `mup.MuSGD` on the kit's params, each tagged with the infshape that
    `mup.set_base_shapes` would give it against `_half_width`'s base."""

    def make(params: list) -> torch.optim.Optimizer:
        import mup
        from mup.infshape import zip_infshape

        for p in params:
            p.infshape = zip_infshape(list(_half_width({"p": p})["p"]), list(p.shape))
        return getattr(mup, cls_name)(params, **kwargs)

    return make


TRANSFORMS: dict[str, Case] = {
    c.name: c
    for c in [
        Case("sgd", lambda: ps.sgd(0.1, momentum=0.9), reference=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        Case("adam", lambda: ps.adam(1e-2), scale_invariant=True, reference=lambda p: torch.optim.Adam(p, lr=1e-2)),
        Case("adamw", lambda: ps.adamw(1e-2, weight_decay=0.1), decoupled_decay=True, scale_invariant=True,
             reference=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
        Case("sgd(maximize)", lambda: ps.sgd(0.1, momentum=0.9, nesterov=True, maximize=True),
             reference=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
        Case("adamw(amsgrad, maximize)", lambda: ps.adamw(1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
             decoupled_decay=True, scale_invariant=True,
             reference=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
        Case("lion", lambda: ps.lion(1e-2, weight_decay=0.1), decoupled_decay=True, sign_based=True, update_bound=1e-2),
        Case("lamb", lambda: ps.lamb(1e-2, weight_decay=0.1)),
        Case("lars", lambda: ps.lars(0.1, weight_decay=0.01)),
        Case("identity", lambda: ps.identity(), needs_params=False),
        Case("scale", lambda: ps.scale(-0.5), needs_params=False),
        Case("scale_by_lr", lambda: ps.scale_by_lr(lambda t: 0.1 / (1.0 + t)), needs_params=False),
        Case("trace", lambda: ps.trace(0.9, nesterov=True), needs_params=False),
        Case("scale_by_adam", lambda: ps.scale_by_adam(), needs_params=False, scale_invariant=True),
        Case("scale_by_lion", lambda: ps.scale_by_lion(), needs_params=False),
        Case("scale_by_trust_ratio", lambda: ps.scale_by_trust_ratio()),
        Case("add_decayed_weights", lambda: ps.add_decayed_weights(0.1)),
        Case("chain", lambda: ps.chain(ps.scale_by_adam(), ps.scale_by_lr(1e-2)), needs_params=False),
        Case("masked", lambda: ps.masked(ps.scale_by_adam(), lambda p: {k: v.dim() >= 2 for k, v in p.items()})),
        Case("partition", lambda: ps.partition(
            {"a": ps.adamw(1e-2), "b": ps.sgd(0.1)}, lambda p: {k: "a" if v.dim() >= 2 else "b" for k, v in p.items()}
        )),
        Case("inject_hyperparams", lambda: ps.inject_hyperparams(ps.adamw)(lr=lambda t: 1e-2 * 0.9**t)),
        Case("apply_if_finite", lambda: ps.apply_if_finite(ps.adam(1e-2))),
        Case("accumulate", lambda: ps.accumulate(ps.sgd(0.1, momentum=0.9), every=2)),
        Case("diloco", lambda: ps.diloco(ps.adamw(1e-2, weight_decay=0.1), ps.sgd(0.7, momentum=0.9, nesterov=True), 2)),
        Case("clip_by_global_norm", lambda: ps.clip_by_global_norm(1.0), needs_params=False),
        Case("clip_by_value", lambda: ps.clip_by_value(0.5), needs_params=False),
        Case("adaptive_clip", lambda: ps.adaptive_clip(0.05)),
        Case("clip_by_running_norm", lambda: ps.clip_by_running_norm(2.0, 0.9, warmup_steps=2), needs_params=False),
        Case("scale_per_leaf", lambda: ps.scale_per_leaf(lambda g: ps.layerwise_lr_decay(g, 0.8)), needs_params=False),
        Case("muon", lambda: ps.muon(0.02, weight_decay=0.1), decoupled_decay=True, matrices_only=True),
        Case("scale_by_muon", lambda: ps.scale_by_muon(ns_coefficients="polar_express"), needs_params=False, matrices_only=True),
        Case("muon_adamw", lambda: ps.muon_adamw()),
        Case("normuon", lambda: ps.normuon(0.02, weight_decay=0.1, ns_dtype=torch.float32), decoupled_decay=True,
             matrices_only=True),
        Case("scale_by_normuon", lambda: ps.scale_by_normuon(ns_coefficients="polar_express"), needs_params=False,
             matrices_only=True),
        Case("normuon_adamw", lambda: ps.normuon_adamw()),
        Case("soap", lambda: ps.soap(0.01, weight_decay=0.0, precondition_frequency=2)),
        Case("scale_by_soap", lambda: ps.scale_by_soap(precondition_frequency=2), needs_params=False),
        Case("schedule_free_adamw", lambda: ps.schedule_free_adamw(1e-2, weight_decay=0.1, warmup_steps=3)),
        Case("schedule_free", lambda: ps.schedule_free(ps.chain(ps.scale_by_adam(0.0), ps.scale_by_lr(1e-2)), 1e-2)),
        Case("sophia", lambda: ps.sophia(1e-2, weight_decay=0.1), decoupled_decay=True, sign_based=True,
             update_bound=1e-2, extra_trees=("hessian",)),
        Case("compensated_updates", lambda: ps.chain(ps.adamw(1e-2, weight_decay=0.1), ps.compensated_updates())),
        Case("scale_by_sophia", lambda: ps.scale_by_sophia(update_every=2), needs_params=False, extra_trees=("hessian",)),
        Case("ademamix", lambda: ps.ademamix(1e-2, b3=0.99, weight_decay=0.1), decoupled_decay=True, scale_invariant=True),
        Case("scale_by_ademamix", lambda: ps.scale_by_ademamix(b3=lambda t: 0.999 - 0.09 * 0.5**t, alpha=lambda t: 0.5 * t),
             needs_params=False, scale_invariant=True),
        Case("cautious", lambda: ps.cautious(ps.adamw(1e-2, weight_decay=0.1)), scale_invariant=True),
        Case("cautious_adamw", lambda: ps.cautious_adamw(1e-2, weight_decay=0.1, rescale="mean"), decoupled_decay=True,
             scale_invariant=True),
        Case("mup_adamw", lambda: ps.mup_adamw(1e-2, weight_decay=0.1, base_shapes=_half_width), decoupled_decay=True,
             scale_invariant=True, reference=_mup_reference("MuAdamW", lr=1e-2, weight_decay=0.1)),
        Case("mup_sgd", lambda: ps.mup_sgd(0.1, momentum=0.9, weight_decay=0.01, base_shapes=_half_width),
             reference=_mup_reference("MuSGD", lr=0.1, momentum=0.9, weight_decay=0.01)),
        Case("adopt", lambda: ps.adopt(1e-2, weight_decay=0.1), decoupled_decay=True, scale_invariant=True),
        Case("scale_by_adopt", lambda: ps.scale_by_adopt(b1=0.5), needs_params=False),
        Case("prodigy", lambda: ps.prodigy(weight_decay=0.1, d0=1e-3)),
        Case("mars", lambda: ps.mars(1e-2, weight_decay=0.1), decoupled_decay=True),
        Case("scale_by_mars", lambda: ps.scale_by_mars(gamma=0.1), needs_params=False),
        Case("laprop", lambda: ps.laprop(lambda t: 1e-2 / (1.0 + t), weight_decay=0.1), scale_invariant=True),
        Case("scale_by_laprop", lambda: ps.scale_by_laprop(lambda t: 1.0 + t), needs_params=False, scale_invariant=True),
        Case("adamc", lambda: ps.adamc(1e-2, weight_decay=0.1), decoupled_decay=True, scale_invariant=True),
        Case("kron", lambda: ps.kron(1e-2, weight_decay=0.1, update_prob=0.5), decoupled_decay=True),
        Case("scale_by_kron", lambda: ps.scale_by_kron(update_prob=lambda t: 1.0 / (1.0 + t), memory_save_mode="one_diag"),
             needs_params=False),
        Case("adamw(cautious_weight_decay)", lambda: ps.adamw(1e-2, weight_decay=0.1, cautious_weight_decay=True),
             scale_invariant=True),
        Case("lion(cautious_weight_decay)", lambda: ps.lion(1e-2, weight_decay=0.1, cautious_weight_decay=True),
             sign_based=True, update_bound=1e-2),
    ]
}

SCHEDULES: dict[str, Callable[[], Callable]] = {
    "constant_schedule": lambda: ps.constant_schedule(0.1),
    "kron_update_probability": lambda: ps.kron_update_probability(flat_start=20, decay=0.05),
    "linear_schedule": lambda: ps.linear_schedule(1.0, 0.1, 30),
    "cosine_schedule": lambda: ps.cosine_schedule(1.0, 100, final=0.1),
    "warmup_cosine_schedule": lambda: ps.warmup_cosine_schedule(1.0, 10, 100, init=0.01, final=0.05),
    "wsd_schedule": lambda: ps.wsd_schedule(1.0, 10, 100, 30, final=0.01, shape="sqrt"),
    "one_cycle_schedule": lambda: ps.one_cycle_schedule(1.0, 100, three_phase=True),
    "one_cycle_momentum_schedule": lambda: ps.one_cycle_momentum_schedule(100),
    "inverse_sqrt_schedule": lambda: ps.inverse_sqrt_schedule(1.0, 10),
    "piecewise_constant_schedule": lambda: ps.piecewise_constant_schedule(1.0, {10: 0.5, 30: 0.1}),
    "join_schedules": lambda: ps.join_schedules(
        [ps.linear_schedule(0.0, 1.0, 10), ps.cosine_schedule(1.0, 90, final=0.1)], [10]
    ),
}

# check_schedule keywords for schedules that are not continuous, non-negative and turn at most twice
# over steps 0..150 (property_tests/test_schedules.py); boundaries/bounds make the checks sharper.
SCHEDULE_CHECKS: dict[str, dict[str, Any]] = {
    "piecewise_constant_schedule": dict(continuous=False),
    "warmup_cosine_schedule": dict(boundaries=[10, 100], bounds=(0.0, 1.0)),
    "wsd_schedule": dict(boundaries=[10, 70, 100], bounds=(0.0, 1.0)),
    "inverse_sqrt_schedule": dict(boundaries=[10], bounds=(0.0, 1.0)),
    "one_cycle_momentum_schedule": dict(bounds=(0.85, 0.95)),
    "join_schedules": dict(boundaries=[10, 100], bounds=(0.0, 1.0)),
}

# Public names that are not transforms or schedules (types, states, tree utilities).
NOT_TRANSFORMS = {
    "Transform", "with_in_place", "Needs", "Rule", "with_needs", "needs_of", "once", "EmptyState", "Schedule",
    "apply_updates", "apply_updates_", "tree_get", "tree_set", "step_count", "skipped_updates", "takes_parts", "tree_map", "tree_leaves",
    "tree_flatten", "tree_map_with_path",
    "tree_flatten_with_path", "tree_unflatten", "tree_paths", "tree_zeros_like",
    "tree_global_norm", "tree_cast", "state_bytes", "bytes_per_rank", "owner_work", "set_hyperparam", "get_hyperparams",
    "MaskedState", "PartitionState", "InjectHyperparamsState", "ApplyIfFiniteState",
    "AccumulateState", "ScaleByLrState", "TraceState", "ScaleByAdamState", "ScaleByAmsgradState",
    "ScaleByLionState", "AddDecayedWeightsState",
    "ClipByGlobalNormState", "ClipByRunningNormState",
    "decay_mask", "layerwise_lr_decay",
    "params_ema", "params_swa", "Averager", "ParamsEmaState", "ParamsSwaState",
    "dynamic_loss_scale", "LossScaler", "DynamicLossScaleState",
    "muon_labels", "schedule_free_eval_params", "gnb_hessian",
    # qk_clip names W_q and W_k by path and reads max_logits: checked in tests/core/test_qk_clip.py
    "qk_clip", "QKHeads",
    "ScaleByMuonState", "ScaleByNorMuonState", "SOAPState", "ScheduleFreeState", "ScaleBySophiaState",
    "make_step", "make_update", "functional_model", "functional_ensemble",
    "stochastic_round", "quantize_blockwise", "dequantize_blockwise", "QuantizedTensor", "CompensatedUpdatesState",
    "ScaleByAdemamixState", "mup_lr_multipliers",
    "ScaleByAdoptState", "ProdigyState", "ScaleByMarsState", "ScaleByLapropState", "DecayAfterState", "AdamcState",
    "ScaleByKronState", "DiLoCoState", "TopK", "contains", "schedule_clocks",
}
