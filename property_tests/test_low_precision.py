"""Invariant family "low_precision": stochastic rounding is unbiased and a pure function of
its key, block quantization stays within half a code spacing per block, and every
low-precision option (bf16 and 8-bit moments, compensated bf16 params) passes the kit's
checks: purity, state stability, finite outputs, determinism, composition, no recompile.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import purestep.core as ps
import purestep.core._low_precision as precision
from purestep.core.testing import check_transform, param_trees

NARROW = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
DRAWS = 2**14  # roundings of one value per check
SIGMAS = 6.0  # the statistical bound: the mean of DRAWS roundings lies within 6 standard errors
_keys = st.integers(min_value=0, max_value=2**40)


@functools.lru_cache(maxsize=None)
def _grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of `dtype`, sorted (float64), from all its bit patterns."""
    bits = 8 * torch.tensor([], dtype=dtype).element_size()
    codes = torch.arange(2**bits, dtype=torch.int32).to(torch.int16 if bits == 16 else torch.uint8)
    values = codes.view(dtype).double()
    return values[torch.isfinite(values)].unique()


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest value of `dtype` <= x and the smallest >= x."""
    grid, x = _grid(dtype), x.double()
    i = torch.searchsorted(grid, x).clamp(max=len(grid) - 1)
    above = grid[i]
    below = torch.where(above == x, above, grid[(i - 1).clamp(min=0)])
    return below, above


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@given(params=param_trees(max_leaves=2, max_rank=1, max_side=2, dtypes=(torch.float32,), zeros=False), key=_keys)
def test_stochastic_rounding_is_unbiased(dtype, params, key):
    fmax = torch.finfo(dtype).max
    for x in params.values():
        x = x.reshape(-1).clamp(-fmax, fmax)
        many = x[:, None].expand(-1, DRAWS)  # each value rounded DRAWS times, with independent bits
        r = ps.stochastic_round(many, dtype, key).double()
        lo, hi = _neighbours(x, dtype)
        # only the two neighbours of x come out
        assert ((r == lo[:, None]) | (r == hi[:, None])).all(), (dtype, x)
        # unbiased: E[round(x)] = x within SIGMAS standard errors of a Bernoulli mean
        # (plus the 2^-16 grid of the random threshold)
        bound = (SIGMAS * 0.5 / math.sqrt(DRAWS) + 2**-16) * (hi - lo)
        assert ((r.mean(1) - x.double()).abs() <= bound).all(), (dtype, x)


@given(params=param_trees(dtypes=(torch.float32, torch.float64)), key=_keys)
def test_stochastic_rounding_is_a_pure_function_of_value_and_key(params, key):
    for x in params.values():
        a = ps.stochastic_round(x, torch.bfloat16, key)
        b = ps.stochastic_round(x.clone(), torch.bfloat16, torch.tensor(key))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", precision._FP8, ids=str)
@given(params=param_trees(max_leaves=3, max_rank=3, max_side=12, dtypes=(torch.float32,)), scale=st.floats(-20, 20),
       stochastic=st.booleans(), key=_keys)
def test_blockwise_quantization_error_is_within_half_a_code_spacing_per_block(dtype, params, scale, stochastic, key):
    info = torch.finfo(dtype)
    mantissa, emin = round(-math.log2(info.eps)), round(math.log2(info.tiny))
    for x in params.values():
        x = x * 2.0**scale
        q = ps.quantize_blockwise(x, dtype, key=key if stochastic else None)
        err = (ps.dequantize_blockwise(q) - x).abs().reshape(-1)
        block_scale = q.scale.repeat_interleave(precision.BLOCK_SIZE)[: x.numel()]
        # half a spacing: 2^-(m+1) relative in the normal range, 2^(emin-m-1)·scale below it;
        # a whole spacing when rounding stochastically (plus float32 rounding of the scaling)
        half = 2.0 ** -(mantissa + 1) * x.abs().reshape(-1) + 2.0 ** (emin - mantissa - 1) * block_scale
        limit = (2 * half if stochastic else half) * (1 + 1e-5) + 1e-30
        assert (err <= limit).all(), (dtype, x.shape)


# --------------------------------------------------------------------------- #
# The kit's invariants on every low-precision option.
# --------------------------------------------------------------------------- #

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
OPTIONS = {
    "adamw_bf16_moments": (lambda: ps.adamw(1e-2, mu_dtype=BF16, nu_dtype=BF16), {}),
    "adamw_8bit_moments": (lambda: ps.adamw(1e-2, mu_dtype=FP8, nu_dtype=FP8), {}),
    "adamw_8bit_e5m2_nearest": (lambda: ps.adamw(1e-2, mu_dtype=torch.float8_e5m2, nu_dtype=FP8, rounding="nearest"), {}),
    # float16 holds at most 65504: its state meets the kit's huge (1e10) grads as inf
    "adam_fp16_mu": (lambda: ps.adam(1e-2, mu_dtype=torch.float16), dict(grad_kinds=("normal", "zeros", "tiny"))),
    "sgd_bf16_momentum": (lambda: ps.sgd(0.1, momentum=0.9, nesterov=True, accumulator_dtype=BF16), {}),
    "lion_8bit": (lambda: ps.lion(1e-3, mu_dtype=FP8), {}),
    "ademamix_bf16_8bit": (lambda: ps.ademamix(1e-2, b3=0.99, mu_dtype=BF16, nu_dtype=FP8), {}),
    "muon_bf16": (lambda: ps.muon(mu_dtype=BF16, ns_dtype=torch.float32), dict(matrices_only=True)),
    "kahan_params": (lambda: ps.chain(ps.adamw(1e-2, mu_dtype=BF16), ps.compensated_updates()), {}),
    "stochastic_params": (lambda: ps.chain(ps.sgd(0.1), ps.compensated_updates(method="stochastic")), {}),
}


@pytest.fixture
def quantize_small_leaves(monkeypatch):
    # The kit draws leaves of at most 81 elements: quantize them all, so the 8-bit path
    # (not its float32 fallback) is what the invariants see.
    monkeypatch.setattr(precision, "MIN_QUANTIZED_SIZE", 1)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_low_precision_option_keeps_the_kits_invariants(name, quantize_small_leaves):
    make, kw = OPTIONS[name]
    check_transform(make, **kw)


@pytest.mark.parametrize("name", ["adamw_8bit_moments", "kahan_params"])
def test_low_precision_option_compiles_once(name, quantize_small_leaves):
    make, kw = OPTIONS[name]
    check_transform(make, checks=(), compile=True, **kw)


def test_8bit_state_is_quantized_when_the_threshold_allows(quantize_small_leaves):
    state = ps.adamw(1e-2, mu_dtype=FP8).init({"w": torch.zeros(3)})
    assert isinstance(ps.tree_get(state, "mu")["w"], ps.QuantizedTensor)
