"""The `python -m megamoe_plugin.jit --build` command line: batch-size lists, and the command that
pre-builds given variants (what KernelMissingError tells a user to run). Below the JIT and the op
layer, which both name it in their errors."""
from __future__ import annotations

import shlex
from typing import Iterable, List, Optional, Sequence

from ..heuristics import NUMERICS_MODES
from ..settings import cache_dir

PROG = "python -m megamoe_plugin.jit"
DEFAULT_BATCH_SIZES = "0-8192"
DEFAULT_GPU = "NVIDIA H200"


def parse_batch_sizes(text: str) -> List[int]:
    """"1,8,64" or ranges "0-512" (every count in it), mixed: the sorted distinct counts."""
    counts = set()
    for item in text.split(","):
        low, sep, high = item.strip().partition("-")
        if not (low.isdigit() and (not sep or high.isdigit())):
            raise ValueError(f"batch sizes: {item!r} is neither a count nor a range A-B")
        counts.update(range(int(low), int(high if sep else low) + 1))
    if not counts:
        raise ValueError(f"batch sizes: {text!r} names no count")
    return sorted(counts)


def format_batch_sizes(counts: Iterable[int]) -> str:
    """parse_batch_sizes' inverse, runs of consecutive counts as ranges."""
    runs: List[List[int]] = []
    for n in sorted(set(counts)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def build_command(hidden: int, intermediate_size: int, num_experts: int, num_topk: int, ep_size: int,
                  batch_sizes: Optional[Iterable[int]] = None, gpu: Optional[str] = None,
                  numerics: Sequence[str] = NUMERICS_MODES, fast_math: bool = True,
                  num_shared_experts: int = 0, weights: str = "fp8") -> str:
    """The --build command line that pre-builds these variants into the current cache folder
    (what a KernelMissingError says to run); num_experts and num_topk are the routed ones, to
    which the kernel's shape adds the shared experts."""
    args = [*PROG.split(), "--build", "--hidden", str(hidden), "--intermediate-size", str(intermediate_size),
            "--num-experts", str(num_experts), "--topk", str(num_topk)]
    if num_shared_experts:
        args += ["--shared-experts", str(num_shared_experts)]
    args += ["--ep-size", str(ep_size)]
    if batch_sizes is not None:
        args += ["--batch-sizes", format_batch_sizes(batch_sizes)]
    if gpu is not None and gpu != DEFAULT_GPU:
        args += ["--gpu", gpu]
    if tuple(numerics) != NUMERICS_MODES:
        args += ["--numerics", ",".join(numerics)]
    if not fast_math:
        args.append("--no-fast-math")
    if weights != "fp8":
        args += ["--weights", weights]
    args += ["--cache-dir", str(cache_dir())]
    return shlex.join(args)
