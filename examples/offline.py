"""Offline generation with the MegaMoE kernel: `LLM(..., moe_backend="megamoe_sm90")`.

    pip install 'megamoe_plugin[vllm,cutlass]'
    python examples/offline.py                                    # Qwen3-30B-A3B-FP8 on one Hopper GPU
    python examples/offline.py --model deepseek-ai/DeepSeek-V3 --tensor-parallel-size 8

The default model (128 experts, top-8, hidden 2048, intermediate 768, 128x128 block FP8)
fits one H100/H200: the EP group is one rank, so there is no dispatch, but the kernel
still fuses both FP8 GEMMs, SwiGLU, the top-k weighting and the combine in one launch.

With --tensor-parallel-size N the script adds enable_expert_parallel: experts are split
over the N GPUs and the kernel dispatches over NVLink. `LLM` runs one data-parallel rank,
so all N GPUs see the same tokens and dispatch is N times redundant (the plugin logs a
warning); for the deployment the kernel is built for (data parallel + expert parallel)
use `vllm serve` as in examples/serve.sh.

Pass `moe_backend=` (not `kernel_config={"moe_backend": ...}`): vLLM validates a
kernel_config dict before it loads plugins.

Expected output (after vLLM's loading logs, which include
"megamoe_sm90: symmetric buffer for 128 experts, top-8, hidden 2048, intermediate 768, up
to 8192 tokens/rank over 1 EP rank(s): 501.0 MiB per rank" and the kernel compile progress
bar), one block per prompt; the completions depend on the model and vLLM version:

    Processed prompts: 100%|██████████| 4/4 [...]
    --------------------------------------------------------------------------------
    Prompt:    'The capital of France is'
    Generated: ' Paris. It is located in the north-central part of the country ...'
    --------------------------------------------------------------------------------
    ... (3 more) ...
    megamoe_sm90: 4 prompts, 256 generated tokens in 1.9 s

With greedy sampling the text should read as the model's normal output; compare with
`--moe-backend auto` to see vLLM's default kernels produce (near-)identical completions.
"""
import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-30B-A3B-FP8")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--moe-backend", default="megamoe_sm90",
                        help="megamoe_sm90, or e.g. 'auto' for vLLM's default kernels (a baseline)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="also sizes the MegaMoE symmetric buffer")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        quantization="fp8",
        moe_backend=args.moe_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.tensor_parallel_size > 1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
    )
    prompts = [
        "The capital of France is",
        "Explain in one sentence what a mixture-of-experts layer does:",
        "Write a haiku about GPUs:",
        "def fibonacci(n):",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        text = out.outputs[0].text
        generated += len(out.outputs[0].token_ids)
        print("-" * 80)
        print(f"Prompt:    {out.prompt!r}")
        print(f"Generated: {text!r}")
    print(f"{args.moe_backend}: {len(prompts)} prompts, {generated} generated tokens in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
