#!/bin/bash
# One sglang server with one MoE backend on this machine's GPUs, SGLang's serving benchmark against
# it, and the greedy prompt logprobs of fixed token ids (for comparing backends), then stop.
#
#   TOKENIZER_DIR=DIR BACKEND=megamoe_sm90 bash tools/e2e/sglang_serve_bench.sh [RESULTS_DIR]
#
#   BACKEND        megamoe_sm90 (this plugin), deepgemm (DeepGEMM's MegaMoE), default (SGLang's MoE)
#   TOKENIZER_DIR  a folder holding tokenizer.json and tokenizer_config.json of a vocabulary of at most
#                  32000 tokens (the models' vocab_size; with dummy weights nothing else of it matters)
#   MODEL_DIR      the model config to serve (default tools/e2e/models/deepseek_v3_fp8, a DeepSeek-V3-
#                  shaped block-FP8 model of 8 layers; dummy weights, so the folder needs no weights)
#   RESULTS_DIR    where the logs and results go (default ./e2e-results)
#   ROUND          a label for alternating runs (1)
#   SERVE_ARGS / BENCH_ARGS   extra flags (later flags win), e.g. SERVE_ARGS="--tp-size 8 --ep-size 8"
#   SCALED_WEIGHTS=1  input-dependent dummy weights (sglang_scaled_weights/sitecustomize.py), so that
#                  the logprobs of two backends can disagree; use it for every backend of a comparison
#   SGLANG_PORT (30000), HEALTH_TIMEOUT (600 s), PYTHON (python3)
# Writes RESULTS_DIR/serve_<BACKEND>_r<ROUND>.log, bench_*.log, bench_*.jsonl, logprobs_*.json, and prints
# the benchmark's figures and the server's decode throughput (decode_steps.py); compare two backends'
# logprobs with `python3 tools/e2e/compare_logprobs.py A.json B.json`.
set -uo pipefail
BACKEND=${BACKEND:?set BACKEND to megamoe_sm90, deepgemm or default}
TOKENIZER_DIR=${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with tokenizer.json and tokenizer_config.json}
TAG=${BACKEND}_r${ROUND:-1}
PORT=${SGLANG_PORT:-30000}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL_DIR=${MODEL_DIR:-$HERE/models/deepseek_v3_fp8}
RESULTS_DIR=${1:-./e2e-results}
mkdir -p "$RESULTS_DIR" && RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd) || exit 1
log() { echo "[sglang_serve_bench $(date +%H:%M:%S)] $*"; }
# Started from a checkout's root, `python -m` would import the checkout's megamoe_plugin (without its
# built runtime extension) ahead of the installed one.
export PYTHONSAFEPATH=1
case $BACKEND in
  megamoe_sm90) FLAGS=(--moe-runner-backend megamoe_sm90) ;;
  deepgemm) FLAGS=(--moe-a2a-backend megamoe) ;;
  default) FLAGS=() ;;
  *) log "unknown BACKEND $BACKEND"; exit 2 ;;
esac

M=$RESULTS_DIR/model
bash "$HERE/served_folder.sh" "$MODEL_DIR" "$TOKENIZER_DIR" "$M" || exit 2

# The same flags for every backend: dummy weights (SGLang's dummy loader is seeded), triton
# attention (no FlashAttention library needed), chunks and graphs under sglang 0.5.17's per-rank
# token cap (1024), shared experts outside the routed MoE (the same work for all three).
log "BACKEND=$BACKEND: sglang.launch_server ${FLAGS[*]} ${SERVE_ARGS:-} (SCALED_WEIGHTS=${SCALED_WEIGHTS:-0})"
SERVER_PYTHONPATH=${PYTHONPATH:-}
[ "${SCALED_WEIGHTS:-0}" != 0 ] && SERVER_PYTHONPATH=$HERE/sglang_scaled_weights${PYTHONPATH:+:$PYTHONPATH}
PYTHONPATH=$SERVER_PYTHONPATH "$PY" -m sglang.launch_server --model-path "$M" --load-format dummy --attention-backend triton \
  --chunked-prefill-size 1024 --cuda-graph-max-bs-decode 256 --disable-shared-experts-fusion \
  --host 127.0.0.1 --port "$PORT" "${FLAGS[@]}" ${SERVE_ARGS:-} > "$RESULTS_DIR/serve_$TAG.log" 2>&1 &
SERVER=$!
stop() { kill "$SERVER" 2> /dev/null; wait "$SERVER" 2> /dev/null; }
trap stop EXIT

"$PY" "$HERE/wait_healthy.py" "$PORT" "${HEALTH_TIMEOUT:-600}" "$SERVER" || { tail -40 "$RESULTS_DIR/serve_$TAG.log"; exit 3; }

log "benchmark ${BENCH_ARGS:-}"
"$PY" -m sglang.benchmark.serving --backend sglang --host 127.0.0.1 --port "$PORT" \
  --dataset-name random-ids --random-input-len 1024 --random-output-len 256 --random-range-ratio 1 \
  --num-prompts 256 --max-concurrency 64 --output-file "$RESULTS_DIR/bench_$TAG.jsonl" ${BENCH_ARGS:-} \
  > "$RESULTS_DIR/bench_$TAG.log" 2>&1 || log "benchmark failed (rc $?)"
grep -E "^(Successful|Request|Output|Total|Mean|Median|P99) .*(requests|throughput|TTFT|TPOT|ITL)" "$RESULTS_DIR/bench_$TAG.log"
"$PY" "$HERE/decode_steps.py" "$RESULTS_DIR/serve_$TAG.log" || log "no decode report in the server log"

# Prompt logprobs of fixed token ids, greedy (tools/e2e/compare_logprobs.py compares two files).
"$PY" "$HERE/sglang_logprobs.py" "$PORT" "$RESULTS_DIR/logprobs_$TAG.json" || log "logprobs failed"
