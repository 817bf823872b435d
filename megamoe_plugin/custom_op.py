"""`torch.ops.megamoe.fp8_mega_moe`: the kernel call as a registered torch custom op, so
that torch.compile (vLLM compiles its models) traces a MoE layer without a graph break.

The op writes y in place (declared mutated, as is the expert-stats tensor the kernel adds
to) and returns nothing. A SymmBuffer is a Python object, which an op schema cannot hold:
the op takes the buffer's storage tensor (so the graph orders the op after the staging
that writes it) and the buffer's int `key`, which the eager implementation resolves to the
SymmBuffer (buffer.buffer_of). The weights travel as their four tensors.

The fake implementation only resolves the key and checks the storage's shape: there are
no outputs whose shapes it would have to describe, and every other argument check needs
real tensors (validation.validate_call runs in the eager implementation). Registering needs
neither a GPU nor nvcc.

Staging (stage_inputs) may sit in the same graph under dynamo, but AOTAutograd (the
aot_eager and inductor backends) refuses it: it writes views of one storage with different
dtypes (x, topk_idx, ...), which it cannot functionalize. Stage outside such a graph, as
vLLM does (its moe_forward op is opaque to the compiler).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import ops
from .buffer import SymmBuffer, buffer_of, check_open_buffer
from .heuristics import Numerics
from .weights import unpack_pair

OP_NAME = "megamoe::fp8_mega_moe"


def _resolve(buffer_storage: torch.Tensor, buffer_key: int) -> SymmBuffer:
    buf = buffer_of(buffer_key)
    if buf.closed:
        raise ValueError(f"buffer_key={buffer_key} names a closed SymmBuffer; allocate a new one")
    # Only the shape is checked, not the address: torch.library.opcheck and functionalization
    # may pass a copy, and the kernel runs on the buffer the key names either way.
    if buffer_storage.shape != buf.storage.shape:
        raise ValueError(f"buffer_storage has shape {list(buffer_storage.shape)}, but the SymmBuffer with "
                         f"buffer_key={buffer_key} has {list(buf.storage.shape)}")
    return buf


@torch.library.custom_op(OP_NAME, mutates_args=("y", "cumulative_local_expert_recv_stats"))
def _fp8_mega_moe(y: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, buffer_storage: torch.Tensor, buffer_key: int,
                  activation_clamp: Optional[float], fast_math: bool,
                  cumulative_local_expert_recv_stats: Optional[torch.Tensor], config_num_tokens: Optional[int],
                  numerics: Optional[str]) -> None:  # str: the op schema has no Literal (heuristics.Numerics)
    buf = _resolve(buffer_storage, buffer_key)
    # Looked up at call time (not bound at import): tests replace ops.fp8_mega_moe.
    ops.fp8_mega_moe(y, (w13, w13_scale), (w2, w2_scale), buf, activation_clamp=activation_clamp,
                     fast_math=fast_math, cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                     config_num_tokens=config_num_tokens, numerics=numerics)


@_fp8_mega_moe.register_fake
def _(y, w13, w13_scale, w2, w2_scale, buffer_storage, buffer_key, activation_clamp, fast_math,
      cumulative_local_expert_recv_stats, config_num_tokens, numerics) -> None:
    _resolve(buffer_storage, buffer_key)


def fp8_mega_moe(y: torch.Tensor, l1, l2, buf: SymmBuffer, activation_clamp: Optional[float] = None,
                 fast_math: bool = True, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 config_num_tokens: Optional[int] = None, numerics: Optional[Numerics] = None) -> torch.Tensor:
    """megamoe_plugin.fp8_mega_moe (same arguments, same result) through the registered op."""
    check_open_buffer(buf)
    (w13, w13_scale), (w2, w2_scale) = unpack_pair(l1, "l1"), unpack_pair(l2, "l2")
    torch.ops.megamoe.fp8_mega_moe(y, w13, w13_scale, w2, w2_scale, buf.storage, buf.key, activation_clamp,
                                   fast_math, cumulative_local_expert_recv_stats, config_num_tokens, numerics)
    return y
