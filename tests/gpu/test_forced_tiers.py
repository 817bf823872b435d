"""Every tile tier of each numerics mode (swap-AB BLOCK_M 8, 16, 32; 64; fast mode's cooperative
128), forced with MEGAMOE_BLOCK_M, through the same checks as tests/gpu/test_kernel.py:
changing token counts on one buffer, every routing (one_expert gives many token blocks per
expert), an H that is an odd multiple of 128, clamp and fast_math, bit-identical repeats."""
import pytest

import megamoe_plugin as mm

from .cases import FORCED_TIER_SHAPES, FORCED_TIERS
from .single_gpu import SeedStream, check_call_sequence, check_repeatable, layer_and_buffer

_seeds = SeedStream(4321)


@pytest.fixture(scope="module", params=FORCED_TIER_SHAPES, ids=str)
def setup(request):
    s = request.param
    return (s, *layer_and_buffer(s, _seeds.next_generator()))


@pytest.mark.parametrize("numerics, block_m", FORCED_TIERS)
def test_forced_tier(setup, block_m, numerics, monkeypatch):
    s, _, buf = setup
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    assert mm.ops.select_variant(buf, s.max_tokens, True, numerics).block_m == block_m
    check_call_sequence(*setup, _seeds, numerics, label=f" BLOCK_M {block_m}")


@pytest.mark.parametrize("numerics, block_m", FORCED_TIERS)
def test_forced_tier_repeatable(setup, block_m, numerics, monkeypatch):
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    check_repeatable(*setup, _seeds, numerics)
