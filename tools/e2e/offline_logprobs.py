"""Prompt logprobs of the fixed prompts (logprobs_client.PROMPTS) from an offline `LLM`
with input-dependent dummy weights (scaled_dummy_weights.py), in the JSON format of
logprobs_client.py, so compare_logprobs.py can compare two MoE backends on equal weights.

    MODEL_DIR=... python3 tools/e2e/offline_logprobs.py default OUT.json
    MODEL_DIR=... python3 tools/e2e/offline_logprobs.py megamoe_sm90 OUT.json
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the weight patch must reach the engine
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scaled_dummy_weights  # noqa: E402
from logprobs_client import PROMPTS  # noqa: E402


def main() -> int:
    backend, out_path = sys.argv[1], sys.argv[2]
    scaled_dummy_weights.install()
    from vllm import LLM, SamplingParams

    extra = {} if backend == "default" else {"moe_backend": backend}
    llm = LLM(model=os.environ["MODEL_DIR"], quantization="fp8", load_format="dummy", enforce_eager=True,
              max_model_len=1024, gpu_memory_utilization=0.4, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, prompt_logprobs=1)
    results = []
    for out in llm.generate(PROMPTS, params):
        gen = out.outputs[0]
        results.append({
            "prompt": out.prompt,
            # Per prompt position the top-1 logprob (None for the first token), as logprobs_client.
            "prompt_logprobs": [max(lp.logprob for lp in d.values()) if d else None
                                for d in out.prompt_logprobs],
            "text": gen.text,
            "token_logprobs": [d[t].logprob for t, d in zip(gen.token_ids, gen.logprobs)],
        })
        print(repr(out.prompt[:40]), "->", repr(gen.text))
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
