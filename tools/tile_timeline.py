"""Where a GEMM tile's time goes: one call per (config, tokens) with per-tile clock records
(megamoe_plugin.timeline; the variant built with MEGAMOE_TIMELINE), summarized per phase:
main loop per tile and per k-block, the part of it waiting for loaded stages, epilogue, gaps
between tiles, the producer's waits for free stages, and the phase's tail.

    python3 tools/tile_timeline.py [--configs v4flash,v3] [--tokens 128,2048,8192] [--local-experts 32]

The records come from a call after a warm-up call, with the L2 cache flushed before it. The
variant is the one the call selects (MEGAMOE_BLOCK_M / MEGAMOE_NUM_STAGES apply), with the
clock reads added: compare its total time with tools/phase_times.py's to see what they cost.
"""
import argparse

import torch

import megamoe_plugin as mm
from megamoe_plugin.ops import timeline_for
from megamoe_plugin.timeline import format_summary, summarize
from megamoe_plugin.timing import l2_flusher
from phase_times import add_call_arguments, calls  # tools/ is this script's folder


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_call_arguments(parser, tokens="128,2048,8192")
    args = parser.parse_args()
    flush = l2_flusher()
    for name, hidden, inter, layer, buf, y in calls(args):
        timeline = timeline_for(buf)
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, _timeline=timeline)  # compiles, warms up
        timeline.zero_()
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, _timeline=timeline)
        end.record()
        torch.cuda.synchronize()
        print(f"{name} n={y.shape[0]}: call {start.elapsed_time(end) * 1e3:.1f} us (with the clock reads)", flush=True)
        for line in format_summary(summarize(timeline, {"L1": hidden // 128, "L2": inter // 128})):
            print("  " + line, flush=True)


if __name__ == "__main__":
    main()
