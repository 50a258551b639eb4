"""Low-precision state and params: stochastic rounding, mu_dtype/nu_dtype, 8-bit moments,
compensated bf16/fp16 updates, and 16-bit params with every optimizer."""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.torch
import torch
import torch.utils._pytree as pytree

import purestep.core as ps
from tests.registry import TRANSFORMS

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def _grads(params, steps, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=g).to(v.dtype) * scale for k, v in params.items()} for _ in range(steps)]


def _run(opt, params, grads_list, state=None):
    state = opt.init(params) if state is None else state
    for grads in grads_list:
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
    return params, state


def _nbytes(tree) -> int:
    """Bytes of the distinct storages behind a tree's tensors, as allocated."""
    seen = {}
    for t in pytree.tree_leaves(tree):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------------- #
# stochastic_round
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [BF16, torch.float16, FP8, torch.float8_e5m2])
def test_stochastic_round_lands_on_the_two_neighbours_with_the_right_odds(dtype):
    x = torch.tensor([1.0, -3.3, 0.0123, 100.7, 2.0**-20]).repeat_interleave(40_000).view(5, -1)
    r = ps.stochastic_round(x, dtype, key=7).float()
    down = x.to(dtype).float()  # nearest, one of the two neighbours
    for row, xs, rs, near in zip(range(5), x, r, down):
        values = rs.unique()
        assert len(values) <= 2 and (values == near[0]).any() or xs[0] == near[0], (dtype, row, values)
        # 40k Bernoulli draws: the mean is within 5 standard errors of x.
        spread = (values.max() - values.min()).item()
        bound = 5 * 0.5 * spread / 40_000**0.5 + 1e-12
        assert abs(rs.double().mean().item() - xs[0].item()) <= bound, (dtype, row)


def test_stochastic_round_is_exact_on_representable_values_and_keeps_inf_and_nan():
    x = torch.tensor([1.0, -0.5, 0.0, float("inf"), float("-inf"), float("nan"), 3.0 * 2**100])
    r = ps.stochastic_round(x, BF16, key=3)
    assert torch.equal(r[:5].float(), x[:5]) and r[5].isnan() and r[6].float().item() == 3.0 * 2**100
    assert ps.stochastic_round(torch.tensor([1e6]), FP8, key=0).float().item() == 448.0  # fp8 saturates


def test_stochastic_round_depends_only_on_the_key_and_the_element():
    x = torch.randn(10_000)
    a, b = ps.stochastic_round(x, BF16, 1), ps.stochastic_round(x.clone(), BF16, torch.tensor(1))
    c = ps.stochastic_round(x, BF16, 2)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.2  # another key, other bits


def test_stochastic_round_is_the_same_compiled_and_under_vmap():
    x = torch.randn(3, 1000)
    keys = torch.tensor([5, 6, 7])
    eager = torch.stack([ps.stochastic_round(x[i], BF16, keys[i]) for i in range(3)])
    batched = torch.func.vmap(lambda xi, k: ps.stochastic_round(xi, BF16, k))(x, keys)
    assert torch.equal(eager, batched)
    compiled = torch.compile(lambda xi, k: ps.stochastic_round(xi, torch.float16, k), fullgraph=True)
    assert torch.equal(compiled(x[0], keys[0]), ps.stochastic_round(x[0], torch.float16, keys[0]))


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_moments_round_with_the_bits_of_their_leaf_key_from_one_precomputed_seed(dtype):
    # The blocks pass one int32 seed per leaf to both moments (so compiled code hashes
    # once); the bits must still be those of the leaf's key: low 16 for mu, high 16 for nu.
    from purestep.core import _low_precision as lp

    like = lp.init_moments({"a": torch.zeros(5000), "b": torch.zeros(64, 80)}, dtype)
    count = torch.tensor(4)
    seeds = lp.moment_keys(count, "stochastic", like, like)
    assert [s.dtype for s in seeds] == [torch.int32, torch.int32]
    xs = [torch.rand(5000), torch.rand(64, 80)]  # >= 0: a second moment is stored as its square root
    for second in (False, True):
        stored = pytree.tree_leaves(lp.store_moments(xs, like, seeds, second=second), is_leaf=lp._is_quantized)
        for i, (x, m) in enumerate(zip(xs, stored)):
            key = lp.leaf_key(count, i)
            if dtype == FP8:
                want = lp.quantize_blockwise(x.sqrt() if second else x, dtype, key=key, half=int(second))
                assert torch.equal(m.codes.view(torch.uint8), want.codes.view(torch.uint8)) and torch.equal(m.scale, want.scale)
            else:
                assert torch.equal(m, lp.round_to(x, dtype, key, int(second)))


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 values at the awkward places of `dtype`'s grid, both signs: right above and
    below powers of two (where the spacing halves), around the smallest normal, in the
    subnormal range, near the largest finite value, and arbitrary ones."""
    info = torch.finfo(dtype)
    tiny, top = info.tiny, 2.0 ** math.floor(math.log2(info.max))
    ulp = 2.0**-23  # float32's, relative
    xs = [1 + ulp, 2 - ulp, 1 + 12345 * ulp, 1.5 - 7 * ulp, 3 + 3 * 2.0**-22, 1 / 3, 0.1, 5e-3]
    xs += [tiny * (1 + ulp), tiny * (1 - ulp), tiny * 0.3, tiny * 2.0**-3 * 1.37]
    xs += [top * (1 + 99 * ulp), info.max * (1 - 2.0**-12)]
    x = torch.tensor(xs, dtype=torch.float64).to(torch.float32)
    return torch.cat([x, -x])


@pytest.mark.parametrize("dtype", [BF16, torch.float16, FP8, torch.float8_e5m2])
def test_stochastic_rounding_averages_to_x_over_all_random_draws(dtype):
    # Every one of the 2^16 random draws, so the mean is exact rather than a sample: x
    # itself where the format drops at most 16 bits of float32's (bf16: 16, float16: 13);
    # within 2^-17 of a spacing for fp8 (20 dropped bits, a 16-bit threshold).
    from purestep.core import _low_precision as lp

    x = _edge_values(dtype)
    if dtype in lp._FP8:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    bits = torch.arange(2**16, dtype=torch.int32).expand(len(x), -1)
    many = x[:, None].expand(-1, 2**16).contiguous()
    r = (lp._round_bf16(many, bits) if dtype == BF16 else lp._round_grid(many, dtype, bits)).to(dtype)
    mean = r.double().mean(1)  # exact: 2^16 values of at most 11 significant bits
    if dtype in (BF16, torch.float16):
        assert torch.equal(mean, x.double()), (mean - x.double()).abs().max()
    else:
        mantissa, emin = round(-math.log2(torch.finfo(dtype).eps)), round(math.log2(torch.finfo(dtype).tiny))
        spacing = torch.exp2(torch.floor(torch.log2(x.double().abs())).clamp(min=emin) - mantissa)
        assert ((mean - x.double()).abs() <= 2.0**-17 * spacing).all()


def test_stochastic_round_refuses_a_wide_dtype():
    with pytest.raises(ValueError, match="dtype"):
        ps.stochastic_round(torch.ones(2), torch.float32, 0)


# --------------------------------------------------------------------------- #
# Block quantization.
# --------------------------------------------------------------------------- #


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain per-block oracle: each block of 256 scaled by absmax / 448 and rounded to e4m3."""
    flat = x.reshape(-1)
    codes, scales = [], []
    for start in range(0, flat.numel(), 256):
        block = flat[start : start + 256]
        scale = block.abs().max() / 448.0
        codes.append((block / scale if scale > 0 else block).to(FP8))
        scales.append(scale)
    return torch.cat(codes).view(x.shape), torch.stack(scales)


def test_quantize_blockwise_matches_a_plain_per_block_reference():
    x = torch.randn(7, 300) * torch.logspace(-3, 3, 7)[:, None]  # blocks of very different magnitude
    x[2] = 0.0
    q = ps.quantize_blockwise(x)
    codes, scales = _reference_quantize(x)
    assert q.codes.dtype == FP8 and q.codes.shape == x.shape and q.scale.shape == (-(-2100 // 256),)
    assert torch.equal(q.codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(q.scale, scales)
    back = ps.dequantize_blockwise(q)
    torch.testing.assert_close(back, codes.float() * scales.repeat_interleave(256)[:2100].view(7, 300))


def test_quantize_blockwise_refuses_a_non_fp8_dtype():
    with pytest.raises(ValueError, match="float8"):
        ps.quantize_blockwise(torch.ones(3), torch.int8)


# --------------------------------------------------------------------------- #
# mu_dtype / nu_dtype.
# --------------------------------------------------------------------------- #


def test_adam_with_bf16_mu_rounded_to_nearest_matches_optax_mu_dtype():
    params = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    grads = _grads(params, 30)
    opt = ps.adam(1e-2, mu_dtype=BF16, rounding="nearest")
    state = opt.init(params)
    # Strongly typed float32 betas, so optax does every step in float32 as we do.
    ref = optax.adam(1e-2, b1=jnp.float32(0.9), b2=jnp.float32(0.999), mu_dtype=jnp.bfloat16)
    jp = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    jstate = ref.init(jp)
    p = params
    for g in grads:
        u, state = opt.update(g, state, p)
        p = ps.apply_updates(p, u)
        ju, jstate = ref.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, jstate, jp)
        jp = optax.apply_updates(jp, ju)
    mu, nu = ps.tree_get(state, "mu"), ps.tree_get(state, "nu")
    for k in params:
        assert mu[k].dtype == BF16 and nu[k].dtype == torch.float32
        torch.testing.assert_close(p[k], torch.from_numpy(np.asarray(jp[k])), rtol=1e-5, atol=1e-6)
        their_mu = torch.from_numpy(np.asarray(jstate[0].mu[k].astype(jnp.float32)))
        torch.testing.assert_close(mu[k].float(), their_mu, rtol=1e-2, atol=1e-6)  # equal up to a rare tie
        # 1 - β₂ differs in float32 (optax) and float64 (ours) by 1.3e-5, relatively.
        torch.testing.assert_close(nu[k], torch.from_numpy(np.asarray(jstate[0].nu[k])), rtol=1e-4, atol=1e-9)


def test_bf16_moment_with_stochastic_rounding_follows_float32_where_nearest_stalls():
    # v ← 0.999·v + 0.001·g² with g = 1: in bf16 the increment drops below half an ulp
    # near v = 0.25 and round-to-nearest stops there; stochastic rounding keeps going.
    params = {"w": torch.zeros(4096)}
    grads = {"w": torch.ones(4096)}
    finals = {}
    for rounding in ("stochastic", "nearest"):
        opt = ps.scale_by_adam(nu_dtype=BF16, rounding=rounding)
        state = opt.init(params)
        for _ in range(2000):
            _, state = opt.update(grads, state)
        finals[rounding] = state.nu["w"].float()
    exact = 1 - 0.999**2000
    # Unbiased on average, and every element stays within ~7σ of its rounding noise
    # (σ ≈ 0.02 with truly random bits): the bits must change from step to step.
    assert abs(finals["stochastic"].mean().item() - exact) < 0.005
    assert (finals["stochastic"] - exact).abs().max().item() < 0.15
    assert finals["nearest"].max().item() < 0.5


def test_moments_are_stored_in_the_requested_dtype_and_small_leaves_stay_float32_when_8bit():
    params = {"big": torch.randn(64, 128), "small": torch.randn(10)}
    state = ps.adamw(1e-3, mu_dtype=FP8, nu_dtype=BF16).init(params)
    mu, nu = ps.tree_get(state, "mu"), ps.tree_get(state, "nu")
    assert isinstance(mu["big"], ps.QuantizedTensor) and mu["big"].codes.dtype == FP8
    assert mu["small"].dtype == torch.float32 and nu["big"].dtype == BF16
    assert ps.tree_get(ps.sgd(0.1, momentum=0.9, accumulator_dtype=BF16).init(params), "trace")["big"].dtype == BF16
    assert ps.tree_get(ps.lion(1e-3, mu_dtype=BF16).init(params), "mu")["big"].dtype == BF16
    assert ps.tree_get(ps.muon(mu_dtype=BF16).init({"w": torch.zeros(4, 4)}), "mu")["w"].dtype == BF16


def test_measured_state_bytes_bf16_half_8bit_about_a_quarter():
    params = {f"w{i}": torch.zeros(512, 512) for i in range(4)}
    size = {
        name: _nbytes(ps.adamw(1e-3, mu_dtype=d, nu_dtype=d).init(params)) for name, d in
        [("fp32", None), ("bf16", BF16), ("8bit", FP8)]
    }
    assert size["bf16"] / size["fp32"] == pytest.approx(0.5, abs=0.01)
    assert 0.25 <= size["8bit"] / size["fp32"] <= 0.26


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "8bit"])
def test_adamw_with_narrow_moments_tracks_float32_adamw(dtype):
    params = {"w": torch.randn(64, 96), "b": torch.randn(96)}
    grads = [{k: v + 0.1 * torch.randn_like(v) for k, v in params.items()} for _ in range(60)]  # a pull towards 0
    exact, _ = _run(ps.adamw(1e-2), params, grads)
    narrow, _ = _run(ps.adamw(1e-2, mu_dtype=dtype, nu_dtype=dtype), params, grads)
    moved = (exact["w"] - params["w"]).abs().mean()
    assert moved > 0.3
    # The gap is a small fraction of how far the params moved.
    assert (narrow["w"] - exact["w"]).abs().mean() < (0.01 if dtype == BF16 else 0.05) * moved


@pytest.mark.parametrize(
    "make",
    [
        lambda: ps.adamw(1e-2, mu_dtype=BF16, nu_dtype=FP8),
        lambda: ps.sgd(0.1, momentum=0.9, accumulator_dtype=BF16),
        lambda: ps.lion(1e-3, mu_dtype=FP8),
        lambda: ps.chain(ps.adamw(1e-2, mu_dtype=BF16), ps.compensated_updates(method="stochastic")),
    ],
    ids=["adamw", "sgd", "lion", "stochastic-params"],
)
def test_resume_from_a_saved_state_is_bitwise_identical(make, tmp_path):
    params = {"w": torch.randn(80, 64).to(BF16), "b": torch.randn(64).to(BF16)}
    grads = _grads(params, 10)
    opt = make()
    straight, _ = _run(opt, params, grads)
    half, state = _run(opt, params, grads[:5])
    leaves, spec = pytree.tree_flatten(state)
    safetensors.torch.save_file({str(i): t.contiguous() for i, t in enumerate(leaves)}, tmp_path / "s.safetensors")
    loaded = safetensors.torch.load_file(tmp_path / "s.safetensors")
    state = pytree.tree_unflatten([loaded[str(i)] for i in range(len(leaves))], spec)
    resumed, _ = _run(make(), half, grads[5:], state)
    for k in params:
        assert torch.equal(resumed[k], straight[k]), k


def test_vmapped_ensemble_with_bf16_state_equals_members_one_by_one():
    opt = ps.adamw(1e-2, mu_dtype=BF16, nu_dtype=BF16)
    params = {"w": torch.randn(3, 40, 8)}
    grads = {"w": torch.randn(3, 40, 8)}

    def step(p, g, s):
        u, s = opt.update(g, s, p)
        return ps.apply_updates(p, u), s

    states = torch.func.vmap(opt.init)(params)
    batched, _ = torch.func.vmap(step)(params, grads, states)
    for i in range(3):
        p = {"w": params["w"][i]}
        one, _ = step(p, {"w": grads["w"][i]}, opt.init(p))
        torch.testing.assert_close(batched["w"][i], one["w"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: ps.adam(1e-3, mu_dtype=torch.int8), "mu_dtype"),
        (lambda: ps.adamw(1e-3, nu_dtype="bf16"), "nu_dtype"),
        (lambda: ps.sgd(0.1, momentum=0.9, accumulator_dtype=torch.int32), "accumulator_dtype"),
        (lambda: ps.lion(1e-3, rounding="up"), "rounding"),
        (lambda: ps.muon(mu_dtype=torch.complex64), "mu_dtype"),
        (lambda: ps.compensated_updates(method="exact"), "method"),
    ],
)
def test_bad_precision_options_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


# --------------------------------------------------------------------------- #
# compensated_updates: bf16/fp16 params without drift.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_small_updates_accumulate_with_compensation_and_vanish_without(dtype):
    start = {"w": torch.ones(4096, dtype=dtype)}
    grads = {"w": torch.full((4096,), -1e-4, dtype=dtype)}  # 1e-4 < half an ulp of 1.0 in both
    finals = {}
    for name, opt in {
        "plain": ps.sgd(1.0),
        "kahan": ps.chain(ps.sgd(1.0), ps.compensated_updates()),
        "stochastic": ps.chain(ps.sgd(1.0), ps.compensated_updates(method="stochastic")),
    }.items():
        finals[name], _ = _run(opt, start, [grads] * 1000)
    assert torch.equal(finals["plain"]["w"], start["w"])
    ulp = torch.finfo(dtype).eps  # the spacing in [1, 2)
    assert (finals["kahan"]["w"].double() - 1.1).abs().max() <= ulp / 2 + 1e-4
    # Each element is a random walk of 1000 Bernoulli steps of one ulp (std <= √250 ulp);
    # the mean of 4096 of them is within 5 standard errors of 1.1.
    assert abs(finals["stochastic"]["w"].double().mean() - 1.1) < 5 * 250**0.5 / 64 * ulp + 1e-4


def test_bf16_params_with_compensation_stay_within_an_ulp_of_the_float32_run():
    low = {"w": torch.randn(50, 40).to(BF16), "b": torch.randn(40).to(BF16)}
    grads = _grads(low, 200, scale=0.1)
    exact, _ = _run(ps.adamw(1e-4), {k: v.float() for k, v in low.items()}, [ps.tree_cast(g, torch.float32) for g in grads])
    kahan, state = _run(ps.chain(ps.adamw(1e-4), ps.compensated_updates()), low, grads)  # tiny steps: bf16's hard case
    plain, _ = _run(ps.adamw(1e-4), low, grads)
    for k in low:
        moved = (exact[k] - low[k].float()).abs().mean()
        # p + c follows the float32 run up to the bf16 rounding of each update (the updates
        # reach this transform in the params' dtype); p is p + c rounded to bf16.
        with_c = kahan[k].float() + ps.tree_get(state, "compensation")[k].float()
        assert (with_c - exact[k]).abs().mean() < 0.05 * moved
        up, down = (torch.nextafter(kahan[k], torch.tensor(v, dtype=BF16)).float() for v in (float("inf"), -float("inf")))
        half_ulp = torch.maximum(up - kahan[k].float(), kahan[k].float() - down) / 2
        assert ((kahan[k].float() - with_c).abs() <= half_ulp).all()
        # Without compensation most of the movement is lost.
        assert (plain[k].float() - exact[k]).abs().mean() > 0.5 * moved


def test_compensated_updates_compiled_and_donated_match_eager():
    torch.manual_seed(0)  # its own data, whatever ran before it
    opt = ps.chain(ps.adamw(1e-3), ps.compensated_updates())
    params = {"w": torch.randn(64, 32).to(BF16)}
    grads = _grads(params, 4)
    eager, eager_state = _run(opt, params, grads)
    update = ps.make_update(opt, compile=True, donate=True)
    p = {k: v.clone() for k, v in params.items()}
    state = opt.init(p)
    for g in grads:
        update(p, g, state)
    # Compiled code keeps the update in float32 where eager rounds it to bf16 between
    # transforms, so the two differ by that rounding (~1e-5 here), but the compensation
    # must survive compilation (inductor may drop a plain bf16 round trip: 4e-3 then).
    ulp = 2.0**-7 * p["w"].float().abs().clamp(min=1e-3)
    assert ((p["w"].float() - eager["w"].float()).abs() <= ulp).all()
    c, c_eager = ps.tree_get(state, "compensation")["w"].float(), ps.tree_get(eager_state, "compensation")["w"].float()
    assert (p["w"].float() + c - eager["w"].float() - c_eager).abs().max() < 2e-4


def test_compensated_updates_pass_wide_params_through_and_need_params():
    t = ps.compensated_updates()
    p = {"a": torch.ones(3), "b": torch.ones(3, dtype=torch.float64)}
    state = t.init(p)
    assert all(c.numel() == 0 for c in state.compensation.values())
    u = {"a": torch.full((3,), 0.5), "b": torch.full((3,), 0.25, dtype=torch.float64)}
    out, _ = t.update(u, state, p)
    assert out["a"] is u["a"] and out["b"] is u["b"]
    with pytest.raises(ValueError, match="needs params"):
        t.update(u, state)


# --------------------------------------------------------------------------- #
# 16-bit params with every optimizer (issue 13): the math runs in float32.
# --------------------------------------------------------------------------- #

_VECTOR_OK = sorted(n for n, c in TRANSFORMS.items() if not c.matrices_only)


@pytest.mark.parametrize("name", _VECTOR_OK + ["muon"])
def test_float16_params_stay_finite_with_zero_tiny_and_normal_grads(name):
    case = TRANSFORMS[name]
    shapes = {"w": (4, 3), "v": (5, 2)} if case.matrices_only else {"w": (4, 3), "b": (3,)}
    params = {k: torch.randn(s).half() for k, s in shapes.items()}
    opt = case.make()
    state = opt.init(params)
    for scale in (0.0, 1e-4, 1.0, 0.0):
        grads = {k: (torch.randn(v.shape) * scale).half() for k, v in params.items()}
        extra = {n: {k: g.abs() for k, g in grads.items()} for n in case.extra_trees}
        updates, state = opt.update(grads, state, params if case.needs_params else None, **extra)
        assert all(torch.isfinite(u).all() and u.dtype == torch.float16 for u in updates.values()), (name, scale)
        params = ps.apply_updates(params, updates)


def test_float16_adamw_is_the_float32_step_rounded_back():
    params = {"w": torch.randn(30, 20)}
    grads = _grads(params, 20)
    ref = {"w": torch.nn.Parameter(params["w"].half().float())}
    torch_opt = torch.optim.AdamW(ref.values(), lr=1e-2, foreach=False)
    ours, state = _run(ps.adamw(1e-2), {"w": params["w"].half()}, [{"w": g["w"].half()} for g in grads])
    for g in grads:
        ref["w"].grad = g["w"].half().float()
        torch_opt.step()
        with torch.no_grad():
            ref["w"].copy_(ref["w"].half().float())  # the fp16 param, rounded back after each step
    assert ps.tree_get(state, "nu")["w"].dtype == torch.float32  # float16 cannot hold g²
    # Equal up to the rounding of the update itself to float16 before it is added.
    torch.testing.assert_close(ours["w"].float(), ref["w"].detach(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "8bit"])
def test_compiled_donated_update_with_narrow_moments_tracks_eager(dtype):
    # bf16 moments run on make_update's flat buffers; 8-bit ones (per-leaf blocks) on its per-leaf path.
    opt = ps.adamw(1e-2, mu_dtype=dtype, nu_dtype=dtype)
    params = {"w": torch.randn(64, 80), "v": torch.randn(80, 64)}
    grads = _grads(params, 4)
    eager, _ = _run(opt, params, grads)
    p = {k: v.clone() for k, v in params.items()}
    state = opt.init(p)
    update = ps.make_update(opt, compile=True, donate=True)
    for g in grads:
        update(p, g, state)
    assert isinstance(ps.tree_get(state, "mu")["w"], ps.QuantizedTensor if dtype == FP8 else torch.Tensor)
    for k in params:
        moved = (eager[k] - params[k]).abs().mean()
        assert (p[k] - eager[k]).abs().mean() < 0.02 * moved


def test_the_roundings_without_bit_views_equal_the_bit_ones(monkeypatch):
    # Under vmap on a torch whose `view(dtype)` has no batching rule (before 2.12), the same
    # roundings run arithmetically (`compat.VMAP_BITCASTS`): bit for bit the same values.
    from purestep.core import _compat as compat
    from purestep.core import _low_precision as lp

    g = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.randint(-40, 39, (20000,), generator=g).float()
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-40, -1e-45, 1.1754944e-38]
    x = torch.cat([torch.randn(20000, generator=g) * scales, torch.tensor(special)])
    bits = torch.randint(0, 65536, x.shape, generator=g, dtype=torch.int32)
    cases = [(torch.bfloat16, bits), (torch.bfloat16, None)] + [
        (d, b) for d in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2) for b in (bits, None)
    ]
    with_bits = [lp._round_bf16(x, b) if d == torch.bfloat16 else lp._round_grid(x, d, b) for d, b in cases]
    monkeypatch.setattr(compat, "VMAP_BITCASTS", False)
    monkeypatch.setattr(compat, "under_vmap", lambda: True)
    assert not lp._bit_views()
    for (d, b), want in zip(cases, with_bits):
        got = lp._round_bf16(x, b) if d == torch.bfloat16 else lp._round_grid(x, d, b)
        same = (got == want) | (got.isnan() & want.isnan())
        assert bool(same.all()) and torch.equal(torch.signbit(got), torch.signbit(want)), (d, b is None)
