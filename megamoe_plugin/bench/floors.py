"""What a call could take at best on this machine (docs/design.md section 8): the ceilings
measured in the same run (HBM copy bandwidth, FP8 GEMM rate, NVLink peer bandwidth), and a
rank's floor from its routing: max(bytes / bandwidth, FLOPs / FP8 rate, NVLink bytes /
peer bandwidth)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional, Tuple

import torch

from ..mxfp4 import MXFP4_GROUP
from ..timing import GpuClockSampler, timed_seconds


@dataclasses.dataclass(frozen=True)
class Ceilings:
    hbm_bytes_per_s: float
    fp8_flops_per_s: float
    peer_bytes_per_s: float = float("inf")  # no NVLink term with one rank (or if it cannot be measured)


def measure_hbm_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * src.numel() * 10 / timed_seconds(lambda: dst.copy_(src), 10)


# GEMMs timed for the FP8 rate: about 30 ms on an H100 or H200, several of GpuClockSampler's readings.
FP8_RATE_GEMMS = 40
# GEMMs run back to back before the sustained rate's timed ones: about a second on an H100 or H200,
# which a power cap takes to settle the clock where long calls run (1500-1800 MHz on an H100 at
# prefill, against the burst's 1980).
FP8_SUSTAIN_GEMMS = 1200


def measure_fp8_rate(clock: Optional[GpuClockSampler] = None, sustained: bool = False) -> float:
    """FLOP/s of an 8192^3 FP8 GEMM through torch._scaled_mm; `clock` samples the SM clock over the
    timed GEMMs alone (the setup before them, cuBLAS's first call among it, leaves the GPU idle).
    `sustained`: timed after FP8_SUSTAIN_GEMMS untimed ones, the rate at the clock a power cap holds
    under load, not the burst's."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")

    def gemm():
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    for _ in range(FP8_SUSTAIN_GEMMS if sustained else 3):
        gemm()
    torch.cuda.synchronize()
    with clock if clock is not None else contextlib.nullcontext():
        seconds = timed_seconds(gemm, FP8_RATE_GEMMS)
    return 2 * n ** 3 * FP8_RATE_GEMMS / seconds


def measure_peer_bandwidth(buf) -> float:
    """Bytes/s of this rank reading the next rank's symmetric buffer over NVLink."""
    region = buf.layout.regions["pool_x"]
    nbytes = min(region.nbytes, 1 << 30)
    peer = (buf.rank + 1) % buf.num_ranks
    src = buf._symm_handle.get_buffer(peer, (nbytes,), torch.uint8, region.offset)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    return nbytes * 10 / timed_seconds(lambda: dst.copy_(src), 10)


# Bytes an expert weight takes in HBM: FP8 (its 128x128 block scale is negligible), MXFP4 (4 bits
# and one E8M0 byte per 32).
WEIGHT_BYTES_PER_ELEMENT = {"fp8": 1.0, "mxfp4": 0.5 + 1 / MXFP4_GROUP}


def rank_floor(all_idx: List[torch.Tensor], rank: int, num_ranks: int, hidden: int, inter: int, ceilings: Ceilings,
               local_experts: int, weight_bytes_per_element: float = 1.0) -> Tuple[float, int, int]:
    """(floor seconds, FLOPs, NVLink bytes) of one rank, from every rank's routing (list of [n, K]
    ids), with weights of `weight_bytes_per_element` (WEIGHT_BYTES_PER_ELEMENT). The NVLink bytes are the larger direction of the rank's link traffic: in, the rows it
    pulls (FP8 row and its scales) and the BF16 rows others scatter back to its tokens; out, the BF16
    rows it scatters to others' tokens. 0 on one rank."""
    local = range(rank * local_experts, (rank + 1) * local_experts)
    rows = pulled = returned = 0
    experts_hit = set()
    for src, idx in enumerate(all_idx):
        valid = idx[idx >= 0]
        mine = valid[(valid >= local.start) & (valid < local.stop)]
        rows += mine.numel()
        experts_hit.update(mine.unique().tolist())
        if src != rank:
            pulled += mine.numel()  # rows this rank pulls in, and scatters back out
        else:
            returned += int(((valid < local.start) | (valid >= local.stop)).sum())  # rows others send back
    weight_bytes = len(experts_hit) * 3 * inter * hidden * weight_bytes_per_element
    act_bytes = all_idx[rank].shape[0] * hidden * 3 + rows * (hidden + 2 * inter + 2 * hidden)
    nvlink_in = (pulled * (hidden + hidden // 128 * 4) + returned * 2 * hidden) if num_ranks > 1 else 0
    nvlink_out = pulled * 2 * hidden if num_ranks > 1 else 0
    flops = 2 * rows * 3 * inter * hidden
    floor = max((weight_bytes + act_bytes) / ceilings.hbm_bytes_per_s, flops / ceilings.fp8_flops_per_s,
                max(nvlink_in, nvlink_out) / ceilings.peer_bytes_per_s if num_ranks > 1 else 0.0)
    return floor, flops, max(nvlink_in, nvlink_out)
