"""The argument-resolution steps the plugin wraps (SGLang's `register_resolution_hook`).

`--moe-runner-backend megamoe_sm90` resolves to what SGLang's own `--moe-runner-backend
megamoe` alias resolves to (`moe_a2a_backend="megamoe"`, `moe_runner_backend="auto"`), so
every later step and every SGLang process treats the deployment as mega-MoE: SGLang's SM90
check, its refusal of two-/single-batch overlap, its token budget, its model forwards. The
raw field keeps "megamoe_sm90" (SGLang never rewrites the operator's input): `selected_by`
reads it, in the launcher and in every scheduler process.
"""
from __future__ import annotations

from . import BACKEND, refusals


def selected_by(server_args) -> bool:
    """Whether these server arguments ask for this backend (the operator's input)."""
    return getattr(server_args, "moe_runner_backend", None) == BACKEND


def handle_mega_moe(server_args, previous) -> None:
    if selected_by(server_args):
        if refusals.incompatibility() is not None:
            raise refusals.IncompatibleSGLangError(refusals.incompatibility())
        from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

        refusals.check_arguments(resolving_view(server_args))
        declare_resolution(server_args, "megamoe_plugin", moe_runner_backend="auto", moe_a2a_backend="megamoe")
    previous(server_args)


def validate_token_budget(server_args, previous) -> None:
    """SGLang checks the mega-MoE token budget only for models without a fallback MoE path;
    this backend has none for any model (its weight layout is the kernel's), so check it
    for every model."""
    previous(server_args)
    if not selected_by(server_args):
        return
    from sglang.srt.arg_groups.mega_moe_hook import validate_mega_moe_token_budget
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    if getattr(resolving_view(server_args), "encoder_only", False):
        return
    validate_mega_moe_token_budget(server_args, model_config_of(server_args).hf_config.architectures[0])
