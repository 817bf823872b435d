"""The per-tile clock records (ops.timeline_for, tools/tile_timeline.py) on the GPU: a call
that writes them computes bit for bit what the served variant computes, every GEMM tile of
both phases has its record, and the records' clocks are ordered."""
import math

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin import ops, timeline
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer

HIDDEN, INTER, TOPK, EXPERTS, MAX_TOKENS = 384, 256, 4, 4, 256
NUM_WARPS = ops.NUM_THREADS // 32


TIERS = [("fast", 8), ("fast", 64), ("fast", 128), ("exact", 8), ("exact", 64)]


def timeline_variants():
    """The timeline builds this file runs (tests/gpu/cases.py precompiles them)."""
    import dataclasses

    from .cases import call_variants

    return [dataclasses.replace(v, timeline=True) for numerics, block_m in TIERS
            for v in call_variants(1, EXPERTS, TOPK, HIDDEN, INTER, MAX_TOKENS, 132, (True,), forced_block_m=block_m,
                                   numerics_modes=(numerics,))]


def expected_tiles(topk_idx, block_m):
    counts = torch.bincount(topk_idx[topk_idx >= 0].flatten(), minlength=EXPERTS).tolist()
    m_blocks = sum(math.ceil(c / block_m) for c in counts)
    return m_blocks * (2 * INTER // 256), m_blocks * math.ceil(HIDDEN / 256)


@pytest.mark.parametrize("numerics, block_m", TIERS)
def test_timeline_records_every_tile_and_changes_no_bit(monkeypatch, numerics, block_m):
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    gen = torch.Generator(device="cuda").manual_seed(block_m)
    buf = mm.get_symm_buffer(None, EXPERTS, MAX_TOKENS, TOPK, HIDDEN, INTER)
    layer = random_layer(EXPERTS, HIDDEN, INTER, "cuda", gen)
    inputs = random_inputs(197, HIDDEN, EXPERTS, TOPK, "masked", "cuda", gen)
    fill_buffer(buf, inputs)
    plain = torch.full((197, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    timed = plain.clone()
    mm.fp8_mega_moe(plain, layer.l1, layer.l2, buf, numerics=numerics)
    records = ops.timeline_for(buf)
    mm.fp8_mega_moe(timed, layer.l1, layer.l2, buf, numerics=numerics, _timeline=records)
    torch.cuda.synchronize()
    assert torch.equal(plain.view(torch.int16), timed.view(torch.int16))

    r = records.cpu()
    for phase, tiles in enumerate(expected_tiles(inputs["topk_idx"], block_m)):
        per_cta = r[:, phase, 0, 1]
        assert int(per_cta.sum()) == tiles  # the producers' tile counts
        for cta in torch.nonzero(per_cta).flatten().tolist():
            for i in range(min(int(per_cta[cta]), timeline.MAX_TILES)):
                for wg in range(2):
                    # a tile record: 5 words, the rest of timeline.WORDS zero (timeline.cuh TileClock::record)
                    start, main_end, end, wait, end_ns, *unused = r[cta, phase, 1 + 2 * i + wg].tolist()
                    assert len(unused) == timeline.WORDS - 5 and not any(unused)
                    mainloop = (main_end - start) % timeline.WRAP
                    assert end_ns > r[cta, phase, 0, 4] and 0 <= wait <= mainloop < (end - start) % timeline.WRAP
    s = timeline.summarize(records, {"L1": HIDDEN // 128, "L2": INTER // 128})
    assert set(s) == {"L1", "L2"} and all(0.5 < p["clock_ghz"] < 3.0 for p in s.values())

    # Every warp of every CTA records when its share of the pull ended, before the CTA's first L1
    # tile ended; at I < 2048 nothing is pulled during L1 (config.cuh kPullDuringL1).
    for cta in range(r.shape[0]):
        pull = r[cta, timeline.PULL_SLOT]
        assert all(pull[w, 0] > 0 for w in range(NUM_WARPS)) and not pull[:, 1:].any() and not pull[NUM_WARPS:].any()
        if r[cta, 0, 0, 1] > 0:
            assert int(pull[:NUM_WARPS, 0].max()) < min(int(r[cta, 0, 1 + wg, 4]) for wg in range(2))
    lag = timeline.pull_scatter_lag([records])
    assert lag["l2_tiles"] == 2 * expected_tiles(inputs["topk_idx"], block_m)[1]
    assert lag["first_scatter_us"] > 0  # a CTA's L2 epilogues come after its L1 producer started
