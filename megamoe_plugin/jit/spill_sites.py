"""Where a compiled kernel's register spills lie: each local-memory store and load (STL / LDL) in
nvdisasm's text of the cubin, and whether it sits inside a WGMMA main loop, where it costs on every
k-block, or outside one, where it costs once per tile or per call.

A loop runs from a backward branch's target to the branch. A main loop is a loop that holds a WGMMA
(SASS GMMA) and no inner loop that holds one: the k-block loop. Backward branches after a function's
last EXIT are no loops: nvcc places out-of-line code there (a warp-collective's divergent path,
entered by BRA.DIV), which branches back into the body where it left it.

The compile check (megamoe_plugin.jit.check) passes a variant whose spills all lie outside the main
loops; tools/spill_sites.py prints the sites.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

FUNCTION = re.compile(r"^\s*\.text\.(\S+):")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
SPILL = re.compile(r"\b(STL|LDL)(\.[A-Z0-9.]+)?\s")
EXIT = re.compile(r"\bEXIT\b")


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
        body_end = max((i for i, line in enumerate(lines) if EXIT.search(line)), default=len(lines))
        loops = [(labels[m.group(1)], i) for i, line in enumerate(lines[:body_end])
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
    """nvdisasm from $NVDISASM, the PATH, the CUDA toolkit or triton's bundled copy (torch brings
    triton), or None."""
    candidates = [os.environ.get("NVDISASM"), shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm"]
    try:
        import triton
        candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.exists(c)), None)


def cubin_spill_sites(cubin: Path) -> Optional[List[SpillSite]]:
    """The spill sites of a cubin, or None where nvdisasm is missing or cannot read it."""
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        return None
    try:
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True,
                              timeout=300).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return spill_sites(sass)
