"""The swap-AB decode tiers (BLOCK_M 8, 16, 32: tokens on the WGMMA N side), forced with
MEGAMOE_BLOCK_M, against the float32 reference like tests/gpu/test_kernel.py: changing
token counts on one buffer, every routing (one_expert gives many token blocks per expert),
an H that is an odd multiple of 128, clamp and fast_math, bit-identical repeats."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.reference import check_close
from megamoe_plugin.testing import L1_NUMERICS, fill_buffer, random_inputs, random_layer, reference_outputs

from .cases import SWAP_SHAPES, SWAP_TIERS
from .seeds import SeedStream

_generator = SeedStream(4321).next_generator


@pytest.fixture(scope="module", params=SWAP_SHAPES, ids=str)
def setup(request):
    s = request.param
    torch.cuda.empty_cache()
    layer = random_layer(s.local_experts, s.hidden, s.intermediate, "cuda", _generator())
    buf = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate)
    return s, layer, buf


def _run(buf, layer, inputs, clamp=None, fast_math=True):
    n = fill_buffer(buf, inputs)
    y = torch.full((n, buf.hidden), math.nan, dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, activation_clamp=clamp, fast_math=fast_math)
    mm.ops.synchronize()
    return y


@pytest.mark.parametrize("numerics", L1_NUMERICS)
@pytest.mark.parametrize("block_m", SWAP_TIERS)
def test_swap_tier(setup, block_m, numerics, monkeypatch):
    s, layer, buf = setup
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    assert mm.ops.select_variant(buf, s.max_tokens, True).block_m == block_m
    plan = [
        (s.max_tokens, "uniform", None, True),
        (1, "uniform", None, True),
        (0, "uniform", None, True),
        (s.max_tokens // 2 | 1, "masked", 3.0, True),
        (s.max_tokens, "one_expert", None, False),
        (max(1, s.max_tokens - 3), "half_empty", 2.0, True),
    ]
    for n, routing, clamp, fast_math in plan:
        inputs = random_inputs(n, s.hidden, s.local_experts, s.topk, routing, "cuda", _generator())
        y = _run(buf, layer, inputs, clamp, fast_math)
        ref = reference_outputs([inputs], [layer], s.local_experts, activation_clamp=clamp, l1_numerics=numerics)[0]
        print(f"\n  {s} BLOCK_M {block_m} n={n} {routing} clamp={clamp} fast_math={fast_math}", end="")
        check_close(y, ref)


@pytest.mark.parametrize("block_m", SWAP_TIERS)
def test_swap_tier_repeatable(setup, block_m, monkeypatch):
    s, layer, buf = setup
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    inputs = random_inputs(s.max_tokens, s.hidden, s.local_experts, s.topk, "uniform", "cuda", _generator())
    outs = [_run(buf, layer, inputs) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "outputs differ between identical calls"
