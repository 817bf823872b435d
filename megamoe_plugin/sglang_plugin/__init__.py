"""SGLang integration of the MegaMoE kernel: `--moe-runner-backend megamoe_sm90`.

`register()` is the `sglang.srt.plugins` entry point (setup.py:
`megamoe_sm90 = megamoe_plugin.sglang_plugin:register`). SGLang calls it in every process
before it parses arguments, and swallows (logs) what it raises, so register() never raises:
a problem it finds is raised, with its reason, when a user selects the backend. It is
idempotent and touches no CUDA. It

1. adds "megamoe_sm90" to `--moe-runner-backend`'s choices (SGLang's
   `add_moe_runner_backend_choices`, meant for out-of-tree backends);
2. wraps the resolution step `handle_mega_moe`: the flag resolves to SGLang's own mega-MoE
   path (`moe_a2a_backend="megamoe"`, `moe_runner_backend="auto"`, exactly what SGLang's
   `--moe-runner-backend megamoe` alias resolves to), so SGLang's process groups, token-budget
   checks, CUDA-graph handling and per-model mega-MoE forwards run unchanged; the operator's
   input "megamoe_sm90" stays on the server-args record, which tells every process that the
   layers run this kernel rather than DeepGEMM's;
3. wraps the SM90 mega-MoE functions (SGLang's HookRegistry, AROUND hooks that call the
   original when the backend is not selected): the expert-weight build (our weight
   transform, after the refusals), the buffer (ours), the routed forward (our staging
   and kernel, or the float32 reference under MEGAMOE_EXECUTOR=reference), the MoE block's
   forward, and the model load (`ModelRunner.load_model`: after it, the blocks' shared experts
   move into the kernel's call, shared_experts.py).

Before any of that it checks the SGLang version and the signature of every function it
hooks (registration.py); see docs/sglang.md. That is sglang 0.5.23 and later 0.5.x; sglang
0.5.17 (the release whose pins fit torch 2.11) has other hook points for the same three
steps: the choice in server_args, resolution around `ServerArgs.__post_init__`, and the
layer hooks adapted to its DeepSeek-V2-only mega-MoE forward (registration.SIGNATURES_0_5_17).
"""
from __future__ import annotations

BACKEND = "megamoe_sm90"
# Where the functions the plugin hooks live in sglang (registration.SIGNATURES_*, layer.HOOKS*).
MEGA_MOE = "sglang.srt.layers.moe.mega_moe."
MEGA_MOE_SM90 = "sglang.srt.layers.moe.mega_moe_sm90."
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner."
WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater."

__all__ = ["BACKEND", "register"]


def register() -> None:
    """sglang.srt.plugins entry point: idempotent, cheap, CUDA-free, never raises."""
    from .registration import register as _register

    _register()
