"""Round 24's kernel variants beyond the GPU tests' (tests/gpu/cases.py): run.sh's sanitizer runs, and
their job list. `python docs/results/2026-12-04-h200-r24/variants.py` compiles them with the tests'
variants (MEGAMOE_CACHE_DIR); `--jobs` prints one sanitizer job per line for tools/sanitizer_sweep.sh:
numerics, tool, BLOCK_M, then tools/debug_phases.py's H I K E N and its --pool-rows (or "-")."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from megamoe_plugin.heuristics import NUMERICS_MODES, implemented_block_m  # noqa: E402
from megamoe_plugin.jit import check_variants  # noqa: E402
from tests.gpu.cases import call_variants, variants  # noqa: E402

# tools/debug_phases.py H I K E N on 8 CTAs, pool rows: round 21's shape; one at I 2048 whose pool
# rows outnumber those pulled before L1 (fast numerics pulls the rest during L1); and pools of 128
# rows for 256 entries, so that every tier runs the call in pool windows (the window kernel too).
SANITIZER_SHAPES = [((384, 256, 4, 4, 16), NUMERICS_MODES, None), ((384, 2048, 4, 4, 64), ("fast",), None),
                    ((384, 256, 4, 4, 64), NUMERICS_MODES, 128)]


def sanitizer_variants():
    out = []
    for (hidden, inter, topk, experts, tokens), modes, pool_rows in SANITIZER_SHAPES:
        for numerics in modes:
            for block_m in implemented_block_m(numerics):
                out += call_variants(1, experts, topk, hidden, inter, tokens, 8, (True,), forced_block_m=block_m,
                                     numerics_modes=(numerics,), pool_rows=pool_rows)
    return out


def sanitizer_jobs():
    for shape, modes, pool_rows in reversed(SANITIZER_SHAPES):  # the longest first
        for numerics in modes:
            for tool in ("racecheck", "memcheck"):
                for block_m in implemented_block_m(numerics):
                    yield " ".join(map(str, (numerics, tool, block_m, *shape, pool_rows or "-")))


if __name__ == "__main__":
    if sys.argv[1:] == ["--jobs"]:
        print("\n".join(sanitizer_jobs()))
        sys.exit(0)
    sys.exit(1 if check_variants(list(dict.fromkeys(variants() + sanitizer_variants()))) else 0)
