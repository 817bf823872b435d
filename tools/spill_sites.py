"""Where a kernel variant's register spills lie: each local-memory store and load (STL / LDL) of the
fused kernel and the window kernel, and whether it sits inside a WGMMA main loop, where a spill costs
on every k-block, or outside, where it costs once per tile or per call.

Usage: python3 tools/spill_sites.py VARIANT... [--all]
  VARIANT  a variant's name as megamoe_plugin.jit prints it (h7168_i2048_k8_e32_r1_bm64_st5_fm1_fast,
           with _win for a windowed one, _w4 for MXFP4 weights), compiled into MEGAMOE_CACHE_DIR if it is not
           there yet;
  --all    list every spill instruction, not only the counts and those inside main loops.
Exits 1 if a spill lies inside a main loop.

The analysis is megamoe_plugin.jit.spill_sites's (the compile check's too). nvdisasm comes from
$NVDISASM, the PATH, the CUDA toolkit or triton's bundled copy.
"""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe_plugin.jit.spill_sites import cubin_spill_sites, find_nvdisasm  # noqa: E402

NAME = re.compile(r"h(\d+)_i(\d+)_k(\d+)_e(\d+)_r(\d+)_bm(\d+)_st(\d+)_fm([01])_(fast|exact)(_win)?(_w4)?(_timeline)?$")


def variant_of(name: str):
    from megamoe_plugin.kernel_variant import KernelVariant
    m = NAME.match(name)
    if not m:
        raise SystemExit(f"not a variant name: {name!r} (e.g. h7168_i2048_k8_e32_r1_bm64_st5_fm1_fast)")
    h, i, k, e, r, bm, st, fm, numerics, win, w4, timeline = m.groups()
    return KernelVariant(int(h), int(i), int(k), int(e), int(r), int(bm), int(st), fm == "1", numerics,
                         timeline=bool(timeline), windowed=bool(win), weights="mxfp4" if w4 else "fp8")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    if find_nvdisasm() is None:
        raise SystemExit("nvdisasm not found: set NVDISASM, or install the CUDA toolkit's or triton's")
    from megamoe_plugin.jit import compile_variant
    inside = 0
    for name in args.variants:
        sites = cubin_spill_sites(compile_variant(variant_of(name)).cubin)
        if sites is None:
            raise SystemExit(f"{name}: nvdisasm could not read its cubin")
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
