"""The fused kernel on MXFP4 expert weights read at 4 bits (csrc/megamoe/fp4_weights.cuh), one GPU,
fast numerics: against the exact reference on the dequantized weights and against the FP8-tensor-core
reference on the values the kernel folds them into (docs/design.md section 2). Weights have LLM-like
spreads of group scales, within and beyond the 2^14 span that folds exactly; outputs are poisoned
with NaN first."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import check_outputs, fill_buffer, random_inputs, random_mxfp4_layer
from megamoe_plugin.timing import graphed

from .single_gpu import SeedStream

_seeds = SeedStream(4321)

# (local experts, max tokens, top-k, H, I)
FP4_SHAPES = ((8, 64, 4, 384, 256), (32, 128, 6, 4096, 2048))


@pytest.fixture(scope="module", params=FP4_SHAPES, ids=lambda s: "E{}_T{}_K{}_H{}_I{}".format(*s))
def setup(request):
    experts, max_tokens, topk, hidden, inter = request.param
    torch.cuda.empty_cache()
    buf = mm.get_symm_buffer(None, experts, max_tokens, topk, hidden, inter)
    return request.param, buf


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
