"""megamoe_plugin: a fused expert-parallel FP8 MoE ("MegaMoE") for NVIDIA Hopper.

Public API (docs/design.md section 3):
    get_symm_buffer, get_symm_buffer_size, transform_weights, fp8_mega_moe, stage_inputs,
    reference.mega_moe, mxfp4.to_fp8_blocks (MXFP4 experts as the FP8 blocks the kernel reads)
Importing the package needs neither a GPU, nor nvcc, nor vllm; it registers the torch
custom op torch.ops.megamoe.fp8_mega_moe (custom_op.py).
"""
from . import custom_op, mxfp4, reference
from .buffer import SymmBuffer, get_symm_buffer, get_symm_buffer_size
from .ops import fp8_mega_moe
from .staging import stage_inputs
from .weights import transform_weights, untransform_weights

__all__ = [
    "SymmBuffer",
    "fp8_mega_moe",
    "get_symm_buffer",
    "get_symm_buffer_size",
    "mxfp4",
    "reference",
    "stage_inputs",
    "transform_weights",
    "untransform_weights",
]
__version__ = "0.1.0"
