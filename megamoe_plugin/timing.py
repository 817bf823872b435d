"""How the project times the kernel: device time between CUDA events, median of single
calls, L2 flushed before each (docs/design.md section 8). The benchmarks, tools/phase_times.py
and the tuning sweep (`megamoe_plugin.tune`) all measure through these, so their numbers
compare.
"""
from __future__ import annotations

import statistics
import threading
from typing import Callable, Dict, List, Optional, Tuple

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


# How often GpuClockSampler reads NVML: a few readings across a decode cell's calls, while the
# sampling thread's few microseconds of the GIL per reading stay rare beside the timed launches.
CLOCK_SAMPLE_PERIOD_S = 0.005

# NVML's clock-event reasons that mean a limit held the SM clock down, and the letter each prints as.
CLOCK_LIMIT_LETTERS = (("P", 0x04),  # software power cap: the board's power limit
                       ("S", 0x08),  # hardware slowdown (power brake or overheating, hardware-signalled)
                       ("T", 0x20 | 0x40),  # software or hardware thermal slowdown
                       ("B", 0x80))  # external power brake


class GpuClockSampler:
    """The SM clock and clock limits of the current GPU, read through NVML (nvidia-ml-py) on a
    thread while the calls being timed run. A cell that moves between runs at the same clock, with
    no limit engaged, is not moving for the clock's sake; a clock read after the calls (when the
    load has stopped and the clock recovers) cannot tell that.

        with GpuClockSampler() as clock:
            t = median_call_seconds(...)
        clock.summary()  # {"sm_mhz": median, "sm_mhz_min": lowest, "limits": "P"}

    Without nvidia-ml-py, or where NVML does not answer, `available` is False and the summary's
    values are None."""

    def __init__(self, period_s: float = CLOCK_SAMPLE_PERIOD_S):
        self.period_s = period_s
        # (SM MHz, clock-event reasons). Not the board's power: NVML's reading is an average over
        # about a second, which lags a point's calls (at a run's first point it reads the idle GPU).
        self.samples: List[Tuple[int, int]] = []
        self._handle = None
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(torch.cuda.current_device()))
            self._nvml = pynvml
        except Exception:  # no nvidia-ml-py, no NVML library, or a device NVML does not list
            pass
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _read(self) -> bool:
        """One reading; False where NVML stopped answering (the readings so far stand, the timed
        calls go on)."""
        nvml, h = self._nvml, self._handle
        try:
            self.samples.append((nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                                 nvml.nvmlDeviceGetCurrentClocksEventReasons(h)))
        except Exception:
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.period_s) and self._read():
            pass

    def __enter__(self) -> "GpuClockSampler":
        if self.available:
            self.samples.clear()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="megamoe-clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if not self.samples:  # calls shorter than one period: the state they left
                self._read()

    def summary(self) -> Dict[str, Optional[object]]:
        if not self.samples:
            return dict(sm_mhz=None, sm_mhz_min=None, limits=None)
        reasons = 0
        for _, r in self.samples:
            reasons |= r
        return dict(sm_mhz=statistics.median(s[0] for s in self.samples),
                    sm_mhz_min=min(s[0] for s in self.samples),
                    limits="".join(letter for letter, bits in CLOCK_LIMIT_LETTERS if reasons & bits) or "-")


def _nvml_uuid(device: int) -> str:
    """NVML's name of torch's device `device` (NVML numbers GPUs regardless of CUDA_VISIBLE_DEVICES)."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


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
