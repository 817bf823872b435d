#!/usr/bin/env bash
# Serve a DeepSeek-V3-class FP8 block-quantized MoE model on one node of 8 Hopper GPUs
# (H100/H200/H800) with the MegaMoE kernel: 8 data-parallel ranks, each scheduling its
# own requests, and expert parallelism over all 8 (the deployment the kernel is built for;
# see docs/vllm.md).
#
#   pip install 'megamoe_plugin[vllm,cutlass]'
#   MODEL=deepseek-ai/DeepSeek-V3 ./examples/serve.sh            # extra args go to vllm serve
#
# Expected output (abridged; timestamps and pids omitted):
#   INFO ... moe_backend='megamoe_sm90': using all2all_backend='passthrough' (dispatch and
#            combine run inside the MegaMoE kernel).                     [vLLM >= 0.33]
#   ... model loading on each of the 8 DP ranks ...
#   INFO ... megamoe_sm90: symmetric buffer for 256 experts, top-8, hidden 7168,
#            intermediate 2048, up to 8192 tokens/rank over 8 EP rank(s): 1884.6 MiB per rank
#   INFO ... megamoe_sm90: compiling the kernel variants for N batch sizes (1..8192 tokens)
#   megamoe: compiling kernels: 100%|██████████| k/k [..]    (tqdm progress bar, once per rank;
#                                                            cached on disk for later starts)
#   INFO ... megamoe_sm90: k kernel variant(s) ready in ...s
#   ... CUDA graph capture ...
#   INFO ... Starting vLLM API server ... on http://0.0.0.0:8000
#   INFO:     Application startup complete.
# Then `curl http://localhost:8000/v1/models` lists the model, and examples/bench_serve.sh
# measures it.
#
# A refused deployment stops at model load with a message naming the fix, e.g. on A100s:
#   ValueError: --moe-backend megamoe_sm90: the kernel runs on SM90 GPUs (H100, H200, H800,
#   H20) only, this process has NVIDIA A100-SXM4-80GB (sm_80). To fix: run on Hopper GPUs or
#   pick another --moe-backend (e.g. leave it at 'auto').
set -euo pipefail

MODEL=${MODEL:-deepseek-ai/DeepSeek-V3}
PORT=${PORT:-8000}
# Sizes the symmetric buffer (taken from the KV-cache budget): ~1.84 GiB/GPU at 8192 for V3.
MAX_BATCHED_TOKENS=${MAX_BATCHED_TOKENS:-8192}

exec vllm serve "$MODEL" \
    --quantization fp8 \
    --moe-backend megamoe_sm90 \
    --data-parallel-size 8 \
    --enable-expert-parallel \
    --max-num-batched-tokens "$MAX_BATCHED_TOKENS" \
    --port "$PORT" \
    "$@"
