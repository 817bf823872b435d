"""The host/device ABI: csrc/megamoe/abi.h's numbers, as the kernel is compiled with them.

The ABI extension (`megamoe_plugin._abi`, csrc/abi/abi_module.cpp, built from the same header as
the kernel and the host runtime) exports them; this module binds each constant and enumerator
under its C++ name (`abi.kErrorRankShift`, `abi.kSigRankArrivals`), so no number is written twice.
It imports no third-party module: the heuristics and the JIT read it without torch.
"""
from __future__ import annotations

import functools
import re
from typing import Dict, Tuple

try:
    from . import _abi
except ImportError as exc:  # a source checkout whose extensions were never built
    raise ImportError("megamoe: the ABI extension megamoe_plugin._abi is not built; build it with "
                      "`pip install -e .` (or `python setup.py build_ext --inplace` in the checkout)") from exc

globals().update(_abi.constants())

# BufferOffsets' fields: the regions of the symmetric buffer whose offsets the kernel reads.
BUFFER_REGIONS: Tuple[str, ...] = tuple(_abi.buffer_regions())

# SignalWord's indices into the signals region, by snake_case name ("rank_arrivals": kSigRankArrivals).
SIGNAL_WORDS: Dict[str, int] = {
    re.sub(r"(?<!^)(?=[A-Z])", "_", name[len("kSig"):]).lower(): value
    for name, value in sorted(_abi.constants().items(), key=lambda item: item[1]) if name.startswith("kSig")
}


@functools.lru_cache(maxsize=None)
def smem_plan(block_m: int, num_stages: int, num_local_experts: int, exact: bool, fp4: bool = False) -> Dict[str, int]:
    """Byte offsets of SharedStorage's members (smem.cuh, which static_asserts them), the bytes of
    one pipeline stage ("stage") and of the whole struct ("bytes", without kSmemAlignSlack); `fp4`:
    MXFP4 expert weights (csrc/megamoe/config.cuh kFp4Weights)."""
    return _abi.smem_plan(block_m, num_stages, num_local_experts, exact, fp4)
