"""Per-tile clock records of the GEMM phases (debugging; tools/tile_timeline.py prints them).

A call given `_timeline=ops.timeline_for(buf)` runs its variant built with MEGAMOE_TIMELINE
(csrc/megamoe/timeline.cuh), which writes, per CTA and GEMM phase, one producer record and
one record per math-warpgroup tile, and per warp when its share of the pull ended (the layout is
csrc/megamoe/abi.h's). `summarize` turns them into where a tile's time goes: the main loop (per
k-block, and the part of it spent waiting for loaded stages), the epilogue, the gaps between
tiles, and the phase's tail (CTAs done before the slowest one). `pull_scatter_lag` says whether
the pull and the L2 scatter ever ran at once, over one rank's records or those of R ranks side by
side on one GPU.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from . import abi

# The layout (csrc/megamoe/abi.h kTimeline*).
MAX_TILES = abi.kTimelineMaxTiles  # tiles per CTA and phase with a record
RECORDS = abi.kTimelineRecords  # the producer's, then 2 math warpgroups per tile
WORDS = abi.kTimelineWords
PHASES = ("L1", "L2")  # the GEMM phases' slots, in order
PULL_SLOT = abi.kTimelinePullSlot  # record w = warp w's pull ends (globaltimer)
SLOTS = PHASES + ("pull",)  # by index: kTimelineSlots of them, "pull" at PULL_SLOT


WRAP = 1 << 32  # the tile records' clocks are 32-bit


def summarize(timeline, k_blocks: Dict[str, int]) -> Dict[str, dict]:
    """Per GEMM phase (k_blocks: its k-blocks per tile, e.g. {"L1": H / 128, "L2": I / 128}) of a
    record array (a tensor or nested lists): tiles per CTA, and in SM cycles per tile the main
    loop, its full-stage waits, the epilogue and the gap to the next tile, the main loop per
    k-block, the producer's empty-stage waits per tile and its waits for the tiles' A rows to
    arrive (pulled rows in L1, L1's output in trailing L2); the SM clock (the producers' cycles per
    globaltimer ns); in us the phase's span (first producer start to last tile end) and the mean
    time a CTA sits done before the last one finishes. Phases without records are left out."""
    t = _rows(timeline)
    out = {}
    for ph, name in enumerate(PHASES):
        mainloop, waits, epilogue, gaps, ends_ns, starts_ns, tiles = [], [], [], [], [], [], []
        producer_wait, arrival_wait = [], []
        producer_cycles = producer_ns = 0
        for cta in t:
            empty_wait, count, clk_start, clk_end, ns_start, ns_end, arrivals = cta[ph][0]
            if count == 0:
                continue
            tiles.append(count)
            producer_wait.append(empty_wait / count)
            arrival_wait.append(arrivals / count)
            producer_cycles += clk_end - clk_start
            producer_ns += ns_end - ns_start
            starts_ns.append(ns_start)
            cta_end = 0
            for wg in range(2):
                previous_end = None
                for i in range(min(count, MAX_TILES)):
                    start, main_end, end, wait, end_ns, _, _ = cta[ph][1 + 2 * i + wg]
                    if end_ns == 0:  # not written
                        continue
                    mainloop.append((main_end - start) % WRAP)
                    waits.append(wait)
                    epilogue.append((end - main_end) % WRAP)
                    if previous_end is not None:
                        gaps.append((start - previous_end) % WRAP)
                    previous_end = end
                    cta_end = max(cta_end, end_ns)
            if cta_end:
                ends_ns.append(cta_end)
        if not mainloop:
            continue
        mean = statistics.fmean
        last = max(ends_ns)
        out[name] = {
            "ctas": len(tiles), "tiles_per_cta_mean": mean(tiles), "tiles_per_cta_max": max(tiles),
            "mainloop_cycles": mean(mainloop), "mainloop_cycles_per_k_block": mean(mainloop) / k_blocks[name],
            "full_wait_cycles": mean(waits), "full_wait_fraction": sum(waits) / max(sum(mainloop), 1),
            "epilogue_cycles": mean(epilogue), "gap_cycles": mean(gaps) if gaps else 0.0,
            "producer_empty_wait_cycles_per_tile": mean(producer_wait),
            "producer_arrival_wait_cycles_per_tile": mean(arrival_wait),
            "clock_ghz": producer_cycles / producer_ns if producer_ns else 0.0,
            "span_us": (last - min(starts_ns)) / 1e3, "tail_us_mean": mean(last - e for e in ends_ns) / 1e3,
        }
    return out


def format_summary(summary: Dict[str, dict]) -> List[str]:
    """One line per phase, cycles in us at the phase's measured clock."""
    lines = []
    for name, s in summary.items():
        us = lambda cycles: cycles / s["clock_ghz"] / 1e3  # noqa: E731
        lines.append(
            f"{name}: {s['ctas']} CTAs x {s['tiles_per_cta_mean']:.1f} tiles (max {s['tiles_per_cta_max']}); per tile: "
            f"main loop {us(s['mainloop_cycles']):.2f} us ({s['mainloop_cycles_per_k_block']:.0f} cycles per k-block, "
            f"{100 * s['full_wait_fraction']:.1f}% waiting for loads), epilogue {us(s['epilogue_cycles']):.2f} us, "
            f"gap {us(s['gap_cycles']):.2f} us, producer waiting for free stages "
            f"{us(s['producer_empty_wait_cycles_per_tile']):.2f} us and for its rows to arrive "
            f"{us(s['producer_arrival_wait_cycles_per_tile']):.2f} us; span {s['span_us']:.1f} us, CTAs idle at the "
            f"end {s['tail_us_mean']:.1f} us on average; SM clock {s['clock_ghz']:.2f} GHz")
    return lines


def _rows(timeline):
    return timeline.tolist() if hasattr(timeline, "tolist") else timeline


def pull_scatter_lag(timelines) -> Optional[dict]:
    """Whether the pull and the L2 scatter ran at once, over the record arrays of one call on each
    rank (one rank's, or R ranks' launched side by side on one GPU: one globaltimer). A rank pulls
    its rows from every rank while the L2 epilogues store rows into every rank, so on NVLink the two
    share each link's direction; the schedule keeps them apart if every L2 epilogue starts after
    every warp's pull has ended. In us from the first L1 producer's start: `pull_end_us` (the last
    warp's), `first_scatter_us` (the first L2 epilogue's start: its tile's end less its epilogue
    cycles at its CTA's measured clock), `lag_us` (their difference: negative where they overlapped),
    and of `l2_tiles` the number whose epilogue started before the pull's end
    (`l2_tiles_during_pull`). None without pull or L2 records (a phase stop, or no rows)."""
    start_ns, pull_end_ns, scatter_ns = [], [], []
    l1, l2 = PHASES.index("L1"), PHASES.index("L2")
    for timeline in timelines:
        for cta in _rows(timeline):
            l1_producer, l2_producer = cta[l1][0], cta[l2][0]
            if l1_producer[4]:
                start_ns.append(l1_producer[4])
            pull_end_ns.extend(ns for warp in cta[PULL_SLOT] for ns in warp[:2] if ns)
            _, count, clk_start, clk_end, ns_start, ns_end, _ = l2_producer
            if count == 0 or ns_end <= ns_start:
                continue
            cycles_per_ns = (clk_end - clk_start) / (ns_end - ns_start)
            for i in range(min(count, MAX_TILES)):
                for wg in range(2):
                    _, main_end, end, _, end_ns, _, _ = cta[l2][1 + 2 * i + wg]
                    if end_ns:
                        scatter_ns.append(end_ns - ((end - main_end) % WRAP) / cycles_per_ns)
    if not (start_ns and pull_end_ns and scatter_ns):
        return None
    origin, pull_end = min(start_ns), max(pull_end_ns)
    first = min(scatter_ns)
    return {"pull_end_us": (pull_end - origin) / 1e3, "first_scatter_us": (first - origin) / 1e3,
            "lag_us": (first - pull_end) / 1e3, "l2_tiles": len(scatter_ns),
            "l2_tiles_during_pull": sum(ns < pull_end for ns in scatter_ns)}


def format_lag(lag: Optional[dict]) -> str:
    if lag is None:
        return "pull and scatter: no records of both"
    return (f"pull and scatter: the pull ended {lag['pull_end_us']:.1f} us after L1's start, the first L2 rows were "
            f"scattered at {lag['first_scatter_us']:.1f} us: lag {lag['lag_us']:.1f} us; "
            f"{lag['l2_tiles_during_pull']} of {lag['l2_tiles']} L2 tile records began their scatter during the pull")
