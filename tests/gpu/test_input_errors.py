"""Invalid input the kernel meets on the device ends in a Python ValueError, never in a
silent wrong answer: an expert id outside [-1, E) is dropped by the kernel and reported
at the next fp8_mega_moe call (before it launches) or by ops.synchronize()."""
import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer

HIDDEN, INTER, TOPK, EXPERTS, MAX_TOKENS = 384, 256, 4, 4, 50  # a precompiled shape (tests/gpu/cases.py)
MESSAGE = r"topk_idx held an expert id outside \[-1, num_experts\)"


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator(device="cuda").manual_seed(11)
    buf = mm.get_symm_buffer(None, EXPERTS, MAX_TOKENS, TOPK, HIDDEN, INTER)
    layer = random_layer(EXPERTS, HIDDEN, INTER, "cuda", gen)
    inputs = random_inputs(21, HIDDEN, EXPERTS, TOPK, "masked", "cuda", gen)
    return buf, layer, inputs


def _run(buf, layer, inputs):
    fill_buffer(buf, inputs)
    y = torch.full((inputs["x"].shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
    return y


def _with_expert_id(inputs, value):
    bad = dict(inputs)
    bad["topk_idx"] = inputs["topk_idx"].clone()
    bad["topk_idx"][7, 2] = value
    return bad


def test_masked_slots_are_not_errors(setup):
    buf, layer, inputs = setup
    assert (inputs["topk_idx"] == -1).any()
    _run(buf, layer, inputs)
    mm.ops.synchronize()
    _run(buf, layer, inputs)
    mm.ops.synchronize()


@pytest.mark.parametrize("value", [EXPERTS, EXPERTS + 1000, -2, -(2 ** 40)])
def test_bad_expert_id_raises_at_the_next_call_then_clears(setup, value):
    buf, layer, inputs = setup
    good = _run(buf, layer, inputs).clone()
    mm.ops.synchronize()
    _run(buf, layer, _with_expert_id(inputs, value))
    torch.cuda.synchronize()  # plain torch: the error waits for the next megamoe call
    with pytest.raises(ValueError, match=MESSAGE):
        _run(buf, layer, inputs)
    # The error is reported once; the buffer and the kernel are fine afterwards.
    again = _run(buf, layer, inputs)
    mm.ops.synchronize()
    assert torch.equal(again, good)


def test_bad_expert_id_raises_in_synchronize(setup):
    buf, layer, inputs = setup
    _run(buf, layer, _with_expert_id(inputs, EXPERTS))
    with pytest.raises(ValueError, match=MESSAGE):
        mm.ops.synchronize()
    mm.ops.synchronize()
