"""Offline check: load the dummy-weight FP8 MoE model with the plugin's backend through
`LLM(...)` and generate text; exit status 1 if a prompt got no tokens.

    MODEL_DIR=<config.json + tokenizer folder> python3 tools/e2e/offline_generate.py
"""
import os
import sys


def main() -> int:
    from vllm import LLM, SamplingParams

    llm = LLM(model=os.environ["MODEL_DIR"], quantization="fp8", moe_backend="megamoe_sm90", load_format="dummy",
              max_model_len=1024, gpu_memory_utilization=0.5)
    outputs = llm.generate(["The capital of France is", "def add(a, b):"],
                           SamplingParams(temperature=0.0, max_tokens=16))
    for out in outputs:
        print(repr(out.prompt), "->", repr(out.outputs[0].text))
    return 0 if all(out.outputs[0].token_ids for out in outputs) else 1


if __name__ == "__main__":
    sys.exit(main())
