"""Everything megamoe_sm90 refuses in SGLang, each with a message that says what to change.

The checks themselves are the vLLM plugin's (megamoe_plugin.support); here are SGLang's
words for the fixes and the facts of an SGLang MoE layer (`FusedMoE`). Argument-level
refusals run at resolution (before any process starts), layer-level ones when a layer's
expert weights are built (model load), where every rank reaches the same verdict.
"""
from __future__ import annotations

import inspect
import re
from typing import Optional

from .. import support
from . import BACKEND

HINTS = support.Hints(pick_other="pick another --moe-runner-backend (e.g. leave it at 'auto')",
                      ep_size_flags="--ep-size, with --tp-size equal to it",
                      ep_size_words="--ep-size",
                      more_ranks_flag="--ep-size")


class MegaMoEUnsupportedError(support.UnsupportedError):
    """A deployment megamoe_sm90 cannot run in SGLang; the message names what to change."""

    def __init__(self, what: str, change: str):
        super().__init__(f"--moe-runner-backend {BACKEND}", what, change)


class IncompatibleSGLangError(RuntimeError):
    """This sglang is not one the plugin was written for (version or hooked signatures)."""

    def __init__(self, reason: str):
        super().__init__(f"--moe-runner-backend {BACKEND} cannot run on this sglang: {reason}. To fix: install "
                         f"an sglang the plugin supports (docs/sglang.md) or {HINTS.pick_other}.")


# Why this sglang cannot run the backend (None: it can). registration.register records it once;
# the resolution hook refuses with it when the backend is selected.
_incompatibility: Optional[str] = None


def incompatibility() -> Optional[str]:
    return _incompatibility


def record_incompatibility(why: Optional[str]) -> None:
    global _incompatibility
    _incompatibility = why


def check_arguments(cfg) -> None:
    """Server arguments (a resolving view) the backend cannot be combined with."""
    a2a = getattr(cfg, "moe_a2a_backend", "none")
    if a2a not in ("none", "megamoe"):
        raise MegaMoEUnsupportedError(
            f"--moe-a2a-backend {a2a}: the kernel dispatches and combines tokens itself",
            "leave --moe-a2a-backend unset")
    if getattr(cfg, "enable_eplb", False):
        raise MegaMoEUnsupportedError(
            "--enable-eplb: EPLB moves experts between ranks by copying their weights in the checkpoint's "
            "layout, and the kernel holds them in its own", "drop --enable-eplb")


# sglang 0.5.17's MLPSyncBatchInfo.all_gather, which every mega-MoE forward needs, builds its
# gathered table as fallback.expand(dp, tp * cp, w).contiguous(): at world size 1 that is a view
# of `fallback`, and its masked write of `fallback` into the table fails on the first batch
# ("some elements of the input tensor and the written-to tensor refer to a single memory
# location", docs/sglang.md; 0.5.23 builds it with repeat). Read off the installed source, so
# that a copy fixed in place is not refused.
_ALIASING_GATHER = re.compile(r"fallback_tensor\.expand\([^)]*\)\s*\.contiguous\(\)")


def mlp_sync_fails_on_one_gpu_0_5_17() -> bool:
    from sglang.srt.managers.scheduler_components.dp_attn import MLPSyncBatchInfo

    return _ALIASING_GATHER.search(inspect.getsource(MLPSyncBatchInfo.all_gather)) is not None


def check_resolved_0_5_17(server_args, architecture: str, mega_moe_archs, token_cap: int) -> None:
    """sglang 0.5.17's resolved arguments (its own resolution checks none of this for SM90)."""
    if server_args.tp_size == 1 and mlp_sync_fails_on_one_gpu_0_5_17():
        raise MegaMoEUnsupportedError(
            "one GPU (--tp-size 1) on sglang 0.5.17: its MLP-sync step, which every mega-MoE backend runs, "
            "fails on the first batch at world size 1 (an sglang bug, fixed in 0.5.23)",
            "serve on 2 or more GPUs (--tp-size and --ep-size N) or use sglang >=0.5.23")
    if architecture not in mega_moe_archs:
        raise MegaMoEUnsupportedError(
            f"{architecture} on sglang 0.5.17: only {', '.join(mega_moe_archs)} take its mega-MoE forward",
            f"serve one of those, use sglang >=0.5.23 (more models), or {HINTS.pick_other}")
    if server_args.enable_two_batch_overlap or server_args.enable_single_batch_overlap:
        raise MegaMoEUnsupportedError("two-/single-batch overlap: the kernel has no dispatch/combine split",
                                      "drop --enable-two-batch-overlap / --enable-single-batch-overlap")
    # A forward over the per-rank token cap leaves the mega-MoE path for the model's usual MoE
    # forward, which cannot read weights in the kernel's layout: bound the prefill chunk here
    # (layer.py refuses any other overflow when it happens).
    chunk = server_args.chunked_prefill_size
    if chunk is None or chunk <= 0:
        raise MegaMoEUnsupportedError("unbounded prefill (chunked prefill off): a forward could exceed the "
                                      f"per-rank token cap {token_cap}", "pass a positive --chunked-prefill-size")
    per_rank = -(-chunk // server_args.dp_size) if server_args.enable_dp_attention else chunk
    if per_rank > token_cap:
        raise MegaMoEUnsupportedError(
            f"a prefill chunk of {per_rank} tokens per rank, over the per-rank token cap {token_cap} "
            "(SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK)",
            f"pass --chunked-prefill-size of at most {token_cap}"
            f"{' per DP rank' if server_args.enable_dp_attention else ''} or raise the cap")


def check_experts(experts, *, executor: str, device_sm: Optional[int], device_name: str) -> None:
    """A MoE layer (SGLang's FusedMoE) at weight build: quantization, activation, shapes, device.
    `device_sm` is SGLang's own reading (90 for SM90, 0 without CUDA)."""
    quant_config = getattr(getattr(experts, "quant_method", None), "quant_config", None)
    if quant_config is None:
        raise MegaMoEUnsupportedError("the MoE layer is not FP8-quantized",
                                      f"serve a 128x128 block-FP8 checkpoint {HINTS.other_backend}")
    support.check_quantization(quant_config, MegaMoEUnsupportedError, HINTS)
    runner = getattr(experts, "moe_runner_config", None)
    activation = str(getattr(runner, "activation", "silu")).lower()
    if activation != "silu" or not getattr(runner, "is_gated", True):
        raise MegaMoEUnsupportedError(
            f"the model's MoE activation is {activation!r}, the kernel computes SiLU-gated experts only",
            f"serve a SwiGLU MoE model (DeepSeek-V3, Qwen3-MoE, ...) {HINTS.other_backend}")
    moe_tp = int(getattr(experts, "moe_tp_size", 1) or 1)
    if moe_tp > 1:
        raise MegaMoEUnsupportedError(
            f"the MoE layer is tensor-parallel ({moe_tp} ranks each hold a slice of every expert), the kernel "
            "needs expert parallelism (each rank holds whole experts)",
            "pass --ep-size equal to --tp-size")
    num_ranks = int(getattr(experts, "moe_ep_size", 1) or 1)
    support.check_shapes(num_ranks, experts.num_experts, experts.hidden_size,
                         experts.intermediate_size_per_partition, experts.top_k, MegaMoEUnsupportedError, HINTS)
    if executor == "reference":
        if num_ranks != 1:
            raise MegaMoEUnsupportedError(
                f"MEGAMOE_EXECUTOR=reference runs the float32 reference on one rank, the EP group has {num_ranks}",
                "unset MEGAMOE_EXECUTOR (the reference is a test aid) or run on one rank")
        return
    capability = None if not device_sm else support.capability_of(device_sm)
    support.check_device(capability, device_name, MegaMoEUnsupportedError, HINTS)


def _refuse_weight_update(param, *args, **kwargs):
    raise MegaMoEUnsupportedError(
        "updating a MoE layer's expert weights in place (SGLang's update_weights_from_disk / _tensor / "
        "_distributed / _ipc): megamoe_sm90 holds them in its kernel's layout, with the shared experts inside "
        "them, so a checkpoint tensor written over them would be read wrong",
        "restart the server on the new checkpoint, or serve with another --moe-runner-backend")


def load_weights_direct(original, model, named_tensors):
    """SGLang's update_weights_from_tensor with load_format="direct" copies each tensor into its
    parameter without the parameter's weight loader: refused by name where a parameter is one
    whose loader refuses (refuse_weight_updates)."""
    named_tensors = list(named_tensors)
    params = dict(model.named_parameters())
    for name, tensor in named_tensors:
        param = params.get(name)
        if getattr(param, "weight_loader", None) is _refuse_weight_update:
            _refuse_weight_update(param, tensor)
    return original(model, named_tensors)


def refuse_weight_updates(params) -> None:
    """Parameters in the kernel's layout (or whose storage went into it) get a weight loader that
    refuses by name: SGLang's weight-update requests load through each parameter's `weight_loader`."""
    for param in params:
        param.weight_loader = _refuse_weight_update
