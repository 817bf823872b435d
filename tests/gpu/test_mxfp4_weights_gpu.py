"""The fused kernel on MXFP4 expert weights read at 4 bits (csrc/megamoe/fp4_weights.cuh), fast
numerics: against the exact reference on the dequantized weights and against the FP8-tensor-core
reference on the values the kernel folds them into (docs/design.md section 2). Weights have LLM-like
spreads of group scales, within and beyond the 2^14 span that folds exactly; outputs are poisoned
with NaN first.

- One rank: token counts 0..max and every routing, bit-identical repeats, CUDA graph replay.
- Every MXFP4 tier forced with MEGAMOE_BLOCK_M (tests/gpu/test_forced_tiers.py's call sequence:
  clamp, fast_math, recv stats), on pools too small for the call (pool windows: bit for bit the
  whole pools' rows) and on the default pools.
- R = 2 and 4 ranks side by side on one GPU (tests/gpu/multi_rank.py): the cross-rank protocol with
  MXFP4 weights."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import check_outputs, fill_buffer, random_inputs, random_mxfp4_layer
from megamoe_plugin.timing import graphed

from .cases import FORCED_TIER_SHAPES, MXFP4_SHAPES, WINDOW_POOL_ROWS, WINDOW_SHAPES, mxfp4_tiers
from .multi_rank import MULTI_RANK_SHAPES, run_local
from .single_gpu import SeedStream, check_call_sequence, check_repeatable, run

_seeds = SeedStream(4321)


@pytest.fixture(scope="module", params=MXFP4_SHAPES, ids=str)
def setup(request):
    s = request.param
    torch.cuda.empty_cache()
    buf = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate)
    return (s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate), buf


def _call(buf, layer, inputs):
    n = fill_buffer(buf, inputs)
    y = torch.full((n, buf.hidden), math.nan, dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics="fast")
    mm.ops.synchronize()
    return y


@pytest.mark.parametrize("wide_groups", [False, True], ids=["span<=2^14", "wider"])
def test_token_counts_and_routings(setup, wide_groups):
    (experts, max_tokens, topk, hidden, inter), buf = setup
    layer = random_mxfp4_layer(experts, hidden, inter, "cuda", _seeds.next_generator(), wide_groups)
    for n, routing in ((max_tokens, "uniform"), (1, "uniform"), (0, "uniform"), (33, "masked"),
                       (max_tokens - 1, "one_expert"), (17, "half_empty")):
        inputs = random_inputs(n, hidden, experts, topk, routing, "cuda", _seeds.next_generator())
        check_outputs([_call(buf, layer, inputs)], [inputs], [layer], experts, "fast")


def test_repeatable_and_graph_replay(setup):
    (experts, max_tokens, topk, hidden, inter), buf = setup
    layer = random_mxfp4_layer(experts, hidden, inter, "cuda", _seeds.next_generator())
    inputs = random_inputs(max_tokens, hidden, experts, topk, "uniform", "cuda", _seeds.next_generator())
    first = _call(buf, layer, inputs)
    for _ in range(2):
        assert torch.equal(_call(buf, layer, inputs), first)  # a moving result is a race
    n = max_tokens // 2 + 1
    y = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    fill_buffer(buf, random_inputs(n, hidden, experts, topk, "uniform", "cuda", _seeds.next_generator()))
    replay = graphed(lambda: mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics="fast"))
    for routing in ("uniform", "masked"):
        inputs = random_inputs(n, hidden, experts, topk, routing, "cuda", _seeds.next_generator())
        fill_buffer(buf, inputs)
        y.fill_(math.nan)
        replay()
        mm.ops.synchronize()
        check_outputs([y], [inputs], [layer], experts, "fast")


def test_exact_numerics_are_refused_by_name(setup):
    (experts, max_tokens, topk, hidden, inter), buf = setup
    layer = random_mxfp4_layer(experts, hidden, inter, "cuda", _seeds.next_generator())
    inputs = random_inputs(4, hidden, experts, topk, "uniform", "cuda", _seeds.next_generator())
    n = fill_buffer(buf, inputs)
    y = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="MXFP4 expert weights run in fast numerics only"):
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics="exact")


@pytest.mark.parametrize("block_m", mxfp4_tiers())
@pytest.mark.parametrize("s", FORCED_TIER_SHAPES, ids=str)
def test_forced_tier(s, block_m, monkeypatch):
    torch.cuda.empty_cache()
    layer = random_mxfp4_layer(s.local_experts, s.hidden, s.intermediate, "cuda", _seeds.next_generator())
    buf = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate)
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    assert mm.ops.select_variant(buf, s.max_tokens, True, "fast", weights="mxfp4").block_m == block_m
    check_call_sequence(s, layer, buf, _seeds, "fast", label=f" MXFP4 BLOCK_M {block_m}")
    check_repeatable(s, layer, buf, _seeds, "fast")


@pytest.mark.parametrize("block_m", mxfp4_tiers())
def test_pool_windows(block_m, monkeypatch):
    s = WINDOW_SHAPES[0]
    torch.cuda.empty_cache()
    layer = random_mxfp4_layer(s.local_experts, s.hidden, s.intermediate, "cuda", _seeds.next_generator())
    whole = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate)
    windowed = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate,
                                  pool_rows=WINDOW_POOL_ROWS)
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    variant = mm.ops.select_variant(windowed, s.max_tokens, True, "fast", weights="mxfp4")
    assert variant.block_m == block_m and variant.windowed
    for n, routing in ((s.max_tokens, "one_expert"), (s.max_tokens, "uniform"), (s.max_tokens // 3, "half_empty")):
        inputs = random_inputs(n, s.hidden, s.local_experts, s.topk, routing, "cuda", _seeds.next_generator())
        y_windowed, y_whole = run(windowed, layer, inputs, "fast")[0], run(whole, layer, inputs, "fast")[0]
        check_outputs([y_windowed], [inputs], [layer], s.local_experts, "fast")
        assert torch.equal(y_windowed.view(torch.int16), y_whole.view(torch.int16)), (
            f"n={n} {routing}: the windowed pools' rows differ from the whole pool's")


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("shape", MULTI_RANK_SHAPES, ids=lambda s: f"H{s[0]}-I{s[1]}-K{s[2]}-El{s[3]}")
def test_ranks_side_by_side(num_ranks, shape):
    results = run_local(num_ranks, shape, "fast", make_layer=random_mxfp4_layer)
    failures = [f"step {s} rank {r}: {e}" for s, r, _, e in results if e is not None]
    assert not failures, "\n".join(failures)
