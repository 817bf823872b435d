#!/bin/bash
# GPU side (ran on one H200 in results round 11): one sglang 0.5.17 server with one MoE backend, SGLang's serving benchmark
# against it, and the prompt logprobs of fixed token ids (for comparing backends), then stop.
# tools/sglang_on_gpu/README.md gives the calls. It runs as vllm_on_gpu's RUN_CMD, from the repo root:
# gpu_run.sh has installed the bundle and this plugin, and exports PYTHONPATH, OUT and MODEL_DIR
# (its model folder, whose tokenizer this reuses).
#
#   BACKEND   megamoe_sm90 (this kernel), deepgemm (DeepGEMM's MegaMoE), default (SGLang's MoE)
#   ROUND     a label for alternating runs (1)
#   SERVE_ARGS / BENCH_ARGS   extra flags (later flags win)
#   SCALED_WEIGHTS=1  input-dependent dummy weights (scaled_weights/sitecustomize.py), so that the
#             logprobs of two backends can disagree; use it for every backend of a comparison
#   SGLANG_PORT (30000), HEALTH_TIMEOUT (600 s), PY (python3)
# Writes $OUT/serve_<BACKEND>_r<ROUND>.log, bench_*.log, bench_*.jsonl, logprobs_*.json.
set -uo pipefail
BACKEND=${BACKEND:?set BACKEND to megamoe_sm90, deepgemm or default}
TAG=${BACKEND}_r${ROUND:-1}
PORT=${SGLANG_PORT:-30000}
PY=${PY:-python3}
OUT=${OUT:-/tmp/sglang_out}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT"
log() { echo "[serve_bench $(date +%H:%M:%S)] $*"; }
# Run from the repo root, `python -m` would import this checkout's megamoe_plugin (no built
# runtime extension in it) ahead of the installed one.
export PYTHONSAFEPATH=1
case $BACKEND in
  megamoe_sm90) FLAGS=(--moe-runner-backend megamoe_sm90) ;;
  deepgemm) FLAGS=(--moe-a2a-backend megamoe) ;;
  default) FLAGS=() ;;
  *) log "unknown BACKEND $BACKEND"; exit 2 ;;
esac

# This DeepSeek-V3-shaped config (0.5.17 runs mega-MoE for DeepSeek-V2's MoE block only) with
# the tokenizer of vllm_on_gpu's model folder (same 32000-token vocabulary).
M=${VS:-/root/vs}/sglang_model
mkdir -p "$M"
cp "$HERE/model/config.json" "$M/"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do cp "${MODEL_DIR:?}/$f" "$M/"; done

# The same flags for every backend: random weights (SGLang's dummy loader is seeded), triton
# attention (the bundle has no FlashAttention library), chunks and graphs under 0.5.17's
# per-rank token cap (1024), shared experts outside the routed MoE (the same work for all three).
log "BACKEND=$BACKEND: sglang.launch_server ${FLAGS[*]} ${SERVE_ARGS:-} (SCALED_WEIGHTS=${SCALED_WEIGHTS:-0})"
SERVER_PYTHONPATH=${PYTHONPATH:-}
[ "${SCALED_WEIGHTS:-0}" != 0 ] && SERVER_PYTHONPATH=$HERE/scaled_weights${PYTHONPATH:+:$PYTHONPATH}
PYTHONPATH=$SERVER_PYTHONPATH "$PY" -m sglang.launch_server --model-path "$M" --load-format dummy --attention-backend triton \
  --chunked-prefill-size 1024 --cuda-graph-max-bs-decode 256 --disable-shared-experts-fusion \
  --host 127.0.0.1 --port "$PORT" "${FLAGS[@]}" ${SERVE_ARGS:-} > "$OUT/serve_$TAG.log" 2>&1 &
SERVER=$!
stop() { kill "$SERVER" 2> /dev/null; wait "$SERVER" 2> /dev/null; }
trap stop EXIT

"$PY" - "$PORT" "${HEALTH_TIMEOUT:-600}" "$SERVER" << 'PY' || { tail -40 "$OUT/serve_$TAG.log"; exit 3; }
import os, sys, time, urllib.request
port, timeout, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
start = time.time()
while time.time() - start < timeout:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited before it was healthy")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        print(f"healthy after {time.time() - start:.0f} s")
        sys.exit(0)
    except OSError:
        time.sleep(2)
sys.exit(f"not healthy after {timeout:.0f} s")
PY

log "benchmark ${BENCH_ARGS:-}"
"$PY" -m sglang.benchmark.serving --backend sglang --host 127.0.0.1 --port "$PORT" \
  --dataset-name random-ids --random-input-len 1024 --random-output-len 256 --random-range-ratio 1 \
  --num-prompts 256 --max-concurrency 64 --output-file "$OUT/bench_$TAG.jsonl" ${BENCH_ARGS:-} \
  > "$OUT/bench_$TAG.log" 2>&1 || log "benchmark failed (rc $?)"
grep -E "^(Successful|Request|Output|Total|Mean|Median|P99) .*(requests|throughput|TTFT|TPOT|ITL)" "$OUT/bench_$TAG.log"

# Prompt logprobs of fixed token ids, greedy (tools/e2e/compare_logprobs.py compares two files).
"$PY" "$HERE/logprobs.py" "$PORT" "$OUT/logprobs_$TAG.json" || log "logprobs failed"
