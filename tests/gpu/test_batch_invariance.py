"""Batch invariance (docs/design.md section 2): in "exact" mode a token's output row is bitwise
independent of the other tokens of the call: how many there are, their order, their routing,
and the tile tier the call's size picks. "fast" mode is measured and reported, not required."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer

HIDDEN, INTER, TOPK, EXPERTS, MAX_TOKENS = 2048, 768, 8, 32, 513


def call(buf, layer, inputs, numerics):
    n = fill_buffer(buf, inputs)
    y = torch.full((n, HIDDEN), math.nan, dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics=numerics)
    mm.ops.synchronize()
    return y


def subset(inputs, rows):
    return {k: v[rows].contiguous() for k, v in inputs.items()}


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator(device="cuda").manual_seed(77)
    layer = random_layer(EXPERTS, HIDDEN, INTER, "cuda", gen)
    buf = mm.get_symm_buffer(None, EXPERTS, MAX_TOKENS, TOPK, HIDDEN, INTER)
    inputs = random_inputs(MAX_TOKENS, HIDDEN, EXPERTS, TOPK, "masked", "cuda", gen)
    return layer, buf, inputs, gen


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
def test_rows_do_not_depend_on_the_rest_of_the_batch(setup, numerics):
    layer, buf, inputs, gen = setup
    full = call(buf, layer, inputs, numerics)
    tiers = set()
    mismatches = []
    cases = {f"first {n} alone": torch.arange(n, device="cuda") for n in (1, 3, 64, 129, 500)}
    cases["all shuffled"] = torch.randperm(MAX_TOKENS, generator=gen, device="cuda")
    cases["every 7th"] = torch.arange(0, MAX_TOKENS, 7, device="cuda")
    for name, rows in cases.items():
        tiers.add(mm.ops.select_variant(buf, rows.numel(), True, numerics).block_m)
        y = call(buf, layer, subset(inputs, rows), numerics)
        differ = int((y.view(torch.int16) != full[rows].view(torch.int16)).any(dim=1).sum())
        if differ:
            mismatches.append(f"{name}: {differ} of {rows.numel()} rows differ")
    print(f"\n  {numerics}: tiers {sorted(tiers)}; batch invariance "
          + ("holds bitwise" if not mismatches else "does not hold: " + "; ".join(mismatches)), end="")
    if numerics == "exact":
        assert len(tiers) > 1, "the cases must span several tile tiers"
        assert not mismatches, "; ".join(mismatches)
