"""What `register()` does, step by step (see the package docstring).

SGLang logs and swallows whatever a plugin raises at load, so nothing here raises: a
version or signature the plugin was not written for is recorded (`refusals.incompatibility()`), the layer
hooks are left out, and selecting the backend then fails at argument resolution with
that reason. The backend choice and the resolution hook are installed in every case, so
that the user sees our reason rather than argparse's "invalid choice".
"""
from __future__ import annotations

import inspect
import logging
import pkgutil
import re
import threading
from typing import Callable, Dict, Optional, Tuple

from . import BACKEND, MEGA_MOE, MEGA_MOE_SM90, MODEL_RUNNER, WEIGHT_UPDATER, refusals
from .resolution import SERVER_ARGS_POST_INIT

logger = logging.getLogger("megamoe_plugin.sglang")

_ARGS = "sglang.srt.arg_groups."
# Every SGLang function the plugin wraps or calls, with the parameters it was written for
# (names, kinds and defaults; annotations are ignored), per line of sglang releases.
#
# 0.5.23 (and a later 0.5.x while these hold): the mega-MoE path takes the resolved layer
# arguments, and argument resolution has named hooks (arg_groups.resolution_hooks).
SIGNATURES_0_5_23: Dict[str, str] = {
    MODEL_RUNNER + "load_model": "(self)",
    WEIGHT_UPDATER + "_model_load_weights_direct": "(model, named_tensors)",
    MEGA_MOE + "forward_mega_moe": "(moe, hidden_states, forward_batch=None, input_ids_global=None)",
    MEGA_MOE + "_run_mega_routed": "(moe, hidden_states, forward_batch, input_ids_global, num_tokens)",
    MEGA_MOE_SM90 + "build_sm90_mega_moe_experts_weights": "(experts)",
    MEGA_MOE + "build_mega_moe_experts_weights": "(experts)",
    MEGA_MOE_SM90 + "is_sm90_fp8_mega_moe_available": "(experts)",
    MEGA_MOE_SM90 + "run_sm90_mega_routed":
        "(experts, hidden_states, topk_ids, topk_weights, buf, num_tokens, *, hidden_size, activation_clamp=None, "
        "routed_scaling_factor=1.0)",
    MEGA_MOE + "_get_mega_moe_symm_buffer":
        "(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, num_shared_experts=0, "
        "*, mma_type, activation='swiglu')",
    _ARGS + "mega_moe_hook.handle_mega_moe": "(server_args)",
    _ARGS + "mega_moe_hook.validate_mega_moe_token_budget_for_model": "(server_args)",
    _ARGS + "mega_moe_hook.validate_mega_moe_token_budget": "(server_args, model_label)",
    _ARGS + "overrides.declare_resolution": "(server_args, source, **fields)",
    _ARGS + "resolution_hooks.register_resolution_hook": "(name)",
}
# 0.5.17, the one release with the SM90 mega-MoE path that pins torch 2.11 (docs/sglang.md,
# "Which sglang releases"): the routed forward takes DeepSeek-V2's MoE block, the buffer has
# no MMA type, and resolution has no hooks: the plugin wraps ServerArgs.__post_init__.
SIGNATURES_0_5_17: Dict[str, str] = {
    MODEL_RUNNER + "load_model": "(self)",
    WEIGHT_UPDATER + "_model_load_weights_direct": "(model, named_tensors)",
    MEGA_MOE + "forward_mega_moe": "(moe, hidden_states, forward_batch=None, input_ids_global=None)",
    MEGA_MOE + "_run_mega_routed": "(moe, hidden_states, forward_batch, input_ids_global, num_tokens)",
    MEGA_MOE_SM90 + "build_sm90_mega_moe_experts_weights": "(experts)",
    MEGA_MOE_SM90 + "is_sm90_fp8_mega_moe_available": "(experts)",
    MEGA_MOE_SM90 + "run_sm90_mega_routed": "(moe, hidden_states, topk_ids, topk_weights, buf, num_tokens)",
    MEGA_MOE + "_get_mega_moe_symm_buffer":
        "(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)",
    MEGA_MOE + "should_use_mega_moe": "(moe, hidden_states)",
    SERVER_ARGS_POST_INIT: "(self)",
    "sglang.srt.server_args.add_moe_runner_backend_choices": "(choices)",
}
# (first version, first version past it, signatures): the releases the plugin was written for.
LINES: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...], Dict[str, str]], ...] = (
    ((0, 5, 17), (0, 5, 18), SIGNATURES_0_5_17),
    ((0, 5, 23), (0, 6), SIGNATURES_0_5_23),
)
SUPPORTED_RANGE = "==0.5.17 or >=0.5.23,<0.6"

_lock = threading.RLock()
_registered = False


def signature_text(fn: Callable) -> str:
    """A function's parameters as written in its def, without annotations."""
    parts, star = [], False
    params = list(inspect.signature(fn).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is p.empty else f"={p.default!r}"
        parts.append(f"{prefix}{p.name}{default}")
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def signatures_for(version: str) -> Optional[Dict[str, str]]:
    """The hooked functions' expected signatures for this sglang version (None: unsupported)."""
    v = _version_tuple(version)
    for first, past, signatures in LINES:
        if first <= v < past:
            return signatures
    return None


def version_problem(version: str) -> Optional[str]:
    if signatures_for(version) is None:
        return f"it was written for sglang {SUPPORTED_RANGE}, this is sglang {version}"
    return None


def signature_problem(expected: Dict[str, str],
                      resolve: Callable[[str], object] = pkgutil.resolve_name) -> Optional[str]:
    """The first hooked function that is missing or changed, described; None when all match."""
    for path, signature in expected.items():
        try:
            fn = resolve(path)
        except (ImportError, AttributeError) as e:
            return f"sglang has no {path} ({type(e).__name__}: {e})"
        found = signature_text(fn)
        if found != signature:
            return f"sglang's {path} takes {found}, the plugin was written for {signature}"
    return None


def is_0_5_17() -> bool:
    """Whether the running sglang is the 0.5.17 line (its own hook points, see SIGNATURES_0_5_17)."""
    import sglang

    return signatures_for(getattr(sglang, "__version__", "unknown")) is SIGNATURES_0_5_17


def _add_backend_choice() -> None:
    if is_0_5_17():
        from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES, add_moe_runner_backend_choices
    else:
        from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES, add_moe_runner_backend_choices

    if BACKEND not in MOE_RUNNER_BACKEND_CHOICES:
        add_moe_runner_backend_choices([BACKEND])


def _install_resolution_hooks() -> None:
    from . import resolution

    if is_0_5_17():
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(resolution.SERVER_ARGS_POST_INIT, resolution.post_init_0_5_17, HookType.AROUND)
        HookRegistry.apply_hooks()  # as in _install_layer_hooks
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_mega_moe")(resolution.handle_mega_moe)
    register_resolution_hook("validate_mega_moe_token_budget_for_model")(resolution.validate_token_budget)


def _install_layer_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import layer

    for target, hook in (layer.HOOKS_0_5_17 if is_0_5_17() else layer.HOOKS).items():
        HookRegistry.register(target, hook, HookType.AROUND)
    # Inside load_plugins() SGLang applies the hooks right after the plugins ran; applying
    # them here too covers a direct register() call (already patched targets are skipped).
    HookRegistry.apply_hooks()


def register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        try:
            import sglang

            version = getattr(sglang, "__version__", "unknown")
            expected = signatures_for(version)
            why = version_problem(version) if expected is None else signature_problem(expected)
            refusals.record_incompatibility(why)
            _add_backend_choice()
            _install_resolution_hooks()
            if why is None:
                _install_layer_hooks()
                logger.debug("megamoe_plugin: registered --moe-runner-backend %s", BACKEND)
            else:
                logger.error("megamoe_plugin: --moe-runner-backend %s is unavailable: %s", BACKEND, why)
        except Exception as e:  # SGLang would swallow it; keep the reason for the user
            refusals.record_incompatibility(f"registering the plugin failed ({type(e).__name__}: {e})")
            logger.exception("megamoe_plugin: %s", refusals.incompatibility())


def is_registered() -> bool:
    return _registered
