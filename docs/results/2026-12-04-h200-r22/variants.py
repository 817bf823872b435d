"""Round 22's kernel variants beyond the GPU tests' (tests/gpu/cases.py): the sanitizer runs of
run.sh, compiled on the CPU machine and carried. `python docs/results/2026-12-04-h200-r22/variants.py`
compiles them with the tests' variants (MEGAMOE_CACHE_DIR)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from megamoe_plugin.heuristics import NUMERICS_MODES, implemented_block_m  # noqa: E402
from megamoe_plugin.jit import check_variants  # noqa: E402
from tests.gpu.cases import call_variants, variants  # noqa: E402

# run.sh's sanitizer shapes (tools/debug_phases.py H I K E N on 8 CTAs): round 21's, and one at
# I 2048 whose 256 pool rows outnumber the 8 x 12 x 2 rows pulled before L1, so fast numerics
# pulls the rest during L1 under the sanitizers.
SANITIZER_SHAPES = [((384, 256, 4, 4, 16), NUMERICS_MODES), ((384, 2048, 4, 4, 64), ("fast",))]


def sanitizer_variants():
    out = []
    for (hidden, inter, topk, experts, tokens), modes in SANITIZER_SHAPES:
        for numerics in modes:
            for block_m in implemented_block_m(numerics):
                out += call_variants(1, experts, topk, hidden, inter, tokens, 8, (True,), forced_block_m=block_m,
                                     numerics_modes=(numerics,))
    return out


if __name__ == "__main__":
    sys.exit(1 if check_variants(list(dict.fromkeys(variants() + sanitizer_variants()))) else 0)
