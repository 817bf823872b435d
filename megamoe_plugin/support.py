"""What the kernel supports, checked the same way by every serving-framework plugin.

The vLLM plugin (vllm_plugin/refusals.py) and the SGLang plugin (sglang_plugin/refusals.py)
refuse the same things (docs/design.md section 2 limits: the buffer module is their source of
truth). Only the words differ: each framework names its own flags in the "To fix" part, so
every check here takes the error to raise (`refuse(what, change)`) and a `Hints` with that
framework's flags.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Tuple

from .buffer import MAX_LOCAL_EXPERTS, MAX_TOPK, SUPPORTED_NUM_RANKS

Refuse = Callable[[str, str], Exception]

SM90 = (9, 0)


class UnsupportedError(ValueError):
    """A deployment the kernel cannot run; the message names the flag and what to change."""

    def __init__(self, flag: str, what: str, change: str):
        super().__init__(f"{flag}: {what}. To fix: {change}.")
        self.what = what
        self.change = change


@dataclasses.dataclass(frozen=True)
class Hints:
    """A framework's words for the fixes."""
    pick_other: str      # "pick another --moe-backend (e.g. leave it at 'auto')"
    ep_size_flags: str   # the flags whose product is the EP size
    ep_size_words: str   # the same in words, for the list of limits
    more_ranks_flag: str  # the flag that adds EP ranks

    @property
    def other_backend(self) -> str:
        return "or " + self.pick_other


def check_quantization(quant_config, refuse: Refuse, hints: Hints) -> None:
    """128x128 block FP8 with dynamic activation quantization, serialized in the checkpoint.
    Reads the attributes vLLM's and SGLang's Fp8Config share (store_dtype only vLLM has)."""
    other = hints.other_backend
    if getattr(quant_config, "store_dtype", None) not in (None, "fp8", "float8_e4m3fn"):
        raise refuse(
            f"the checkpoint stores experts as {quant_config.store_dtype!r}, the kernel takes FP8 e4m3 experts",
            f"use an FP8 block-quantized checkpoint {other}")
    if not getattr(quant_config, "is_checkpoint_fp8_serialized", True):
        raise refuse(
            "online FP8 quantization of a BF16/FP16 checkpoint gives per-tensor scales, the kernel needs 128x128 "
            "block scales from the checkpoint",
            f"serve a checkpoint with quantization_config {{quant_method: fp8, weight_block_size: [128, 128]}} "
            f"{other}")
    block = getattr(quant_config, "weight_block_size", None)
    if block is None:
        raise refuse(
            "the checkpoint's FP8 experts have per-tensor scales (no weight_block_size), the kernel needs "
            "128x128 block scales",
            f"serve a block-quantized FP8 checkpoint (quantization_config.weight_block_size = [128, 128], as "
            f"DeepSeek-V3/Qwen3 FP8 checkpoints have) {other}")
    if list(block) != [128, 128]:
        raise refuse(
            f"weight_block_size={list(block)}: the kernel takes only 128x128 blocks",
            f"requantize the checkpoint to weight_block_size [128, 128] {other}")
    if getattr(quant_config, "activation_scheme", "dynamic") != "dynamic":
        raise refuse(
            f"activation_scheme={quant_config.activation_scheme!r}: the kernel quantizes activations dynamically "
            "per token and 128 columns",
            f"use a checkpoint with activation_scheme 'dynamic' {other}")


def check_shapes(num_ranks: int, num_experts: int, hidden: int, intermediate: int, topk: int, refuse: Refuse,
                 hints: Hints) -> None:
    """EP size, hidden and intermediate sizes, top-k and experts per rank within the kernel's limits."""
    shape_change = (f"the kernel takes hidden % 128 == 0, intermediate % 128 == 0, 1 <= top-k <= {MAX_TOPK}, "
                    f"EP size ({hints.ep_size_words}) in {SUPPORTED_NUM_RANKS}, experts divisible "
                    f"by the EP size and at most {MAX_LOCAL_EXPERTS} experts per EP rank")
    if num_ranks not in SUPPORTED_NUM_RANKS:
        raise refuse(f"the EP group has {num_ranks} ranks",
                     f"run with an EP size in {SUPPORTED_NUM_RANKS} ({hints.ep_size_flags}); {shape_change}")
    for value, name in ((hidden, "hidden size"), (intermediate, "MoE intermediate size")):
        if value % 128 != 0:
            raise refuse(f"{name} {value} is not a multiple of 128", f"{hints.pick_other}: {shape_change}")
    if not 1 <= topk <= MAX_TOPK:
        raise refuse(f"top-k {topk} is outside [1, {MAX_TOPK}]", f"{hints.pick_other}: {shape_change}")
    if num_experts % num_ranks != 0:
        raise refuse(f"{num_experts} experts do not divide over {num_ranks} EP ranks",
                     f"choose an EP size that divides {num_experts}")
    if num_experts // num_ranks > MAX_LOCAL_EXPERTS:
        raise refuse(
            f"{num_experts // num_ranks} experts per EP rank exceed the kernel's {MAX_LOCAL_EXPERTS}",
            f"use more EP ranks ({hints.more_ranks_flag}) so that experts / EP size <= {MAX_LOCAL_EXPERTS}")


def check_device(capability: Optional[Sequence[int]], device_name: str, refuse: Refuse, hints: Hints) -> None:
    """The GPU kernel needs SM90 (Hopper); capability None means no CUDA device."""
    if capability is None or tuple(capability) != SM90:
        found = "no CUDA device" if capability is None else f"{device_name} (sm_{capability[0]}{capability[1]})"
        raise refuse(f"the kernel runs on SM90 GPUs (H100, H200, H800, H20) only, this process has {found}",
                     f"run on Hopper GPUs {hints.other_backend}")


def capability_of(sm: int) -> Tuple[int, int]:
    """(major, minor) from an "sm" number such as 90."""
    return (sm // 10, sm % 10)
