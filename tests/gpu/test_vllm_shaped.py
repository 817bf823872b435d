"""The op layer exactly as the vLLM plugin drives it: BF16 hidden states and int32 or
int64 top-k ids staged by `stage_inputs` (one Triton kernel), then `fp8_mega_moe`,
against the reference fed the same quantization."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.fp8 import quantize_per_token_group
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.testing import check_outputs, random_routing

from .cases import Shape
from .single_gpu import layer_and_buffer

# Qwen3-30B-A3B's expert shape (tools/e2e/models/qwen3_moe_fp8): H 2048, I 768, 128 experts, top-8.
HIDDEN, INTER, EXPERTS, TOPK, MAX_TOKENS = 2048, 768, 128, 8, 256


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator(device="cuda").manual_seed(11)
    return (*layer_and_buffer(Shape(HIDDEN, INTER, TOPK, EXPERTS, MAX_TOKENS), gen), gen)


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [MAX_TOKENS, 1, 0, 77])
def test_staged_bf16_inputs(setup, ids_dtype, num_tokens, numerics):
    layer, buf, gen = setup
    hidden_states = torch.randn(num_tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    topk_idx = random_routing(num_tokens, EXPERTS, TOPK, "uniform", "cuda", gen).to(ids_dtype)
    # vLLM's router gives softmax-normalized weights.
    topk_weights = torch.rand(num_tokens, TOPK, generator=gen, device="cuda").softmax(-1)
    n = mm.stage_inputs(buf, hidden_states, topk_idx, topk_weights)
    assert n == num_tokens
    y = torch.full((n, HIDDEN), math.nan, dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics=numerics)
    mm.ops.synchronize()
    x, x_sf = quantize_per_token_group(hidden_states)
    inputs = dict(x=x, x_sf=x_sf, topk_idx=topk_idx.long(), topk_weights=topk_weights)
    check_outputs([y], [inputs], [layer], EXPERTS, numerics)
