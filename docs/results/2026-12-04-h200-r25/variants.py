"""Round 25's kernel variants beyond the GPU tests' and round 24's: the tile-timeline builds of v4flash at
8192 tokens with the default pools and with pools 128 rows short of the worst routing (windowed), for
call 2's look at why the windowed variant's calls that fit one window are slower
(tools/pool_window_cost.py, call 1). `python docs/results/2026-12-04-h200-r25/variants.py` compiles them
(MEGAMOE_CACHE_DIR)."""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

from megamoe_plugin.buffer import BufferShape  # noqa: E402
from megamoe_plugin.configs import REFERENCE_SHAPES  # noqa: E402
from megamoe_plugin.jit import check_variants  # noqa: E402
from megamoe_plugin.variants import variant_for  # noqa: E402
from phase_times import pool_rows_for  # noqa: E402

TOKENS = 8192
POOL_ROWS = (None, "short128")


def timeline_variants():
    ref = REFERENCE_SHAPES["v4flash"]
    out = []
    for spec in POOL_ROWS:
        shape = BufferShape(1, ref.num_local_experts, TOKENS, ref.num_topk, ref.hidden, ref.intermediate_size)
        shape = dataclasses.replace(shape, pool_rows=pool_rows_for(spec, shape))
        variant = variant_for(shape, "NVIDIA H200", 132, TOKENS, True, "fast")
        out += [variant, dataclasses.replace(variant, timeline=True)]
    return out


if __name__ == "__main__":
    sys.exit(1 if check_variants(timeline_variants()) else 0)
