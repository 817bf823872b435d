"""The fused kernel on one Hopper GPU (R = 1) against the float32 reference.

Run on an H200: `python -m pytest -q -s tests/gpu`. Every output is poisoned with NaN
before the call so unwritten rows fail; inputs are fresh random draws per case.
Every test runs in both numerics modes, held to docs/design.md section 2's checks for the mode.
"""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.testing import check_outputs, fill_buffer, random_inputs
from megamoe_plugin.timing import graphed

from .cases import SHAPES
from .single_gpu import SeedStream, check_call_sequence, check_repeatable, layer_and_buffer

_seeds = SeedStream(1234)
_generator = _seeds.next_generator


@pytest.fixture(scope="module", params=SHAPES, ids=str)
def setup(request):
    s = request.param
    return (s, *layer_and_buffer(s, _generator()))


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
def test_token_counts_and_routings(setup, numerics):
    """Consecutive calls on one buffer: changing n (max, 1, 0, odd), every routing,
    clamp on/off, fast_math on/off; recv stats exact."""
    check_call_sequence(*setup, _seeds, numerics)


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
def test_repeatable(setup, numerics):
    """The same inputs three times give bit-identical outputs (a moving result is a race)."""
    check_repeatable(*setup, _seeds, numerics)


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
def test_cuda_graph_replay(setup, numerics):
    """Capture once, then replay with new inputs written into the same buffer."""
    s, layer, buf = setup
    n = s.max_tokens // 2 + 1
    y = torch.empty(n, s.hidden, dtype=torch.bfloat16, device="cuda")
    fill_buffer(buf, random_inputs(n, s.hidden, s.local_experts, s.topk, "uniform", "cuda", _generator()))
    # graphed runs the call once outside the capture first (compiles, builds descriptors).
    replay = graphed(lambda: mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics=numerics))
    for routing in ("uniform", "masked"):
        inputs = random_inputs(n, s.hidden, s.local_experts, s.topk, routing, "cuda", _generator())
        fill_buffer(buf, inputs)
        y.fill_(math.nan)
        replay()
        mm.ops.synchronize()
        check_outputs([y], [inputs], [layer], s.local_experts, numerics)


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
def test_warmup_loads_every_variant_the_token_counts_select(setup, numerics):
    """ops.warmup (run by the vLLM glue before graph capture) compiles the selected variants
    at once and loads each: afterwards no call in that range compiles or loads."""
    s, layer, buf = setup
    counts = range(s.max_tokens + 1)
    expected = {mm.ops.select_variant(buf, n, True, numerics) for n in counts}
    assert all(v.numerics == numerics for v in expected)
    assert mm.ops.warmup(buf, layer.l1, layer.l2, counts, numerics=numerics) == len(expected)
    assert all((buf.device.index, v) in mm.ops._kernels for v in expected)
