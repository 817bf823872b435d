"""Dummy weights whose outputs depend on the input, for comparing MoE backends end to end.

vLLM's `--load-format dummy` fills every parameter with uniform(-1e-3, 1e-3): RMSNorm gains
of 1e-3, FP8 weights that mostly round to zero, negative block scales. Hidden states then
vanish and every next-token distribution is uniform (every prompt logprob is -ln(vocab)),
so two backends "agree" whatever their MoE computes. Throughput does not care; an output
comparison does. `install()` replaces the dummy loader's fill with one of realistic scale,
seeded per parameter name, so two runs (say vLLM's default MoE backend and megamoe_sm90)
load the same weights and produce peaked, input-dependent logprobs:

  * RMSNorm gains (`*norm.weight`): 1 + 0.1 u, u ~ uniform(-1, 1);
  * FP8 weights: N(0, 1) clipped to +-4, times 64 (fits e4m3's 448);
  * `*weight_scale_inv` (the dequantization multiplier of block-FP8 checkpoints):
    (1 + 0.2 u) / (64 sqrt(fan_in)), so a dequantized weight has std ~1/sqrt(fan_in);
  * other 2-D+ floating weights: N(0, 1/fan_in) (embeddings N(0, 1); lm_head 3x that
    so logits are peaked);
  * anything else (1-D and scalar floats that match no rule above, e.g. the attention
    layers' q/k/v scales, which vLLM creates as 1.0): left as created, and listed.

Only for tools/e2e; the plugin never imports it.
"""
from __future__ import annotations

import math
import zlib

import torch

FP8_VALUE_STD = 64.0
# Dequantization multipliers: block scales of block-FP8 checkpoints, per-tensor/channel scales.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


def _generator(name: str, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(name.encode()))
    return gen


def _normal(shape, name: str, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(name, device), device=device, dtype=torch.float32)


def _uniform(shape, name: str, device: torch.device) -> torch.Tensor:
    return torch.rand(shape, generator=_generator(name, device), device=device, dtype=torch.float32) * 2 - 1


def rule_of(name: str, param: torch.Tensor) -> str | None:
    """Which fill rule (module docstring) parameter `name` gets: fp8, scale, norm, matrix,
    generic (floating, no rule: left as created) or None (not floating: left as created)."""
    if param.dtype == torch.float8_e4m3fn:
        return "fp8"
    if not torch.is_floating_point(param):
        return None
    if name.endswith(SCALE_SUFFIXES):
        return "scale"
    if name.endswith("norm.weight"):
        return "norm"
    return "matrix" if param.dim() >= 2 else "generic"


def scaled_value(name: str, param: torch.Tensor, fan_in: int) -> torch.Tensor | None:
    """The value `param` (full name `name`, input width `fan_in`) gets, or None to keep it."""
    shape, dev, rule = param.shape, param.device, rule_of(name, param)
    if rule == "fp8":
        return (_normal(shape, name, dev).clamp_(-4, 4) * FP8_VALUE_STD).to(param.dtype)
    if rule == "scale":
        return (1 + 0.2 * _uniform(shape, name, dev)) / (FP8_VALUE_STD * math.sqrt(fan_in))
    if rule == "norm":
        return 1 + 0.1 * _uniform(shape, name, dev)
    if rule == "matrix":
        if "embed_tokens" in name:
            std = 1.0
        elif "lm_head" in name:
            std = 3 / math.sqrt(fan_in)
        else:
            std = 1 / math.sqrt(fan_in)
        return _normal(shape, name, dev) * std
    return None


def _weight_of(name: str, params: dict) -> torch.Tensor | None:
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return params.get(name[: -len(suffix)] + "weight")
    return params[name]


def fill(model: torch.nn.Module) -> list:
    """Fills the parameters of `model` in place. Returns the floating ones that matched no
    rule and were left as created, for the caller to report."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            # A scale's fan-in is its weight's input width (the weight's last dim).
            weight = _weight_of(name, params)
            fan_in = int(weight.shape[-1]) if weight is not None and weight.dim() >= 1 else 1
            value = scaled_value(name, param, fan_in)
            if value is not None:
                param.copy_(value)
    return [name for name, param in params.items() if rule_of(name, param) == "generic"]


def install() -> None:
    """Makes vLLM's dummy loader (this process only) fill weights with `fill`. Run the engine
    in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the patch reaches the model."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    def load_weights(self, model, model_config) -> None:
        fallback = fill(model)
        print(f"scaled_dummy_weights: filled {sum(1 for _ in model.parameters())} parameters; "
              f"left as created: {fallback or 'none'}", flush=True)

    DummyModelLoader.load_weights = load_weights
