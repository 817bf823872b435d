"""Input-dependent dummy weights for an sglang server (tools/e2e/scaled_dummy_weights.py's fill),
so that two MoE backends' logprobs can be compared (tools/e2e/README.md).

SGLang's `--load-format dummy` fills every parameter with uniform(-1e-3, 1e-3), as vLLM's does:
hidden states vanish, every next-token distribution is uniform, and any two backends "agree".
SGLang builds the model in its scheduler processes, which Python starts afresh, so the
replacement goes in through this sitecustomize: sglang_serve_bench.sh puts this folder first on the
server's PYTHONPATH when SCALED_WEIGHTS=1. Every Python process started with it runs this
file; it only registers an import hook (no torch, no sglang import). When
`sglang.srt.model_loader.loader` is imported, its `initialize_dummy_weights` (which its
DummyModelLoader calls before the weights' post-processing, so the kernel's weight transform
sees the filled weights) first runs as before, then `fill` overwrites every parameter it has a
rule for; the rest (1-D floats such as DeepSeek's e_score_correction_bias) keep SGLang's small
uniform values rather than whatever memory they were created with. Only for this tool; the
plugin never imports it.
"""
import importlib.abc
import os
import sys

TARGET = "sglang.srt.model_loader.loader"
E2E_TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/e2e


def scaled(initialize_dummy_weights):
    """SGLang's initialize_dummy_weights(model, low, high, seed), then the realistic-scale fill."""

    def scaled_initialize_dummy_weights(model, *args, **kwargs):
        initialize_dummy_weights(model, *args, **kwargs)
        if E2E_TOOLS not in sys.path:
            sys.path.insert(0, E2E_TOOLS)
        import scaled_dummy_weights

        left = scaled_dummy_weights.fill(model)
        print(f"scaled_weights: filled {sum(1 for _ in model.parameters())} parameters; "
              f"kept SGLang's dummy values: {left or 'none'}", flush=True)

    return scaled_initialize_dummy_weights


class LoaderPatch(importlib.abc.MetaPathFinder):
    """Finds TARGET through the other finders and replaces its initialize_dummy_weights once
    the module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            if not hasattr(module, "initialize_dummy_weights"):
                raise ImportError(f"scaled_weights: {TARGET} has no initialize_dummy_weights to replace "
                                  "(another sglang version?)")
            module.initialize_dummy_weights = scaled(module.initialize_dummy_weights)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, LoaderPatch())
