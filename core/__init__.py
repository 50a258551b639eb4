"""purestep.core: pure-functional optimizers, schedules and training-step pieces for PyTorch.

Everything here is a pure function over pytrees of tensors (`torch.utils._pytree`):
`state = t.init(params)`, `updates, state = t.update(grads, state, params)`,
`params = apply_updates(params, updates)`.
"""

from ._averaging import Averager as Averager
from ._averaging import ParamsEmaState as ParamsEmaState
from ._averaging import ParamsSwaState as ParamsSwaState
from ._averaging import params_ema as params_ema
from ._averaging import params_swa as params_swa
from ._base import EmptyState as EmptyState
from ._base import Schedule as Schedule
from ._base import Transform as Transform
from ._base import once as once
from ._base import with_in_place as with_in_place
from .engine.mesh import owner_work as owner_work
from .engine.needs import Needs as Needs
from .engine.needs import Rule as Rule
from .engine.needs import contains as contains
from .engine.needs import takes_parts as takes_parts
from .engine.needs import needs_of as needs_of
from .engine.needs import with_needs as with_needs
from ._clipping import ClipByGlobalNormState as ClipByGlobalNormState
from ._clipping import ClipByRunningNormState as ClipByRunningNormState
from ._clipping import adaptive_clip as adaptive_clip
from ._clipping import clip_by_global_norm as clip_by_global_norm
from ._clipping import clip_by_running_norm as clip_by_running_norm
from ._clipping import clip_by_value as clip_by_value
from ._combine import AccumulateState as AccumulateState
from ._combine import ApplyIfFiniteState as ApplyIfFiniteState
from ._hyperparams import InjectHyperparamsState as InjectHyperparamsState
from ._combine import MaskedState as MaskedState
from ._combine import PartitionState as PartitionState
from ._combine import accumulate as accumulate
from ._diloco import DiLoCoState as DiLoCoState
from ._diloco import diloco as diloco
from ._sparse import TopK as TopK
from ._combine import apply_if_finite as apply_if_finite
from ._combine import skipped_updates as skipped_updates
from ._combine import chain as chain
from ._combine import identity as identity
from ._hyperparams import inject_hyperparams as inject_hyperparams
from ._combine import masked as masked
from ._combine import partition as partition
from ._hyperparams import get_hyperparams as get_hyperparams
from ._hyperparams import schedule_clocks as schedule_clocks
from ._hyperparams import set_hyperparam as set_hyperparam
from ._weight_decay import AddDecayedWeightsState as AddDecayedWeightsState
from ._loss_scale import DynamicLossScaleState as DynamicLossScaleState
from ._loss_scale import LossScaler as LossScaler
from ._loss_scale import dynamic_loss_scale as dynamic_loss_scale
from ._weight_decay import add_decayed_weights as add_decayed_weights
from ._weight_decay import decay_mask as decay_mask
from ._weight_decay import layerwise_lr_decay as layerwise_lr_decay
from ._weight_decay import scale_per_leaf as scale_per_leaf
from ._alias import adam as adam
from ._alias import adamw as adamw
from ._alias import lamb as lamb
from ._alias import lars as lars
from ._alias import lion as lion
from ._alias import sgd as sgd
from ._muon import muon as muon
from ._qk_clip import QKHeads as QKHeads
from ._qk_clip import qk_clip as qk_clip
from ._muon import muon_adamw as muon_adamw
from ._schedule_free import schedule_free_adamw as schedule_free_adamw
from ._sophia import sophia as sophia
from ._muon import ScaleByMuonState as ScaleByMuonState
from ._muon import muon_labels as muon_labels
from ._muon import scale_by_muon as scale_by_muon
from ._normuon import ScaleByNorMuonState as ScaleByNorMuonState
from ._normuon import normuon as normuon
from ._normuon import normuon_adamw as normuon_adamw
from ._normuon import scale_by_normuon as scale_by_normuon
from ._soap import SOAPState as SOAPState
from ._soap import scale_by_soap as scale_by_soap
from ._soap import soap as soap
from ._compensated import CompensatedUpdatesState as CompensatedUpdatesState
from ._low_precision import QuantizedTensor as QuantizedTensor
from ._compensated import compensated_updates as compensated_updates
from ._low_precision import dequantize_blockwise as dequantize_blockwise
from ._low_precision import quantize_blockwise as quantize_blockwise
from ._low_precision import stochastic_round as stochastic_round
from ._schedule_free import ScheduleFreeState as ScheduleFreeState
from ._schedule_free import schedule_free as schedule_free
from ._schedule_free import schedule_free_eval_params as schedule_free_eval_params
from ._ademamix import ScaleByAdemamixState as ScaleByAdemamixState
from ._ademamix import ademamix as ademamix
from ._ademamix import scale_by_ademamix as scale_by_ademamix
from ._cautious import cautious as cautious
from ._cautious import cautious_adamw as cautious_adamw
from ._mup import mup_adamw as mup_adamw
from ._mup import mup_lr_multipliers as mup_lr_multipliers
from ._mup import mup_sgd as mup_sgd
from ._sophia import ScaleBySophiaState as ScaleBySophiaState
from ._sophia import gnb_hessian as gnb_hessian
from ._sophia import scale_by_sophia as scale_by_sophia
from ._adopt import ScaleByAdoptState as ScaleByAdoptState
from ._adopt import adopt as adopt
from ._adopt import scale_by_adopt as scale_by_adopt
from ._kron import ScaleByKronState as ScaleByKronState
from ._kron import kron as kron
from ._kron import scale_by_kron as scale_by_kron
from ._kron import update_probability as kron_update_probability
from ._prodigy import ProdigyState as ProdigyState
from ._prodigy import prodigy as prodigy
from ._mars import ScaleByMarsState as ScaleByMarsState
from ._mars import mars as mars
from ._mars import scale_by_mars as scale_by_mars
from ._laprop import DecayAfterState as DecayAfterState
from ._laprop import ScaleByLapropState as ScaleByLapropState
from ._laprop import laprop as laprop
from ._laprop import scale_by_laprop as scale_by_laprop
from ._adamc import AdamcState as AdamcState
from ._adamc import adamc as adamc
from ._functional import functional_ensemble as functional_ensemble
from ._functional import functional_model as functional_model
from ._step import make_step as make_step
from ._step import make_update as make_update
from ._schedules import constant_schedule as constant_schedule
from ._schedules import cosine_schedule as cosine_schedule
from ._schedules import inverse_sqrt_schedule as inverse_sqrt_schedule
from ._schedules import join_schedules as join_schedules
from ._schedules import linear_schedule as linear_schedule
from ._schedules import one_cycle_momentum_schedule as one_cycle_momentum_schedule
from ._schedules import one_cycle_schedule as one_cycle_schedule
from ._schedules import piecewise_constant_schedule as piecewise_constant_schedule
from ._schedules import warmup_cosine_schedule as warmup_cosine_schedule
from ._schedules import wsd_schedule as wsd_schedule
from ._blocks import ScaleByAdamState as ScaleByAdamState
from ._blocks import ScaleByAmsgradState as ScaleByAmsgradState
from ._blocks import ScaleByLionState as ScaleByLionState
from ._blocks import ScaleByLrState as ScaleByLrState
from ._blocks import TraceState as TraceState
from ._blocks import scale as scale
from ._blocks import scale_by_adam as scale_by_adam
from ._blocks import scale_by_lion as scale_by_lion
from ._blocks import scale_by_lr as scale_by_lr
from ._blocks import scale_by_trust_ratio as scale_by_trust_ratio
from ._blocks import trace as trace
from ._tree import apply_updates as apply_updates
from ._tree import apply_updates_ as apply_updates_
from ._tree import tree_cast as tree_cast
from ._tree import tree_flatten_with_path as tree_flatten_with_path
from ._tree import step_count as step_count
from ._tree import state_bytes as state_bytes
from ._tree import bytes_per_rank as bytes_per_rank
from ._tree import tree_flatten as tree_flatten
from ._tree import tree_get as tree_get
from ._tree import tree_global_norm as tree_global_norm
from ._tree import tree_leaves as tree_leaves
from ._tree import tree_map as tree_map
from ._tree import tree_map_with_path as tree_map_with_path
from ._tree import tree_paths as tree_paths
from ._tree import tree_set as tree_set
from ._tree import tree_unflatten as tree_unflatten
from ._tree import tree_zeros_like as tree_zeros_like

__all__ = [
    # base
    "Transform",
    "with_in_place",
    "Needs",
    "Rule",
    "with_needs",
    "needs_of",
    "contains",
    "takes_parts",
    "once",
    "EmptyState",
    "Schedule",
    # trees
    "apply_updates",
    "apply_updates_",
    "tree_get",
    "tree_set",
    "step_count",
    "tree_map",
    "tree_map_with_path",
    "tree_leaves",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_unflatten",
    "tree_paths",
    "tree_zeros_like",
    "tree_global_norm",
    "tree_cast",
    "state_bytes",
    "bytes_per_rank",
    "owner_work",
    # combinators
    "chain",
    "masked",
    "partition",
    "inject_hyperparams",
    "get_hyperparams",
    "schedule_clocks",
    "set_hyperparam",
    "apply_if_finite",
    "skipped_updates",
    "accumulate",
    "diloco",
    "TopK",
    "identity",
    "MaskedState",
    "PartitionState",
    "InjectHyperparamsState",
    "ApplyIfFiniteState",
    "AccumulateState",
    "DiLoCoState",
    # building blocks
    "scale",
    "scale_by_lr",
    "trace",
    "scale_by_adam",
    "scale_by_lion",
    "scale_by_trust_ratio",
    "add_decayed_weights",
    "ScaleByLrState",
    "TraceState",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByLionState",
    "AddDecayedWeightsState",
    # clipping
    "clip_by_global_norm",
    "clip_by_value",
    "adaptive_clip",
    "clip_by_running_norm",
    "ClipByGlobalNormState",
    "ClipByRunningNormState",
    # parameter-group rules
    "decay_mask",
    "layerwise_lr_decay",
    "scale_per_leaf",
    # averaging and loss scaling
    "params_ema",
    "params_swa",
    "Averager",
    "ParamsEmaState",
    "ParamsSwaState",
    "dynamic_loss_scale",
    "LossScaler",
    "DynamicLossScaleState",
    # schedules
    "constant_schedule",
    "linear_schedule",
    "cosine_schedule",
    "warmup_cosine_schedule",
    "wsd_schedule",
    "one_cycle_schedule",
    "one_cycle_momentum_schedule",
    "inverse_sqrt_schedule",
    "piecewise_constant_schedule",
    "join_schedules",
    # optimizers
    "sgd",
    "adam",
    "adamw",
    "lion",
    "lamb",
    "lars",
    # muon, schedule-free, sophia
    "muon",
    "muon_adamw",
    "qk_clip",
    "QKHeads",
    "schedule_free_adamw",
    "sophia",
    "scale_by_muon",
    "normuon",
    "normuon_adamw",
    "scale_by_normuon",
    "soap",
    "scale_by_soap",
    "muon_labels",
    "schedule_free",
    "schedule_free_eval_params",
    "scale_by_sophia",
    "gnb_hessian",
    "ScaleByMuonState",
    "ScaleByNorMuonState",
    "SOAPState",
    "ScheduleFreeState",
    "ScaleBySophiaState",
    # low precision
    "compensated_updates",
    "stochastic_round",
    "quantize_blockwise",
    "dequantize_blockwise",
    "QuantizedTensor",
    "CompensatedUpdatesState",
    # third release: AdEMAMix, cautious updates, μP
    "ademamix",
    "scale_by_ademamix",
    "ScaleByAdemamixState",
    "cautious",
    "cautious_adamw",
    "mup_lr_multipliers",
    "mup_adamw",
    "mup_sgd",
    # fourth release: ADOPT, Prodigy, MARS, LaProp, AdamC
    "adopt",
    "scale_by_adopt",
    "ScaleByAdoptState",
    "prodigy",
    "ProdigyState",
    "mars",
    "scale_by_mars",
    "ScaleByMarsState",
    "laprop",
    "scale_by_laprop",
    "ScaleByLapropState",
    "DecayAfterState",
    "adamc",
    "AdamcState",
    "kron",
    "scale_by_kron",
    "ScaleByKronState",
    "kron_update_probability",
    # the step function
    "make_step",
    "make_update",
    "functional_model",
    "functional_ensemble",
]
