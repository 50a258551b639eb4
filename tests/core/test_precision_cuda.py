"""Low-precision state on CUDA: the same random bits as on CPU, compiled or not, and
compiled donated steps that keep their low-precision guarantees."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [BF16, torch.float16, FP8, torch.float8_e5m2], ids=str)
def test_stochastic_round_gives_the_same_bits_on_cuda_as_on_cpu_eager_and_compiled(dtype):
    x = torch.randn(3, 70_000) * 10
    key = torch.tensor(123456789)
    cpu = ps.stochastic_round(x, dtype, key)
    cuda = ps.stochastic_round(x.cuda(), dtype, key.cuda())
    compiled = torch.compile(lambda x, k: ps.stochastic_round(x, dtype, k), fullgraph=True)(x.cuda(), key.cuda())
    for got in (cuda, compiled):
        assert torch.equal(got.cpu().view(torch.uint8), cpu.view(torch.uint8))


def test_blockwise_codes_are_the_same_on_cuda_and_cpu():
    x = torch.randn(1000, 77)
    q, qc = ps.quantize_blockwise(x, key=5), ps.quantize_blockwise(x.cuda(), key=torch.tensor(5).cuda())
    assert torch.equal(q.codes.view(torch.uint8), qc.codes.cpu().view(torch.uint8))
    torch.testing.assert_close(q.scale, qc.scale.cpu())


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "8bit"])
def test_compiled_donated_adamw_with_narrow_moments_on_cuda_tracks_cpu_eager(dtype):
    opt = ps.adamw(1e-2, mu_dtype=dtype, nu_dtype=dtype)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(5)]
    cpu, state = dict(params), opt.init(params)
    for gr in grads:
        u, state = opt.update(gr, state, cpu)
        cpu = ps.apply_updates(cpu, u)
    p = {k: v.cuda() for k, v in params.items()}
    s = opt.init(p)
    update = ps.make_update(opt, compile=True, donate=True)
    for gr in grads:
        update(p, {k: v.cuda() for k, v in gr.items()}, s)
    moved = (cpu["w"] - params["w"]).abs().mean()
    # Same bits, float32 math that may fuse differently: the runs agree to a small
    # fraction of how far the params moved.
    assert (p["w"].cpu() - cpu["w"]).abs().mean() < 0.02 * moved


def test_compensated_bf16_params_on_cuda_compiled_keep_small_updates():
    opt = ps.chain(ps.sgd(1.0), ps.compensated_updates())
    p = {"w": torch.ones(4096, device="cuda", dtype=BF16)}
    s = opt.init(p)
    update = ps.make_update(opt, compile=True, donate=True)
    g = {"w": torch.full((4096,), -1e-4, device="cuda", dtype=BF16)}
    for _ in range(1000):
        update(p, g, s)
    assert (p["w"].double() - 1.1).abs().max() <= 2**-8 + 1e-4
