"""Compares two logprobs_client.py outputs (same prompts, same dummy weights, two MoE
backends): the largest and mean absolute difference of the prompt-token logprobs, and
whether the greedy completions agree. Exit status 1 if the largest difference exceeds
--tolerance (default 0.1 nats, several times what FP8 requantization differences give);
exit status 2 if the reference is degenerate: its logprobs (nearly) do not depend on the
input, as with vLLM's plain `--load-format dummy` weights (every next-token distribution
uniform), so no MoE backend could disagree with it (use offline_logprobs.py instead).

    python3 tools/e2e/compare_logprobs.py default.json megamoe.json [--tolerance 0.1]
"""
import argparse
import json
import sys


def compare(a, b):
    diffs, same_text = [], 0
    for ra, rb in zip(a, b):
        if ra["prompt"] != rb["prompt"]:
            raise ValueError(f"prompts differ: {ra['prompt']!r} vs {rb['prompt']!r}")
        diffs += [abs(x - y) for x, y in zip(ra["prompt_logprobs"], rb["prompt_logprobs"])
                  if x is not None and y is not None]
        same_text += ra["text"] == rb["text"]
    return max(diffs, default=0.0), sum(diffs) / max(len(diffs), 1), same_text, len(a)


DEGENERATE_SPREAD = 1e-2  # nats: max - min of every reference prompt logprob


def spread(results) -> float:
    values = [x for r in results for x in r["prompt_logprobs"] if x is not None]
    return max(values) - min(values) if values else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("reference")
    parser.add_argument("candidate")
    parser.add_argument("--tolerance", type=float, default=0.1)
    args = parser.parse_args(argv)
    with open(args.reference) as f:
        ref = json.load(f)
    with open(args.candidate) as f:
        cand = json.load(f)
    if spread(ref) < DEGENERATE_SPREAD:
        print(f"degenerate reference: its prompt logprobs span {spread(ref):.2e} nats (uniform next-token "
              "distributions), so it cannot tell backends apart")
        return 2
    worst, mean, same, total = compare(ref, cand)
    print(f"prompt logprobs: max |diff| {worst:.4f} nats, mean {mean:.4f}; greedy completions equal in "
          f"{same} of {total} prompts; tolerance {args.tolerance}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
