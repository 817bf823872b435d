"""Where a kernel variant's register spills lie: each local-memory store and load (STL / LDL) of the
fused kernel and the window kernel, and whether it sits inside a WGMMA main loop, where a spill costs
on every k-block, or outside, where it costs once per tile or per call.

Usage: python3 tools/spill_sites.py VARIANT... [--all]
  VARIANT  a variant's name as megamoe_plugin.jit prints it (h7168_i2048_k8_e32_r1_bm64_st5_fm1_fast,
           with _win for a windowed one), compiled into MEGAMOE_CACHE_DIR if it is not there yet;
  --all    list every spill instruction, not only the counts and those inside main loops.
Exits 1 if a spill lies inside a main loop.

A loop runs from a backward branch's target to the branch. A main loop is a loop that holds a WGMMA
(SASS GMMA) and no inner loop that holds one: the k-block loop. nvdisasm comes from $NVDISASM, the
PATH, the CUDA toolkit or triton's bundled copy.
"""
import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAME = re.compile(r"h(\d+)_i(\d+)_k(\d+)_e(\d+)_r(\d+)_bm(\d+)_st(\d+)_fm([01])_(fast|exact)(_win)?(_timeline)?$")
FUNCTION = re.compile(r"^\s*\.text\.(\S+):")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
SPILL = re.compile(r"\b(STL|LDL)(\.[A-Z0-9.]+)?\s")


@dataclasses.dataclass
class SpillSite:
    function: str
    line: int          # in the function's disassembly, from 0
    instruction: str
    in_main_loop: bool


def spill_sites(sass: str) -> List[SpillSite]:
    """The spill instructions of every function in nvdisasm's text `sass`."""
    sites = []
    functions = []  # (name, lines)
    for line in sass.splitlines():
        m = FUNCTION.match(line)
        if m:
            functions.append((m.group(1), []))
        elif functions:
            functions[-1][1].append(line)
    for name, lines in functions:
        labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
        loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
                 if (m := BRANCH.search(line)) and labels.get(m.group(1), i) < i]
        gmma = [i for i, line in enumerate(lines) if "GMMA" in line]

        def holds_gmma(loop):
            return any(loop[0] <= g <= loop[1] for g in gmma)

        main_loops = [a for a in loops if holds_gmma(a) and not any(
            b != a and a[0] <= b[0] and b[1] <= a[1] and holds_gmma(b) for b in loops)]
        for i, line in enumerate(lines):
            if SPILL.search(line):
                text = line.split("*/", 1)[-1].split(";")[0].strip()
                sites.append(SpillSite(name, i, text, any(a <= i <= b for a, b in main_loops)))
    return sites


def find_nvdisasm() -> Optional[str]:
    candidates = [os.environ.get("NVDISASM"), shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm"]
    try:
        import triton
        candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.exists(c)), None)


def variant_of(name: str):
    from megamoe_plugin.kernel_variant import KernelVariant
    m = NAME.match(name)
    if not m:
        raise SystemExit(f"not a variant name: {name!r} (e.g. h7168_i2048_k8_e32_r1_bm64_st5_fm1_fast)")
    h, i, k, e, r, bm, st, fm, numerics, win, timeline = m.groups()
    return KernelVariant(int(h), int(i), int(k), int(e), int(r), int(bm), int(st), fm == "1", numerics,
                         timeline=bool(timeline), windowed=bool(win))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        raise SystemExit("nvdisasm not found: set NVDISASM, or install the CUDA toolkit's or triton's")
    from megamoe_plugin.jit import compile_variant
    inside = 0
    for name in args.variants:
        cubin = compile_variant(variant_of(name)).cubin
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
        sites = spill_sites(sass)
        for function in dict.fromkeys(s.function for s in sites):
            mine = [s for s in sites if s.function == function]
            in_loops = [s for s in mine if s.in_main_loop]
            inside += len(in_loops)
            print(f"{name} {function}: {len(mine)} spill instructions, {len(in_loops)} inside main loops")
            for s in mine if args.all else in_loops:
                print(f"  line {s.line:6d}  {s.instruction}" + ("  (inside a main loop)" if s.in_main_loop else ""))
        if not sites:
            print(f"{name}: no spill instructions")
    sys.exit(1 if inside else 0)


if __name__ == "__main__":
    main()
