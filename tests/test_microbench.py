"""The microbenchmarks under tools/microbench build for sm_90a (no GPU needed), so a GPU run
spends its time running them: every kernel without register spills and without serialized
WGMMAs (mainloop.cu times the served main loop, mma.cuh, and would time a slowed one)."""
import re
import subprocess
from pathlib import Path

import pytest

from megamoe_plugin import jit
from megamoe_plugin.paths import CSRC_DIR

MICROBENCH_DIR = Path(__file__).resolve().parents[1] / "tools" / "microbench"


def _toolchain():
    toolchain, why = jit.find_toolchain()
    if toolchain is None:
        pytest.skip(f"no CUDA toolchain to compile with: {why}")
    return toolchain


@pytest.mark.parametrize("source", sorted(p.name for p in MICROBENCH_DIR.glob("*.cu")))
def test_microbench_builds_without_spills_or_serialized_wgmma(source, tmp_path):
    toolchain = _toolchain()
    # The kernel's own flags (with -Xptxas=-v), so the headers compile as they do in the JIT.
    cmd = [toolchain.nvcc, *jit.nvcc_flags(), "-I", str(CSRC_DIR), "-I", toolchain.cutlass_include,
           str(MICROBENCH_DIR / source), "-o", str(tmp_path / "bench")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and not any(spills), log[-4000:]
    assert not jit.WGMMA_SERIALIZED.search(log), log[-4000:]
