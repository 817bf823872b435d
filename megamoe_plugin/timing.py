"""How the project times the kernel: device time between CUDA events, median of single
calls, L2 flushed before each (docs/design.md section 8). The benchmarks, tools/phase_times.py
and the tuning sweep (`megamoe_plugin.tune`) all measure through these, so their numbers
compare.
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

# Well beyond any Hopper L2 (H200: 50 MiB), so nothing a call reads survives the flush.
L2_FLUSH_BYTES = 512 << 20


def timed_seconds(fn: Callable[[], object], iters: int) -> float:
    """Device seconds of `iters` back-to-back calls of fn, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def median_call_seconds(fn: Callable[[], object], iters: int, before: Optional[Callable[[], object]] = None) -> float:
    """Median device seconds of one call of fn over `iters` calls, after one untimed
    warm-up call; `before()` runs untimed before every call, the warm-up included (L2
    flush, rank barrier, state reset)."""
    times = []
    for i in range(iters + 1):
        if before is not None:
            before()
        t = timed_seconds(fn, 1)
        if i > 0:
            times.append(t)
    return statistics.median(times)


# SM cycles of the clock probe: about a millisecond at Hopper's clocks, so that the probe's launch
# (a few microseconds) is under 1% of what it times.
CLOCK_PROBE_CYCLES = 2_000_000


def sm_clock_mhz() -> float:
    """The SM clock the GPU runs at now, in MHz: a kernel that spins a known number of SM cycles
    (torch.cuda._sleep), timed between CUDA events. Power and thermal limits lower the clock under
    a heavy load, so a benchmark prints it beside each time: a cell that moves between runs at one
    clock is not moving for the clock's sake."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(CLOCK_PROBE_CYCLES)
    end.record()
    end.synchronize()
    return CLOCK_PROBE_CYCLES / (start.elapsed_time(end) * 1e3)  # cycles per microsecond


def l2_flusher(device="cuda") -> Callable[[], None]:
    """A call that overwrites more memory than the L2 holds. In a model, the layers between
    two calls of one MoE layer evict its weights, so a timed call must read them from HBM."""
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device).zero_


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured once in a CUDA graph; returns the replay. fn runs once outside the
    capture first (JIT compiles, kernel loads, autotuning), as vLLM warms up before it
    captures its decode graphs."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
