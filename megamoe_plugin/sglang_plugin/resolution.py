"""The argument-resolution steps the plugin wraps (SGLang's `register_resolution_hook`).

`--moe-runner-backend megamoe_sm90` resolves to what SGLang's own `--moe-runner-backend
megamoe` alias resolves to (`moe_a2a_backend="megamoe"`, `moe_runner_backend="auto"`), so
every later step and every SGLang process treats the deployment as mega-MoE: SGLang's SM90
check, its refusal of two-/single-batch overlap, its token budget, its model forwards. The
raw field keeps "megamoe_sm90" (SGLang never rewrites the operator's input): `selected_by`
reads it, in the launcher and in every scheduler process.

sglang 0.5.17 has no resolution hooks and writes the resolved values over the operator's
input, so there the plugin wraps `ServerArgs.__post_init__` (`post_init_0_5_17`): it rewrites
the flag into what `--moe-a2a-backend megamoe` means there before SGLang resolves, and marks
the record (`MARKER`, an attribute that travels with it to the scheduler processes).
"""
from __future__ import annotations

from . import BACKEND, refusals


SERVER_ARGS_POST_INIT = "sglang.srt.server_args.ServerArgs.__post_init__"
MARKER = "_megamoe_sm90"  # on a 0.5.17 ServerArgs that selected the backend (underscored: SGLang lets it be set)
# sglang 0.5.17 runs the mega-MoE forward only from DeepSeek-V2's MoE block (models/deepseek_v2.py);
# any other model would run its usual MoE forward over weights in the kernel's layout.
MEGA_MOE_ARCHS_0_5_17 = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


def selected_by(server_args) -> bool:
    """Whether these server arguments ask for this backend (the operator's input, or 0.5.17's mark)."""
    return getattr(server_args, "moe_runner_backend", None) == BACKEND or getattr(server_args, MARKER, False)


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


def post_init_0_5_17(original, server_args) -> None:
    """sglang 0.5.17's argument resolution, around `ServerArgs.__post_init__`."""
    if not selected_by(server_args):
        return original(server_args)
    if refusals.incompatibility() is not None:
        raise refusals.IncompatibleSGLangError(refusals.incompatibility())
    refusals.check_arguments(server_args)
    # 0.5.17 has no `--moe-runner-backend megamoe` alias: its mega-MoE path is selected by the
    # a2a backend alone, with the runner left to "auto" (a runner name it does not know fails
    # its MoE configuration). Fields may be assigned until SGLang materializes its resolution.
    server_args.moe_runner_backend = "auto"
    server_args.moe_a2a_backend = "megamoe"
    setattr(server_args, MARKER, True)
    original(server_args)
    refusals.check_resolved_0_5_17(server_args, server_args.get_model_config().hf_config.architectures[0],
                                   MEGA_MOE_ARCHS_0_5_17, token_cap())


def token_cap() -> int:
    from sglang.srt.environ import envs

    return int(envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get())
