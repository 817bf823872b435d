"""Greedy prompt logprobs of fixed token ids from a running sglang server, written in the format
that tools/e2e/compare_logprobs.py compares (the vLLM tools' format: one record per prompt with
"prompt", "prompt_logprobs", "text", "token_logprobs").

    python3 tools/e2e/sglang_logprobs.py PORT OUT.json
"""
import json
import random
import sys
import urllib.request

VOCAB = 32000  # vocab_size of tools/e2e/models/*/config.json
PROMPT_LENGTHS = (16, 128, 512, 1000)


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def records(input_ids, outputs):
    """sglang's /generate answers (meta_info.{input,output}_token_logprobs: [logprob, token id, text])
    as compare_logprobs.py records; the first prompt token has no logprob (None)."""
    if len(outputs) != len(input_ids):
        raise ValueError(f"{len(outputs)} answers for {len(input_ids)} prompts")
    out = []
    for ids, o in zip(input_ids, outputs):
        meta = o["meta_info"]
        out.append({"prompt": ids,
                    "prompt_logprobs": [entry[0] for entry in meta["input_token_logprobs"]],
                    "text": [entry[1] for entry in meta["output_token_logprobs"]],
                    "token_logprobs": [entry[0] for entry in meta["output_token_logprobs"]]})
    return out


def main(argv=None) -> int:
    port, path = (argv or sys.argv[1:])
    ids = prompts()
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    req = urllib.request.Request(f"http://127.0.0.1:{int(port)}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as answer:
        outputs = json.load(answer)
    with open(path, "w") as f:
        json.dump(records(ids, outputs), f)
    print(f"logprobs of {len(ids)} prompts in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
