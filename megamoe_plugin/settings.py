"""The MEGAMOE_* environment variables the package reads at run time, each read and checked here.

    MEGAMOE_NUMERICS         "fast" or "exact": the numerics mode of a call that passes none
                             (docs/design.md section 2); default "fast".
    MEGAMOE_BLOCK_M          run every call with this BLOCK_M tier (measuring tiers, testing them).
    MEGAMOE_NUM_STAGES       run every call with this pipeline depth (variants.variant_for checks
                             that it fits the tier in shared memory).
    MEGAMOE_NUM_SMS          CTAs of the persistent grid, to leave SMs to concurrent kernels
                             (more than the GPU has: every SM); default every SM.
    MEGAMOE_TIMEOUT_S        bound of every in-kernel wait, in seconds; default 30.
    MEGAMOE_CONFIGS_DIR      read the tuning tables from this folder instead of the shipped configs/.
    MEGAMOE_CACHE_DIR        the compiled-kernel cache; default ~/.cache/megamoe_plugin.
    MEGAMOE_NVCC             the nvcc that compiles kernels; default the one on PATH or in CUDA_HOME.
    MEGAMOE_CUTLASS_INCLUDE  the CUTLASS/CuTe headers; default those of the nvidia-cutlass package.

(MEGAMOE_EXECUTOR, the serving glue's test hook, is serving.get_executor's.)

Each reader returns the typed value, or the default (None where the caller has its own) when
the variable is unset or empty, and raises ValueError with one line that names the variable,
the value and what is accepted. They read the environment at each call, so a variable set
later in the process (a test, the tuning sweep forcing each candidate) takes effect.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Optional

from .heuristics import DEFAULT_NUMERICS, IMPLEMENTED_BLOCK_M, MIN_STAGES, NUMERICS_MODES

# The default bound of every in-kernel wait. The longest legitimate wait is a peer that is
# still finishing its previous call (the longest call, 8192 tokens per rank, takes ~13 ms)
# or whose host launched late. warmup's group barrier takes compile and load skew out of
# that, so what is left is host jitter (a GC pause, a busy CPU, another library's one-time
# work on one rank); the bound only has to cover that, with a wide margin, and is short
# enough that a real hang names itself in the log soon (README.md, docs/vllm.md).
DEFAULT_TIMEOUT_S = 30.0
# The bounds MEGAMOE_TIMEOUT_S may take. The runtime hands the kernel the bound in
# nanoseconds as a uint64 (csrc/runtime/runtime.cpp make_params), which wraps from about
# 1.8e10 s and truncates below 1 ns to 0, and a 0 bound traps every wait at once. 1e6 s
# (11.6 days) stands for "never"; below 0.1 s host jitter alone would trap a healthy call.
MIN_TIMEOUT_S = 0.1
MAX_TIMEOUT_S = 1e6
# MEGAMOE_NVCC_TIMEOUT_S. The compile check's 116 reference variants take 10 minutes on 2 cores, about
# 10 s each: 900 s leaves a wide margin for the largest variant on a loaded machine, and still ends a
# hung nvcc. The bound lets the JIT tell a dead compile's temporary folder by its age.
DEFAULT_NVCC_TIMEOUT_S = 900.0
MAX_NVCC_TIMEOUT_S = 86400.0


def _read(name: str) -> Optional[str]:
    """The variable's value; None when unset or empty (an empty value means the default)."""
    return os.environ.get(name) or None


def _invalid(name: str, value: str, accepted: str) -> ValueError:
    return ValueError(f"{name} must be {accepted}, got {value!r}")


def _decimal(name: str, accepted: str, in_range: Callable[[int], bool]) -> Optional[int]:
    """A decimal integer (ASCII digits only: no sign, spaces or underscores) that in_range takes."""
    value = _read(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and in_range(int(value))):
        raise _invalid(name, value, accepted)
    return int(value)


def numerics() -> str:
    """MEGAMOE_NUMERICS: the numerics mode of a call that passes none."""
    value = _read("MEGAMOE_NUMERICS")
    if value is None:
        return DEFAULT_NUMERICS
    if value not in NUMERICS_MODES:
        raise _invalid("MEGAMOE_NUMERICS", value, f"one of {NUMERICS_MODES}")
    return value


def forced_block_m() -> Optional[int]:
    """MEGAMOE_BLOCK_M: the tier every call runs, or None (the table's or the heuristic's)."""
    return _decimal("MEGAMOE_BLOCK_M", f"one of the implemented tiers {IMPLEMENTED_BLOCK_M}",
                    lambda block_m: block_m in IMPLEMENTED_BLOCK_M)


def forced_num_stages() -> Optional[int]:
    """MEGAMOE_NUM_STAGES: the pipeline depth every call runs, or None."""
    return _decimal("MEGAMOE_NUM_STAGES", f"an integer >= {MIN_STAGES}", lambda stages: stages >= MIN_STAGES)


def num_sms() -> Optional[int]:
    """MEGAMOE_NUM_SMS: the CTAs of the persistent grid, or None (every SM)."""
    return _decimal("MEGAMOE_NUM_SMS", "an integer >= 1 (SMs of the persistent grid; unset: every SM)",
                    lambda sms: sms >= 1)


def _seconds(name: str, default: float, low: float, high: float, accepted: str) -> float:
    """A number of seconds in [low, high] (nan and inf refused), or `default` when unset."""
    value = _read(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan  # refused below, with the range
    if not low <= seconds <= high:  # also refuses nan and inf
        raise _invalid(name, value, accepted)
    return seconds


def timeout_s() -> float:
    """MEGAMOE_TIMEOUT_S: the bound of every in-kernel wait, in seconds."""
    return _seconds("MEGAMOE_TIMEOUT_S", DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S, MAX_TIMEOUT_S,
                    f"a number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} ({MAX_TIMEOUT_S:g} for never; "
                    f"default {DEFAULT_TIMEOUT_S:g})")


def nvcc_timeout_s() -> float:
    """MEGAMOE_NVCC_TIMEOUT_S: the most seconds one nvcc run may take."""
    return _seconds("MEGAMOE_NVCC_TIMEOUT_S", DEFAULT_NVCC_TIMEOUT_S, math.ulp(0.0), MAX_NVCC_TIMEOUT_S,
                    f"a number of seconds above 0 and at most {MAX_NVCC_TIMEOUT_S:g} (default "
                    f"{DEFAULT_NVCC_TIMEOUT_S:g})")


def configs_dir() -> Optional[Path]:
    """MEGAMOE_CONFIGS_DIR: the folder of the tuning tables, or None (the shipped ones)."""
    value = _read("MEGAMOE_CONFIGS_DIR")
    return None if value is None else Path(value)


def cache_dir() -> Path:
    """MEGAMOE_CACHE_DIR: the compiled-kernel cache (megamoe_plugin.jit)."""
    value = cache_dir_setting()
    return Path.home() / ".cache" / "megamoe_plugin" if value is None else Path(value)


def cache_dir_setting() -> Optional[str]:
    """MEGAMOE_CACHE_DIR as set, or None where the default applies (for messages that name it)."""
    return _read("MEGAMOE_CACHE_DIR")


def nvcc() -> Optional[str]:
    """MEGAMOE_NVCC: the nvcc to compile with, or None (look on PATH and in CUDA_HOME)."""
    value = _read("MEGAMOE_NVCC")
    if value is not None and not (os.path.isfile(value) and os.access(value, os.X_OK)):
        raise _invalid("MEGAMOE_NVCC", value, "the path of an nvcc executable")
    return value


def cutlass_include() -> Optional[str]:
    """MEGAMOE_CUTLASS_INCLUDE: the CUTLASS/CuTe include folder, or None (the nvidia-cutlass package's)."""
    value = _read("MEGAMOE_CUTLASS_INCLUDE")
    if value is not None and not os.path.isfile(os.path.join(value, "cutlass", "cutlass.h")):
        raise _invalid("MEGAMOE_CUTLASS_INCLUDE", value, "a folder holding cutlass/cutlass.h")
    return value
