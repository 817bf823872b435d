"""Issue 15 item 2: R = 2 EP ranks side by side on one GPU through the op path the vLLM
plugin drives, which neither tests/gpu/test_vllm_shaped.py (one rank) nor
tests/gpu/test_multi_rank_local.py (pre-quantized inputs written straight into the
buffers, then mm.fp8_mega_moe) covers:

- BF16 hidden states, int32 router ids and softmax weights staged by `stage_inputs`
  (the Triton kernel), then the registered op `torch.ops.megamoe.fp8_mega_moe`: exactly
  `megamoe_plugin.serving.run_kernel`, which vllm_plugin.executor.run_kernel binds;
- every rank with its own token count (DP: one rank idle, uneven, equal) while both
  choose the kernel variant by the max over the ranks, as the plugin does from vLLM's
  DP metadata (tests/vllm_plugin/test_vllm_dp_ep.py checks that part inside vLLM on the CPU);
- eager calls, then per-rank CUDA graphs replayed side by side (vLLM captures each
  DP rank's decode graphs with the batch padded to the same size on every rank).

Each rank runs on its own stream and half the SMs (buffer.get_local_rank_buffers), the
two ranks' work launched before anything waits.
"""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin import serving
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.testing import output_errors, random_inputs, random_layer

from .multi_rank import MULTI_RANK_SHAPES

NUM_RANKS = 2
ROUTINGS = ("uniform", "masked", "half_empty", "one_expert")
# (hidden, intermediate, topk, local experts, max tokens per rank) and the per-rank token
# counts of each eager step.
SHAPES = {
    # tests.gpu.cases precompiles this one at R = 2 on 66 SMs (the side-by-side test's shape)
    "small": (MULTI_RANK_SHAPES[1][:5], [(3, 40), (0, 64), (64, 1), (17, 17)]),
    # the e2e model's MoE layer (Qwen3-30B-A3B: 128 experts, top-8) as DP2 + EP2 splits it
    "e2e_dp2": ((2048, 768, 8, 64, 256), [(3, 200), (0, 256), (256, 1), (77, 77)]),
}


def _world(shape, seed):
    hidden, inter, topk, local_experts, max_tokens = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layers = [random_layer(local_experts, hidden, inter, "cuda", gen) for _ in range(NUM_RANKS)]
    bufs = mm.buffer.get_local_rank_buffers(NUM_RANKS, local_experts * NUM_RANKS, max_tokens, topk, hidden, inter)
    return layers, bufs, gen


def _plugin_inputs(inputs):
    """What vLLM hands the experts: BF16 hidden states, the router's int32 ids, float32 weights."""
    return inputs["hidden_states"], inputs["topk_idx"].to(torch.int32), inputs["topk_weights"]


def _launch(bufs, layers, streams, ys, plugin_inputs, numerics, config_tokens):
    for buf, layer, y, stream, (hs, ids, weights) in zip(bufs, layers, ys, streams, plugin_inputs):
        with torch.cuda.stream(stream):
            serving.run_kernel(y, hs, ids, weights, layer.l1, layer.l2, buf, None, numerics,
                               rank_equal_num_tokens=lambda n: config_tokens)


def _check(ys, inputs, layers, num_experts, numerics, what):
    errors = output_errors(ys, inputs, layers, num_experts, numerics)
    failures = [f"{what} rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_two_ranks_through_the_plugin_op_path(shape_name, numerics):
    shape, steps = SHAPES[shape_name]
    hidden, _, topk, local_experts, max_tokens = shape
    num_experts = local_experts * NUM_RANKS
    layers, bufs, gen = _world(shape, seed=15)
    streams = [torch.cuda.Stream() for _ in range(NUM_RANKS)]
    for buf, layer in zip(bufs, layers):  # every variant 0..max tokens can select, before any call
        mm.ops.warmup(buf, layer.l1, layer.l2, range(max_tokens + 1), numerics=numerics)

    # Eager steps: each rank its own count, the variant by the max.
    for step, counts in enumerate(steps):
        inputs = [random_inputs(n, hidden, num_experts, topk, ROUTINGS[step % 4], "cuda", gen) for n in counts]
        ys = [torch.full((n, hidden), math.nan, dtype=torch.bfloat16, device="cuda") for n in counts]
        torch.cuda.synchronize()
        _launch(bufs, layers, streams, ys, [_plugin_inputs(i) for i in inputs], numerics, max(counts))
        mm.ops.synchronize()
        _check(ys, inputs, layers, num_experts, numerics, f"{shape_name} {numerics} eager step {step} {counts}:")

    # CUDA graphs: both ranks padded to one size, captured per rank on its own stream
    # (capture runs nothing, so neither waits for the other), replayed side by side.
    padded = steps[0][1]
    static = [_plugin_inputs(random_inputs(padded, hidden, num_experts, topk, "uniform", "cuda", gen))
              for _ in range(NUM_RANKS)]
    ys = [torch.full((padded, hidden), math.nan, dtype=torch.bfloat16, device="cuda") for _ in range(NUM_RANKS)]
    graphs = [torch.cuda.CUDAGraph() for _ in range(NUM_RANKS)]
    torch.cuda.synchronize()
    for r, graph in enumerate(graphs):
        with torch.cuda.graph(graph, stream=streams[r]):
            _launch(bufs[r:r + 1], layers[r:r + 1], streams[r:r + 1], ys[r:r + 1], static[r:r + 1], numerics,
                    padded)
    for replay in range(2):
        inputs = [random_inputs(padded, hidden, num_experts, topk, ROUTINGS[replay], "cuda", gen)
                  for _ in range(NUM_RANKS)]
        for (hs, ids, weights), new in zip(static, inputs):
            hs.copy_(new["hidden_states"])
            ids.copy_(new["topk_idx"])
            weights.copy_(new["topk_weights"])
        for y in ys:
            y.fill_(math.nan)
        torch.cuda.synchronize()
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
        mm.ops.synchronize()
        _check(ys, inputs, layers, num_experts, numerics, f"{shape_name} {numerics} graph replay {replay}:")
