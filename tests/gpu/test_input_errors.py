"""Invalid input the kernel meets on the device ends in a Python ValueError and an ERROR log
line, never in a silent wrong answer: an expert id outside [-1, E) is dropped by the
kernel and counted in host-mapped memory; the watchdog logs the count, and an eager
fp8_mega_moe call (after its launch: the bad call itself where its kernel has counted them by
then, else the next call) or ops.synchronize() raises it. Also when the bad call was a CUDA graph
replay."""
import re
import logging
import time

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import check_outputs, fill_buffer, random_inputs, random_layer
from megamoe_plugin.timing import graphed

HIDDEN, INTER, TOPK, EXPERTS, MAX_TOKENS = 384, 256, 4, 4, 50  # a precompiled shape (tests/gpu/cases.py)
NUM_TOKENS = 21


def message(count):
    return rf"megamoe: {count} topk_idx entr(y|ies) outside \[-1, num_experts\)"


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator(device="cuda").manual_seed(11)
    buf = mm.get_symm_buffer(None, EXPERTS, MAX_TOKENS, TOPK, HIDDEN, INTER)
    layer = random_layer(EXPERTS, HIDDEN, INTER, "cuda", gen)
    inputs = random_inputs(NUM_TOKENS, HIDDEN, EXPERTS, TOPK, "masked", "cuda", gen)
    return buf, layer, inputs


def _run(buf, layer, inputs):
    fill_buffer(buf, inputs)
    y = torch.full((inputs["x"].shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
    return y


def _reported(*actions):
    """Runs `actions` in turn; the bad-id counts the ValueErrors they raised reported, in total. A
    call's check after its launch reads the count without waiting for its kernel, so the count of
    one bad call may come from the call itself, the next call or synchronize (or be split among
    them)."""
    total = 0
    for action in actions:
        try:
            action()
        except ValueError as exc:
            total += int(re.match(message(r"(\d+)"), str(exc)).group(1))
    return total


def _with_expert_ids(inputs, values):
    """`inputs` with len(values) slots replaced, in distinct tokens."""
    bad = dict(inputs)
    bad["topk_idx"] = inputs["topk_idx"].clone()
    for token, value in zip(range(3, NUM_TOKENS, 5), values):
        bad["topk_idx"][token, 2] = value
    return bad


def test_masked_slots_are_not_errors(setup):
    buf, layer, inputs = setup
    assert (inputs["topk_idx"] == -1).any()
    for _ in range(2):  # no error raised by this call's synchronize, nor at the next call
        y = _run(buf, layer, inputs)  # NaN-poisoned output: every row must be written
        mm.ops.synchronize()
        check_outputs([y], [inputs], [layer], EXPERTS, mm.ops.resolve_numerics(None))


@pytest.mark.parametrize("value", [EXPERTS, EXPERTS + 1000, -2, -(2 ** 40)])
def test_bad_expert_id_raises_by_the_next_call_then_clears(setup, value):
    buf, layer, inputs = setup
    good = _run(buf, layer, inputs).clone()
    mm.ops.synchronize()
    # Plain torch in between: the error waits for a megamoe call.
    assert _reported(lambda: _run(buf, layer, _with_expert_ids(inputs, [value])), torch.cuda.synchronize,
                     lambda: _run(buf, layer, inputs)) == 1
    # The error is reported once; the buffer and the kernel are fine afterwards.
    again = _run(buf, layer, inputs)
    mm.ops.synchronize()
    assert torch.equal(again, good)


def test_every_bad_entry_is_counted(setup):
    """Bad ids in several tokens (handled by different threads, maybe CTAs) add up exactly."""
    buf, layer, inputs = setup
    assert _reported(lambda: _run(buf, layer, _with_expert_ids(inputs, [EXPERTS, -5, EXPERTS + 7])),
                     mm.ops.synchronize) == 3
    mm.ops.synchronize()


def _watchdog_caught_up(timeout_s=3.0):
    """Waits until the watchdog has logged every bad id counted so far (earlier tests')."""
    deadline = time.monotonic() + timeout_s
    while mm.reports.watchdog.bad_expert_ids_reported != mm.native.runtime().read_bad_expert_ids():
        assert time.monotonic() < deadline, "the watchdog stopped logging bad expert ids"
        time.sleep(0.05)


def test_bad_expert_id_in_a_graph_replay_is_logged_and_raised(setup, caplog):
    buf, layer, inputs = setup
    caplog.set_level(logging.ERROR, logger="megamoe_plugin")
    _watchdog_caught_up()
    caplog.clear()  # the earlier tests' bad ids, logged while catching up
    y = torch.empty(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda")
    fill_buffer(buf, inputs)
    replay = graphed(lambda: mm.fp8_mega_moe(y, layer.l1, layer.l2, buf))  # loads and builds outside the capture
    fill_buffer(buf, _with_expert_ids(inputs, [EXPERTS, EXPERTS]))
    replay()
    torch.cuda.synchronize()  # plain torch, as a server would: no megamoe call
    _watchdog_caught_up()
    logged = [r for r in caplog.records if "topk_idx" in r.getMessage()]
    assert [r.getMessage()[:29] for r in logged] == ["megamoe: 2 topk_idx entries o"]
    assert logged[0].levelno == logging.ERROR and logged[0].name == "megamoe_plugin"
    with pytest.raises(ValueError, match=message(2)):
        _run(buf, layer, inputs)  # the next eager call
    _run(buf, layer, inputs)
    mm.ops.synchronize()


def test_y_with_more_rows_than_staged_is_refused_and_the_next_call_is_right(setup):
    """stage_inputs records how many rows it staged; a call whose y has more (they would run on
    stale rows) raises before it launches, and the buffer's next call computes right."""
    buf, layer, inputs = setup
    n = mm.stage_inputs(buf, inputs["hidden_states"][:NUM_TOKENS - 1], inputs["topk_idx"][:NUM_TOKENS - 1],
                        inputs["topk_weights"][:NUM_TOKENS - 1])
    y = torch.full((NUM_TOKENS, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=f"y has {NUM_TOKENS} rows but {n} tokens were staged"):
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
    mm.ops.synchronize()
    check_outputs([_run(buf, layer, inputs)], [inputs], [layer], EXPERTS, "fast")
