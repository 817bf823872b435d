"""vLLM integration of the MegaMoE kernel: `--moe-backend megamoe_sm90`.

`register()` is the `vllm.general_plugins` entry point (setup.py:
`megamoe_sm90 = megamoe_plugin.vllm_plugin:register`). vLLM calls it in every process
(API server before argparse builds its flags, engine core, each worker, the model
registry subprocess, `vllm bench serve`). It is idempotent, imports only the vLLM
config modules it patches (no model/kernel modules) and never touches CUDA. It

1. adds "megamoe_sm90" to vLLM's `MoEBackend` Literal (KernelConfig, EngineArgs,
   SpeculativeConfig), so `--moe-backend megamoe_sm90`, `--kernel-config
   '{"moe_backend": "megamoe_sm90"}'` and `LLM(moe_backend="megamoe_sm90")` validate;
2. on vLLM versions with a "passthrough" all2all backend, binds it for this MoE backend
   (the kernel dispatches and combines itself);
3. registers `MegaMoEFp8Config` over vLLM's "fp8" quantization config, lazily: the
   class (and vLLM's heavy FP8 modules) is imported the first time vLLM looks "fp8" up.
   It hands MoE layers `MegaMoEFp8MoEMethod` when the backend is megamoe_sm90 and
   defers to vLLM's Fp8Config otherwise.
4. sends the package's log records (a kernel timeout's ERROR line from the watchdog,
   the warm-up's progress) to vLLM's "vllm.megamoe_sm90" logger, since vLLM's logging
   config shows only its "vllm.*" loggers (serving.route_logs_to).

See docs/vllm.md for how the plugin works and when the backend helps.

Test hook: `MEGAMOE_EXECUTOR=reference` (or `executor.set_executor("reference")`) makes
the MoE layers run the float32 reference (`megamoe_plugin.reference.mega_moe`) instead
of the GPU kernel; it is never selected implicitly.
"""
from __future__ import annotations

BACKEND = "megamoe_sm90"

__all__ = ["BACKEND", "register"]


def register() -> None:
    """vllm.general_plugins entry point: idempotent, cheap, CUDA-free."""
    from .registration import register as _register

    _register()
