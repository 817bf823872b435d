"""The per-tile clock records (megamoe_plugin.timeline): the variant that writes them, the
argument check, and the summary of a record array built here with known times."""
import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin import timeline
from megamoe_plugin.kernel_variant import KernelVariant
from megamoe_plugin.testing import random_layer


def test_the_timeline_variant_is_its_own_build():
    plain = KernelVariant(4096, 2048, 6, 32, 1, 128, 4, True, "fast")
    timed = KernelVariant(4096, 2048, 6, 32, 1, 128, 4, True, "fast", timeline=True)
    assert timed.name() == plain.name() + "_timeline"
    assert timed.source().startswith("#define MEGAMOE_TIMELINE 1\n")
    assert "MEGAMOE_TIMELINE" not in plain.source()
    from megamoe_plugin.jit import cache_key
    assert cache_key(plain) != cache_key(timed)


def _record(t, cta, phase, record, words):
    t[cta, phase, record] = torch.tensor(words, dtype=torch.int64)


def test_summary_of_known_records():
    t = torch.zeros(2, len(timeline.SLOTS), timeline.RECORDS, timeline.WORDS, dtype=torch.int64)
    # L1 only. CTA 0: two tiles per warpgroup; its producer ran 5000 cycles in 2500 ns (2 GHz) from
    # ns 1000, waited 300 cycles for free stages and 400 for its tiles' rows. The second tile's
    # 32-bit clocks wrap.
    _record(t, 0, 0, 0, [300, 2, 10_000, 15_000, 1000, 3500, 400])
    wrap = 1 << 32
    for wg in range(2):
        # tile 0: main loop 1000 cycles (100 of them waiting for loads), epilogue 200
        _record(t, 0, 0, 1 + wg, [wrap - 1500, wrap - 500, wrap - 300, 100, 2000, 0, 0])
        # tile 1 after a 50-cycle gap: main loop 1000 (300 waiting), epilogue 200
        _record(t, 0, 0, 3 + wg, [wrap - 250, 750, 950, 300, 2600, 0, 0])
    # CTA 1: one tile, its producer from ns 1100, 1000 cycles in 500 ns
    _record(t, 1, 0, 0, [0, 1, 0, 1000, 1100, 1600, 0])
    for wg in range(2):
        _record(t, 1, 0, 1 + wg, [0, 1000, 1200, 0, 1700, 0, 0])
    s = timeline.summarize(t, {"L1": 10, "L2": 4})
    assert set(s) == {"L1"}
    l1 = s["L1"]
    assert (l1["ctas"], l1["tiles_per_cta_max"], l1["tiles_per_cta_mean"]) == (2, 2, 1.5)
    assert l1["mainloop_cycles"] == 1000 and l1["mainloop_cycles_per_k_block"] == 100
    assert l1["epilogue_cycles"] == 200 and l1["gap_cycles"] == 50
    assert l1["full_wait_fraction"] == pytest.approx(800 / 6000)
    assert l1["producer_empty_wait_cycles_per_tile"] == pytest.approx((150 + 0) / 2)
    assert l1["producer_arrival_wait_cycles_per_tile"] == pytest.approx((200 + 0) / 2)
    assert l1["clock_ghz"] == pytest.approx(6000 / 3000)
    assert l1["span_us"] == pytest.approx((2600 - 1000) / 1e3)
    assert l1["tail_us_mean"] == pytest.approx((0 + (2600 - 1700)) / 2 / 1e3)
    line, = timeline.format_summary(s)
    assert line.startswith("L1: 2 CTAs x 1.5 tiles (max 2)") and "SM clock 2.00 GHz" in line
    assert "main loop 0.50 us (100 cycles per k-block, 13.3% waiting for loads)" in line
    assert "and for its rows to arrive 0.05 us" in line


def _lag_records(l1_start_ns, pull_ends_ns, l2_tiles):
    """One CTA's records: its L1 producer from l1_start_ns, warp w's pull ends (part 0, part 1),
    and L2 tiles (end ns, epilogue cycles) on an L2 producer at 2 cycles per ns."""
    t = torch.zeros(1, len(timeline.SLOTS), timeline.RECORDS, timeline.WORDS, dtype=torch.int64)
    _record(t, 0, 0, 0, [0, 1, 0, 1000, l1_start_ns, l1_start_ns + 500, 0])
    for warp, ends in enumerate(pull_ends_ns):
        _record(t, 0, timeline.PULL_SLOT, warp, list(ends) + [0] * (timeline.WORDS - 2))
    _record(t, 0, 1, 0, [0, len(l2_tiles), 0, 20_000, 1000, 11_000, 0])
    for i, (end_ns, epilogue) in enumerate(l2_tiles):
        for wg in range(2):
            _record(t, 0, 1, 1 + 2 * i + wg, [100, 5000, 5000 + epilogue, 0, end_ns, 0, 0])
    return t


def test_pull_scatter_lag_over_ranks_side_by_side():
    # Rank 0: L1 from ns 1000; its warps end pulling at 1500 and (during L1) 4000; its L2 tiles end
    # at 9000 and 12000 with 2000-cycle epilogues (1000 ns at 2 GHz): scatters from 8000 and 11000.
    rank0 = _lag_records(1000, [(1500, 0), (1200, 4000)], [(9000, 2000), (12000, 2000)])
    lag = timeline.pull_scatter_lag([rank0])
    assert lag == {"pull_end_us": 3.0, "first_scatter_us": 7.0, "lag_us": 4.0, "l2_tiles": 4,
                   "l2_tiles_during_pull": 0}
    # Rank 1 side by side started L1 at 900 and pulled until 8500: rank 0's first tile (both
    # warpgroups' records) scattered during that pull.
    rank1 = _lag_records(900, [(8500, 0)], [(20000, 0)])
    lag = timeline.pull_scatter_lag([rank0, rank1])
    assert lag["pull_end_us"] == pytest.approx(7.6) and lag["first_scatter_us"] == pytest.approx(7.1)
    assert lag["lag_us"] == pytest.approx(-0.5) and (lag["l2_tiles"], lag["l2_tiles_during_pull"]) == (6, 2)
    line = timeline.format_lag(lag)
    assert "lag -0.5 us" in line and "2 of 6 L2 tile records began their scatter during the pull" in line
    # No pull records (a call stopped before the pull), or no L2 records: nothing to say.
    assert timeline.pull_scatter_lag([_lag_records(1000, [], [(9000, 0)])]) is None
    assert timeline.pull_scatter_lag([_lag_records(1000, [(1500, 0)], [])]) is None
    assert timeline.format_lag(None) == "pull and scatter: no records of both"


def test_a_bad_timeline_is_refused_by_name(monkeypatch):
    from megamoe_plugin import ops

    monkeypatch.setattr(ops, "_grid_size", lambda buf: 3)
    layer = random_layer(4, 256, 256, "cpu", torch.Generator().manual_seed(0))
    buf = mm.get_symm_buffer(None, 4, 16, 2, 256, 256, device="cpu")
    y = torch.zeros(4, 256, dtype=torch.bfloat16)
    good = ops.timeline_for(buf)
    assert tuple(good.shape) == (3, 3, timeline.RECORDS, timeline.WORDS) and good.dtype == torch.int64
    for bad, match in ((torch.zeros(2, 3, timeline.RECORDS, timeline.WORDS, dtype=torch.int64),
                        rf"_timeline \(ops.timeline_for\) must have shape \[3, 3, 257, {timeline.WORDS}\], got \[2, "),
                       (good.int(), r"_timeline \(ops.timeline_for\) must be torch.int64"),
                       (good.transpose(2, 3).contiguous().transpose(2, 3), "must be contiguous")):
        with pytest.raises(ValueError, match=match):
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, _timeline=bad)
    with pytest.raises(RuntimeError):  # a good one passes the check; no SM90 GPU here
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, _timeline=good)
