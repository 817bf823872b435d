#!/bin/bash
# One `vllm serve` with one MoE backend on this machine's GPUs, `vllm bench serve` against it, and
# the prompt logprobs of fixed prompts (logprobs_client.py), then stop.
#
#   TOKENIZER_DIR=DIR BACKEND=megamoe_sm90 bash tools/e2e/vllm_serve_bench.sh [RESULTS_DIR]
#
#   BACKEND        megamoe_sm90 (this plugin) or default (vLLM's own choice: its Triton fused MoE here)
#   TOKENIZER_DIR  a folder holding tokenizer.json and tokenizer_config.json of a vocabulary of at most
#                  32000 tokens (the model's vocab_size; with dummy weights nothing else of it matters)
#   MODEL_DIR      the model config to serve (default tools/e2e/models/qwen3_moe_fp8, a Qwen3-MoE-shaped
#                  block-FP8 model of 8 layers, 128 experts, top-8; dummy weights, so no weights needed)
#   RESULTS_DIR    where the logs and results go (default ./e2e-results)
#   ROUND          a label for alternating runs (1)
#   SERVE_ARGS / BENCH_ARGS   extra flags (later flags win), e.g. BENCH_ARGS="--num-prompts 256"
#   VLLM_PORT (8000), HEALTH_TIMEOUT (900 s), PYTHON (python3)
# Writes RESULTS_DIR/serve_<BACKEND>_r<ROUND>.log, bench_*.log, bench_*.json, logprobs_*.json.
# With vLLM's plain dummy weights every backend's logprobs are uniform: compare outputs with
# offline_logprobs.py instead (README.md here).
set -uo pipefail
BACKEND=${BACKEND:?set BACKEND to megamoe_sm90 or default}
TOKENIZER_DIR=${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with tokenizer.json and tokenizer_config.json}
TAG=${BACKEND}_r${ROUND:-1}
PORT=${VLLM_PORT:-8000}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL_DIR=${MODEL_DIR:-$HERE/models/qwen3_moe_fp8}
RESULTS_DIR=${1:-./e2e-results}
mkdir -p "$RESULTS_DIR" && RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd) || exit 1
log() { echo "[vllm_serve_bench $(date +%H:%M:%S)] $*"; }
# Started from a checkout's root, `python -m` would import the checkout's megamoe_plugin (without its
# built runtime extension) ahead of the installed one.
export PYTHONSAFEPATH=1
case $BACKEND in
  megamoe_sm90) FLAGS=(--moe-backend megamoe_sm90) ;;
  default) FLAGS=() ;;
  *) log "unknown BACKEND $BACKEND"; exit 2 ;;
esac

M=$RESULTS_DIR/model
bash "$HERE/served_folder.sh" "$MODEL_DIR" "$TOKENIZER_DIR" "$M" || exit 2

log "BACKEND=$BACKEND: vllm serve ${FLAGS[*]} ${SERVE_ARGS:-}"
"$PY" -m vllm.entrypoints.cli.main serve "$M" --load-format dummy --quantization fp8 --served-model-name tiny-moe \
  --max-model-len 4096 --host 127.0.0.1 --port "$PORT" "${FLAGS[@]}" ${SERVE_ARGS:-} \
  > "$RESULTS_DIR/serve_$TAG.log" 2>&1 &
SERVER=$!
stop() { kill "$SERVER" 2> /dev/null; wait "$SERVER" 2> /dev/null; }
trap stop EXIT

"$PY" "$HERE/wait_healthy.py" "$PORT" "${HEALTH_TIMEOUT:-900}" "$SERVER" || { tail -40 "$RESULTS_DIR/serve_$TAG.log"; exit 3; }

log "benchmark ${BENCH_ARGS:-}"
"$PY" -m vllm.entrypoints.cli.main bench serve --backend vllm --model tiny-moe --tokenizer "$M" \
  --base-url "http://127.0.0.1:$PORT" --dataset-name random --random-input-len 1024 --random-output-len 256 \
  --num-prompts 1024 --max-concurrency 64 --ignore-eos \
  --save-result --result-dir "$RESULTS_DIR" --result-filename "bench_$TAG.json" ${BENCH_ARGS:-} \
  > "$RESULTS_DIR/bench_$TAG.log" 2>&1 || log "benchmark failed (rc $?)"
grep -E "throughput|TTFT|TPOT" "$RESULTS_DIR/bench_$TAG.log"

BASE_URL="http://127.0.0.1:$PORT" MODEL_NAME=tiny-moe "$PY" "$HERE/logprobs_client.py" "$RESULTS_DIR/logprobs_$TAG.json" \
  || log "logprobs failed"
