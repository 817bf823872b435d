"""Against a running `vllm serve`: prompt logprobs on fixed prompts plus a short greedy
completion, saved as JSON, so two servers (vLLM's default MoE backend and megamoe_sm90,
same dummy weights) can be compared with compare_logprobs.py.

    BASE_URL=http://127.0.0.1:8000 MODEL_NAME=tiny-moe python3 tools/e2e/logprobs_client.py OUT.json
"""
import json
import os
import sys
import urllib.request

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969 the first humans landed on the Moon. The mission was called",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())",
]


def complete(base_url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
            "prompt_logprobs": 1}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.load(resp)["choices"][0]
    # prompt_logprobs: one {token_id: {logprob, ...}} per prompt token (None for the first).
    prompt_lp = [None if entry is None else max(v["logprob"] for v in entry.values())
                 for entry in choice.get("prompt_logprobs") or []]
    return {"prompt": prompt, "prompt_logprobs": prompt_lp, "text": choice["text"],
            "token_logprobs": choice.get("logprobs", {}).get("token_logprobs")}


def main() -> int:
    out_path = sys.argv[1]
    base_url = os.environ.get("BASE_URL", "http://127.0.0.1:8000")
    model = os.environ.get("MODEL_NAME", "tiny-moe")
    results = [complete(base_url, model, p) for p in PROMPTS]
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    for r in results:
        print(repr(r["prompt"][:40]), "->", repr(r["text"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
