"""Shared experts in the call, on the GPU: the kernel runs a buffer's shared experts as local
experts that every local token's extra slots name (tests/test_shared_experts.py checks that this
view of a call is, in the reference, bit for bit routed + shared). Judged as every call is
(testing.output_errors) on that view, in both numerics modes: on one rank (0, 1, odd and the most
tokens, eager and replayed from a CUDA graph) and on 2, 4 and 8 ranks side by side."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import output_errors, random_inputs, random_layer, staged_inputs, with_shared_experts

HIDDEN, INTER = 384, 256  # kernel shapes tests/gpu/cases.py precompiles: K 4, E 4 on one rank; K 2, E 4 R per rank
SIDE_BY_SIDE = dict(local_routed=3, topk=1, max_tokens=16)  # tests/gpu/cases.py precompiles its R = 2, 4, 8


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_one_rank_returns_routed_plus_shared(numerics):
    gen = torch.Generator(device="cuda").manual_seed(31)
    routed_experts, topk, max_tokens = 3, 3, 50
    buf = mm.get_symm_buffer(None, routed_experts, max_tokens, topk, HIDDEN, INTER, num_shared_experts=1)
    layer = with_shared_experts(random_layer(routed_experts, HIDDEN, INTER, "cuda", gen),
                    random_layer(1, HIDDEN, INTER, "cuda", gen).checkpoint)
    counts = (0, 1, 7, 21, max_tokens)
    mm.ops.warmup(buf, layer.l1, layer.l2, counts, numerics=numerics)
    for step, n in enumerate(counts * 2):
        inputs = random_inputs(n, HIDDEN, routed_experts, topk, ("uniform", "masked", "one_expert")[step % 3], "cuda",
                               gen)
        assert mm.stage_inputs(buf, inputs["hidden_states"], inputs["topk_idx"], inputs["topk_weights"],
                               shared_scale=(1.0, 0.625)[step % 2]) == n
        y = torch.full((n, HIDDEN), math.nan, dtype=torch.bfloat16, device="cuda")
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics=numerics)
        mm.ops.synchronize()
        assert output_errors([y], [staged_inputs(buf, n)], [layer], buf.shape.num_experts, numerics) == [None], n


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_a_graph_replays_routed_plus_shared_on_new_inputs(numerics):
    """stage_inputs + fp8_mega_moe captured once with the shared experts, replayed on new tokens."""
    gen = torch.Generator(device="cuda").manual_seed(33)
    routed_experts, topk, n = 3, 3, 21
    buf = mm.get_symm_buffer(None, routed_experts, 50, topk, HIDDEN, INTER, num_shared_experts=1)
    layer = with_shared_experts(random_layer(routed_experts, HIDDEN, INTER, "cuda", gen),
                    random_layer(1, HIDDEN, INTER, "cuda", gen).checkpoint)
    mm.ops.warmup(buf, layer.l1, layer.l2, [n], numerics=numerics)
    first = random_inputs(n, HIDDEN, routed_experts, topk, "uniform", "cuda", gen)
    hidden, idx, weights = (first[k].clone() for k in ("hidden_states", "topk_idx", "topk_weights"))
    y = torch.full((n, HIDDEN), math.nan, dtype=torch.bfloat16, device="cuda")

    def call():
        mm.stage_inputs(buf, hidden, idx, weights, shared_scale=0.4)
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics=numerics)

    call()  # eager first: the capture then records a warm call
    mm.ops.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for step in range(3):
        new = random_inputs(n, HIDDEN, routed_experts, topk, ("uniform", "masked", "one_expert")[step], "cuda", gen)
        hidden.copy_(new["hidden_states"]), idx.copy_(new["topk_idx"]), weights.copy_(new["topk_weights"])
        y.fill_(math.nan)
        graph.replay()
        mm.ops.synchronize()
        assert output_errors([y], [staged_inputs(buf, n)], [layer], buf.shape.num_experts, numerics) == [None], step


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_ranks_side_by_side_return_routed_plus_shared(numerics, ranks):
    gen = torch.Generator(device="cuda").manual_seed(32 + ranks)
    local_routed, topk, max_tokens = SIDE_BY_SIDE["local_routed"], SIDE_BY_SIDE["topk"], SIDE_BY_SIDE["max_tokens"]
    bufs = mm.buffer.get_local_rank_buffers(ranks, ranks * local_routed, max_tokens, topk, HIDDEN, INTER,
                                            num_shared_experts=1)
    shared = random_layer(1, HIDDEN, INTER, "cuda", gen).checkpoint  # replicated on every rank
    layers = [with_shared_experts(random_layer(local_routed, HIDDEN, INTER, "cuda", gen), shared) for _ in range(ranks)]
    streams = [torch.cuda.Stream() for _ in range(ranks)]
    for buf, layer in zip(bufs, layers):
        mm.ops.warmup(buf, layer.l1, layer.l2, [max_tokens], numerics=numerics)
    for step in range(6):
        # every rank's count in turn: the most, odd ones, and none
        counts = [max_tokens if (r + step) % 2 == 0 else max(0, max_tokens // 2 - 3 * r) for r in range(ranks)]
        inputs = [random_inputs(n, HIDDEN, ranks * local_routed, topk, ("uniform", "masked")[step % 2], "cuda", gen)
                  for n in counts]
        ys = []
        for buf, rank_inputs in zip(bufs, inputs):
            mm.stage_inputs(buf, rank_inputs["hidden_states"], rank_inputs["topk_idx"], rank_inputs["topk_weights"])
            ys.append(torch.full((rank_inputs["x"].shape[0], HIDDEN), math.nan, dtype=torch.bfloat16, device="cuda"))
        torch.cuda.synchronize()
        for buf, layer, y, stream in zip(bufs, layers, ys, streams):
            with torch.cuda.stream(stream):
                mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, config_num_tokens=max_tokens, numerics=numerics)
        mm.ops.synchronize()
        views = [staged_inputs(buf, n) for buf, n in zip(bufs, counts)]
        assert output_errors(ys, views, layers, bufs[0].shape.num_experts, numerics) == [None] * ranks, step
