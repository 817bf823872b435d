"""A model's MoE shape, from its Hugging Face config.json or from numbers: what the
pre-build (`python -m megamoe_plugin.jit --build`) and the benchmark
(`python -m megamoe_plugin.bench`) take instead of a reference config.

The families name the same facts differently:

    fact                  DeepSeek-V3 / Kimi-K2 / GLM-4.5   Qwen3-MoE / Qwen2-MoE    Mixtral
    hidden size           hidden_size                       hidden_size              hidden_size
    expert intermediate   moe_intermediate_size             moe_intermediate_size    intermediate_size
    routed experts        n_routed_experts                  num_experts              num_local_experts
    experts per token     num_experts_per_tok               num_experts_per_tok      num_experts_per_tok
    shared experts        n_shared_experts                  (0: gated, see below)    (none)

(`intermediate_size` is the dense MLP's in the first two, hence moe_intermediate_size
first.) A multimodal model keeps its language model's keys under "text_config".

Shared experts (docs/design.md section 2) are part of the kernel's shape: S of them run as S
more local experts of every rank and S more slots per token. DeepSeek-V3's shared MLP of
intermediate size n_shared_experts * moe_intermediate_size is n_shared_experts experts of the
routed I (SwiGLU and the down projection split by intermediate column). Qwen2-MoE's and
Qwen3-Next's shared expert (shared_expert_intermediate_size) is scaled per token by a sigmoid
shared_expert_gate, which the kernel's fixed shared_scale cannot take: it stays beside the
kernel (the serving glue runs it), so these configs read 0; so do those with a clamped SwiGLU
(swiglu_limit, DeepSeek-V4), whose clamp the kernel would apply to the shared experts too.
Standard library only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple, Union

# Each fact's keys, in the order they are tried.
HIDDEN_KEYS = ("hidden_size",)
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
TOPK_KEYS = ("num_experts_per_tok",)
SHARED_EXPERTS_KEY = "n_shared_experts"
CLAMPED_SWIGLU_KEY = "swiglu_limit"  # DeepSeek-V4: clamped SwiGLU


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One MoE layer of a model (all experts, before expert parallelism)."""

    hidden: int
    intermediate_size: int
    num_experts: int
    num_topk: int
    name: str = "model"
    # Shared experts of the routed experts' intermediate size, which every token passes through.
    num_shared_experts: int = 0

    def __post_init__(self):
        for field, least in (("hidden", 1), ("intermediate_size", 1), ("num_experts", 1), ("num_topk", 1),
                             ("num_shared_experts", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{field} must be an integer >= {least}, got {value!r}")

    def describe(self) -> str:
        s = self.num_shared_experts
        shared = f", {s} shared expert{'s' * (s > 1)}" if s else ""
        return (f"{self.name}: H {self.hidden}, I {self.intermediate_size}, {self.num_experts} experts, "
                f"top-{self.num_topk}{shared}")


def _first(config: Dict[str, Any], keys: Sequence[str]) -> Tuple[str, Any]:
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    return "", None


def _integer(source: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    return value


def shape_from_config(config: Dict[str, Any], source: str = "config") -> MoEShape:
    """The MoE shape a config.json's dict describes (see the module docstring)."""
    if _first(config, EXPERTS_KEYS)[1] is None and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    values = {}
    for field, keys in (("hidden", HIDDEN_KEYS), ("intermediate_size", INTERMEDIATE_KEYS),
                        ("num_experts", EXPERTS_KEYS), ("num_topk", TOPK_KEYS)):
        key, value = _first(config, keys)
        if value is None:
            raise ValueError(f"{source}: no {' / '.join(keys)}: not the config of a MoE model this reader knows "
                             "(DeepSeek-V3, Qwen3-MoE, Mixtral style keys); give the shape as numbers instead")
        values[field] = _integer(source, key, value)
    shared = config.get(SHARED_EXPERTS_KEY)  # absent or null: a model without them
    values["num_shared_experts"] = 0 if shared is None else _integer(source, SHARED_EXPERTS_KEY, shared)
    if config.get(CLAMPED_SWIGLU_KEY) is not None:
        values["num_shared_experts"] = 0  # the kernel's clamp would apply to them too: they stay beside it
    try:
        return MoEShape(name=str(config.get("model_type") or "model"), **values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def read_config(path: Union[str, Path]) -> MoEShape:
    """The MoE shape of a Hugging Face model: its config.json, or the folder holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a config object")
    shape = shape_from_config(config, str(path))
    if shape.name == "model":
        shape = dataclasses.replace(shape, name=path.parent.name or "model")
    return shape


def _count(text: str) -> int:
    """--shared-experts' type: a count, never negative."""
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def add_shape_arguments(parser, required: bool) -> None:
    """The options that name a model's MoE shape: --model, or all four numbers; either with
    --shared-experts."""
    group = parser.add_argument_group("model shape" + ("" if required else " (instead of the reference configs)"))
    group.add_argument("--model", metavar="CONFIG", help="a Hugging Face config.json, or the model folder holding "
                                                         "it (DeepSeek-V3, Qwen3-MoE, Mixtral style keys)")
    group.add_argument("--hidden", type=int, help="hidden size H (with the next three, instead of --model)")
    group.add_argument("--intermediate-size", type=int, help="expert intermediate size I")
    group.add_argument("--num-experts", type=int, help="routed experts E, all ranks together")
    group.add_argument("--topk", type=int, help="experts per token K")
    group.add_argument("--shared-experts", type=_count, metavar="S",
                       help="shared experts S of the expert intermediate size, which every token passes through "
                            "(default: with --model its config's n_shared_experts, else 0)")


def shape_from_args(args, parser, required: bool):
    """The MoEShape the options of add_shape_arguments name, --shared-experts overriding a
    config's (0 for numbers without it); None when none is given and none is required. Exits
    through parser.error on a bad or half-given shape."""
    numbers = {"hidden": args.hidden, "intermediate_size": args.intermediate_size, "num_experts": args.num_experts,
               "num_topk": args.topk}
    given = {key for key, value in numbers.items() if value is not None}
    if args.model is not None and given:
        parser.error("give --model or the four numbers (--hidden --intermediate-size --num-experts --topk), not both")
    try:
        if args.model is not None:
            shape = read_config(args.model)
            if args.shared_experts is None:
                return shape
            return dataclasses.replace(shape, num_shared_experts=args.shared_experts)
        if given == set(numbers):
            return MoEShape(**numbers, num_shared_experts=args.shared_experts or 0)
    except ValueError as exc:
        parser.error(str(exc))
    if given or required:
        parser.error("name the model's MoE shape: --model CONFIG, or all of --hidden --intermediate-size "
                     "--num-experts --topk")
    return None
