"""What is built for a buffer, on the GPU: a CUDA-graph capture that would build kernel
params raises (before touching the stream) and warm-up with the layer's weights makes the
same capture work, after which the buffer refuses close() until the graph is released;
closing a buffer frees its params, descriptors' device memory included (runtime
free_params), and a new buffer runs correctly afterwards; calls on one buffer from two
streams, with no wait between them, run one after another and are all right."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import check_outputs, fill_buffer, random_inputs, random_layer

HIDDEN, INTER, TOPK, EXPERTS, MAX_TOKENS = 384, 256, 4, 4, 50  # a precompiled shape (tests/gpu/cases.py)
NUM_TOKENS = 33


def _setup(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    buf = mm.get_symm_buffer(None, EXPERTS, MAX_TOKENS, TOPK, HIDDEN, INTER)
    inputs = random_inputs(NUM_TOKENS, HIDDEN, EXPERTS, TOPK, "uniform", "cuda", gen)
    return buf, gen, inputs


def _capture(call):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def test_capture_needs_the_layers_params_built_by_warmup():
    buf, gen, inputs = _setup(21)
    first, second = (random_layer(EXPERTS, HIDDEN, INTER, "cuda", gen) for _ in range(2))
    fill_buffer(buf, inputs)
    y = torch.empty(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda")
    mm.ops.warmup(buf, first.l1, first.l2, [NUM_TOKENS])
    with pytest.raises(RuntimeError, match="would build kernel parameters.*inside CUDA-graph capture"):
        _capture(lambda: mm.fp8_mega_moe(y, second.l1, second.l2, buf))
    mm.ops.warmup(buf, first.l1, first.l2, [NUM_TOKENS], other_layers=[(second.l1, second.l2)])
    graph = _capture(lambda: mm.fp8_mega_moe(y, second.l1, second.l2, buf))
    y.fill_(math.nan)
    graph.replay()
    mm.ops.synchronize()
    check_outputs([y], [inputs], [second], EXPERTS, mm.ops.resolve_numerics(None))
    with pytest.raises(RuntimeError, match="a CUDA graph captured calls on this buffer"):
        buf.close()
    del graph
    buf.close(graphs_released=True)


def test_calls_from_two_streams_run_one_after_another():
    buf, gen, inputs = _setup(24)
    layer = random_layer(EXPERTS, HIDDEN, INTER, "cuda", gen)
    fill_buffer(buf, inputs)
    mm.ops.warmup(buf, layer.l1, layer.l2, [NUM_TOKENS])
    streams = [torch.cuda.Stream() for _ in range(2)]
    ys = [torch.full((NUM_TOKENS, HIDDEN), math.nan, dtype=torch.bfloat16, device="cuda") for _ in range(40)]
    torch.cuda.synchronize()
    for i, y in enumerate(ys):  # no wait between the streams: the buffer orders its calls
        with torch.cuda.stream(streams[i % 2]):
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
    mm.ops.synchronize()
    check_outputs([ys[0]], [inputs], [layer], EXPERTS, mm.ops.resolve_numerics(None))
    for i, y in enumerate(ys[1:], 1):
        assert torch.equal(y, ys[0]), f"call {i} differs from call 0 (calls overlapped?)"


def test_close_frees_the_params_and_a_new_buffer_works():
    buf, gen, inputs = _setup(22)
    layer = random_layer(EXPERTS, HIDDEN, INTER, "cuda", gen)
    y = torch.empty(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda")
    fill_buffer(buf, inputs)
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
    mm.ops.synchronize()
    handles = list(mm.ops._launches[id(buf)].params.values())
    buf.close()
    assert id(buf) not in mm.ops._launches
    for handle in handles:  # the runtime has freed them: a second free is refused by name
        with pytest.raises(ValueError, match="already freed params handle"):
            mm.native.runtime().free_params(handle)
    with pytest.raises(ValueError, match="buf was closed"):
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
    again, _, _ = _setup(23)
    fill_buffer(again, inputs)
    y.fill_(math.nan)
    mm.fp8_mega_moe(y, layer.l1, layer.l2, again)
    mm.ops.synchronize()
    check_outputs([y], [inputs], [layer], EXPERTS, mm.ops.resolve_numerics(None))
