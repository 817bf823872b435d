#!/usr/bin/env bash
# Benchmark a running server (examples/serve.sh) with `vllm bench serve` on the random
# dataset: 512 prompts of 1024 input tokens, 256 output tokens each (EOS ignored, so every
# request generates exactly 256 tokens), at most 64 in flight.
#
#   MODEL=deepseek-ai/DeepSeek-V3 ./examples/bench_serve.sh      # extra args go to vllm bench serve
#
# For a baseline, restart the server without `--moe-backend megamoe_sm90` (vLLM's default
# MoE backend) and run this script again with the same arguments.
#
# Expected output: the request progress bar, then vLLM's result table (numbers depend on
# the GPUs, model and server flags; the counts are fixed by the arguments):
#   ============ Serving Benchmark Result ============
#   Successful requests:                     512
#   Failed requests:                         0
#   Maximum request concurrency:             64
#   Benchmark duration (s):                  ...
#   Total input tokens:                      524288
#   Total generated tokens:                  131072
#   Request throughput (req/s):              ...
#   Output token throughput (tok/s):         ...
#   Total token throughput (tok/s):          ...
#   ---------------Time to First Token----------------
#   Mean TTFT (ms):                          ...
#   Median TTFT (ms):                        ...
#   P99 TTFT (ms):                           ...
#   -----Time per Output Token (excl. 1st token)------
#   Mean TPOT (ms):                          ...
#   ...
#   ---------------Inter-token Latency----------------
#   Mean ITL (ms):                           ...
#   ==================================================
# Failed requests must be 0; compare output-token throughput and TPOT with the baseline.
set -euo pipefail

MODEL=${MODEL:-deepseek-ai/DeepSeek-V3}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}

exec vllm bench serve \
    --backend vllm \
    --model "$MODEL" \
    --base-url "http://${HOST}:${PORT}" \
    --dataset-name random \
    --random-input-len 1024 \
    --random-output-len 256 \
    --num-prompts 512 \
    --max-concurrency 64 \
    --ignore-eos \
    "$@"
