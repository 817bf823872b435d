"""What runs a megamoe_sm90 layer call in vLLM: `megamoe_plugin.serving` (executor
selection, buffers, warm-up, the kernel and reference calls; see its docstring) plus what
only vLLM knows: its EP group, the other DP ranks' token counts and batch invariance.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

from .. import serving
from ..serving import (  # noqa: F401  (this module is the vLLM glue's one view of the executor)
    ENV_VAR,
    EXECUTORS,
    SharedExpertsAfterKernel,
    buffer_key,
    clear_buffers,
    get_buffer,
    get_executor,
    maybe_warmup,
    num_buffers,
    register_layer_weights,
    run_reference,
    set_executor,
    warmup_token_counts,
)


class EPGroup(serving.EPGroup):
    @classmethod
    def from_vllm(cls, moe_parallel_config) -> "EPGroup":
        if not getattr(moe_parallel_config, "use_ep", False) or moe_parallel_config.ep_size == 1:
            return cls(1, 0)
        from vllm.distributed import get_ep_group

        ep = get_ep_group()
        if ep.world_size != moe_parallel_config.ep_size:
            raise RuntimeError(f"megamoe_sm90: vLLM's EP group has {ep.world_size} ranks but the MoE layer expects "
                               f"{moe_parallel_config.ep_size}")
        return cls(ep.world_size, ep.rank_in_group, ep.device_group,
                   key=("ep", getattr(ep, "unique_name", None), tuple(ep.ranks)))


def rank_equal_num_tokens(num_tokens: int) -> int:
    """A token count equal on every EP rank, for the kernel-config lookup.

    With data parallelism each rank has its own batch; vLLM's forward context carries
    every DP rank's token count on the CPU (no device sync), and under sequence
    parallelism the per-rank chunk sizes. The max over ranks is the same everywhere.
    Without DP every EP rank sees the same batch, so the local count already is."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:  # pragma: no cover - very old vLLM
        return num_tokens
    if not is_forward_context_available():
        return num_tokens
    dp = getattr(get_forward_context(), "dp_metadata", None)
    if dp is None:
        return num_tokens
    local_sizes = getattr(dp, "local_sizes", None)
    if local_sizes:
        return max(int(max(local_sizes)), num_tokens)
    across = getattr(dp, "num_tokens_across_dp_cpu", None)
    if across is None:
        return num_tokens
    return max(int(across.max()), num_tokens)


def vllm_numerics() -> Optional[str]:
    """The kernel's numerics mode in vLLM: "exact" (bitwise batch-invariant) under
    VLLM_BATCH_INVARIANT=1, else None (MEGAMOE_NUMERICS, default "fast"; docs/design.md section 2)."""
    return "exact" if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0") else None


run_kernel = functools.partial(serving.run_kernel, rank_equal_num_tokens=rank_equal_num_tokens)
