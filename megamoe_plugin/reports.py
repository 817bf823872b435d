"""What kernels report, in the host words they write (csrc/megamoe/params.h HostWords): a wait
that timed out or a call check that stopped (the error word and its detail), and topk_idx entries
they dropped; and the call tag the ranks compare (abi.h CallTag). Turned into messages, raised by
synchronize() and raise_input_errors(), and logged by `watchdog` when nobody waits (a graph replay).
"""
from __future__ import annotations

import threading
import time
from typing import Dict, Optional

import torch

from . import abi, native
from .heuristics import Numerics
from .watchdog import Watchdog

# Why a kernel stopped (csrc/megamoe/abi.h ErrorCode: the low byte of HostWords::error).
_ERROR_NAMES = {
    abi.kErrGridBarrierTimeout: "grid barrier (a CTA of this rank never arrived: are all SMs free for the persistent grid?)",
    abi.kErrPipelineFullTimeout: "TMA pipeline 'full' barrier (loads never completed)",
    abi.kErrPipelineEmptyTimeout: "TMA pipeline 'empty' barrier (math warpgroups stopped consuming)",
    abi.kErrL1RowsTimeout: "L1 rows of an m-block (an L2 tile waited for the L1 tiles that write its act rows)",
    abi.kErrPulledRowsTimeout: "pulled rows of an m-block (an L1 tile waited for the pull of its tokens into the pool)",
    abi.kErrCombineRowsTimeout: ("rows of a token to combine (the combine waited for the L2 tiles, on any rank, that "
                                 "compute them)"),
    abi.kErrCallMismatch: "cross-rank barrier's call check",
}
_CALL_TAG_MASK = (1 << abi.kCallTagBits) - 1

# Kernel handle -> its variant's name, so that a failure names the variant (name_kernel).
_kernel_names: Dict[int, str] = {}


def name_kernel(handle: int, name: str) -> None:
    """Records the variant name of a loaded kernel handle (the error word's tag)."""
    _kernel_names[handle] = name


def call_tag(layer: int, numerics: Numerics, fast_math: bool, refused: bool = False) -> int:
    """What a call is, for the ranks to compare (abi.h CallTag): the layer (the buffer's ordinal
    of its weights), the numerics mode, fast_math, and whether this rank refused the call."""
    return ((layer & abi.kCallTagLayerMask) | (abi.kCallTagExact if numerics == "exact" else 0)
            | (abi.kCallTagFastMath if fast_math else 0) | (abi.kCallTagRefused if refused else 0))


def describe_call_tag(tag: int) -> str:
    if tag & abi.kCallTagRefused:
        return "a refused call (invalid arguments: that rank raised a ValueError or TypeError naming them)"
    return (f"layer {tag & abi.kCallTagLayerMask} (the buffer's ordinal of the weights), "
            f"numerics {'exact' if tag & abi.kCallTagExact else 'fast'}, fast_math={bool(tag & abi.kCallTagFastMath)}")


def _describe_mismatch(rank: int, detail: int) -> str:
    """What the call check saw (params.h HostWords::detail of abi.h kErrCallMismatch)."""
    if detail & 0xFF != abi.kErrCallMismatch:  # none stored (cannot happen), or another failure's
        return ""
    peer = detail >> abi.kDetailPeerShift & 0xFF
    own = detail >> abi.kDetailOwnTagShift & _CALL_TAG_MASK
    other = detail >> abi.kDetailPeerTagShift & _CALL_TAG_MASK
    if (own | other) & abi.kCallTagRefused:
        differs = ["a refused call"]
    else:
        differs = [what for what, bit in (("the layer", abi.kCallTagLayerMask), ("the numerics mode", abi.kCallTagExact),
                                          ("fast_math", abi.kCallTagFastMath)) if (own ^ other) & bit]
    # A rank never finds itself out of step, so a detail naming the error word's own rank as the peer
    # was stored by another rank: ranks side by side in one process share these host words.
    reporter = f"rank {rank}" if peer != rank else "another rank (ranks in this process share the report)"
    return (f": the ranks' calls of the same number differ in {' and '.join(differs)}: {reporter} made "
            f"{describe_call_tag(own)}; rank {peer} made {describe_call_tag(other)}. The ranks' calls are out of "
            "step (a rank skipped a call, made an extra one, or called another layer or mode), so every rank "
            "stopped instead of mixing them")


def describe_error(word: int) -> str:
    """What a failure word (csrc/megamoe/params.h HostWords::error) says: the wait, the rank
    and the kernel variant, and for the cross-rank waits what they saw (HostWords::detail)."""
    code, rank, tag = word & 0xFF, (word >> abi.kErrorRankShift) & 0xFF, word >> abi.kErrorTagShift
    if abi.kErrRankNotArrived <= code < abi.kErrRankNotArrived + abi.kMaxRanks:
        wait = (f"cross-rank barrier: rank {code - abi.kErrRankNotArrived} never arrived (it did not make this "
                "call on the buffer, or is stuck before it; the ranks this rank waits for after it were not checked)")
    else:
        wait = _ERROR_NAMES.get(code, f"unknown wait {code}")
    kernel = _kernel_names.get(tag, f"with handle {tag}")
    if code == abi.kErrCallMismatch:
        what, detail = "stopped at", _describe_mismatch(rank, native.runtime().read_error_detail())
    else:
        what, detail = "timed out waiting on", ""
    return f"megamoe kernel {what} the {wait}; rank {rank}, kernel {kernel}{detail}. The CUDA context is lost: restart the process"


def kernel_error() -> Optional[str]:
    """The failure recorded by an earlier kernel in this process, or None."""
    word = native.runtime().read_error_word()
    return describe_error(word) if word else None


def describe_bad_expert_ids(count: int) -> str:
    return (f"megamoe: {count} topk_idx entr{'y' if count == 1 else 'ies'} outside [-1, num_experts) met by "
            "fp8_mega_moe calls since the last report; the kernel dropped them like empty slots, so those calls' y "
            "is wrong")


# The bad-expert-id count (HostWords::bad_expert_ids, never cleared) up to which
# raise_input_errors has raised; the watchdog keeps its own.
_bad_expert_ids_raised = 0


def raise_input_errors() -> None:
    """Raises ValueError if kernels launched earlier in this process met invalid input since
    the last such ValueError. It reads host memory the kernels write, without waiting for
    them: fp8_mega_moe calls it after each launch (so the call has taken part in the group's
    protocol: no rank skips a call its peers make), synchronize() after the wait, so an
    error surfaces at the latest at the eager call after the bad one (or after a graph
    replay; the watchdog logs it meanwhile). Inside graph capture it leaves the error for the
    next eager call: raising there would abort the capture, not the bad call."""
    global _bad_expert_ids_raised
    total = native.runtime().read_bad_expert_ids()
    if total == _bad_expert_ids_raised or torch.cuda.is_current_stream_capturing():
        return
    new, _bad_expert_ids_raised = total - _bad_expert_ids_raised, total
    raise ValueError(describe_bad_expert_ids(new))


watchdog = Watchdog(lambda: native.runtime().read_error_word(), lambda: native.runtime().read_bad_expert_ids(),
                    describe_error, describe_bad_expert_ids)


# How often synchronize() reads the error word while the device works, and how long after a kernel
# reported a failure it waits for the driver to end that kernel before raising the kernel's report.
_POLL_S = 0.01
_FAULT_GRACE_S = 1.0


def synchronize() -> None:
    """torch.cuda.synchronize(), turning a kernel timeout or call check into a RuntimeError that names
    the wait, and invalid input a kernel met into a ValueError (raise_input_errors).

    The device wait runs in a helper thread while this one watches the error word: a kernel that
    reported a failure and trapped raises its report within _FAULT_GRACE_S even where the driver is
    slow to end it (with several processes on one GPU, a trap can stay undelivered for as long as
    another process's faulted context lives), instead of blocking the caller on the lost context."""
    device, waited = torch.cuda.current_device(), []

    def wait() -> None:
        try:
            torch.cuda.synchronize(device)
            waited.append(None)
        except Exception as exc:  # torch raises RuntimeError or its AcceleratorError
            waited.append(exc)

    waiter = threading.Thread(target=wait, name="megamoe-synchronize", daemon=True)
    waiter.start()
    failed_at = None
    while waiter.is_alive():
        waiter.join(_POLL_S)
        if failed_at is None and native.runtime().read_error_word():
            failed_at = time.monotonic()
        if waiter.is_alive() and failed_at is not None and time.monotonic() - failed_at > _FAULT_GRACE_S:
            raise RuntimeError(kernel_error())
    if waited[0] is not None:
        reason = kernel_error()
        if reason is not None:
            raise RuntimeError(reason) from waited[0]
        raise waited[0]
    raise_input_errors()
