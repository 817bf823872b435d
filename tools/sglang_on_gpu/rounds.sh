#!/bin/bash
# GPU side: several serve_bench.sh runs in one call on one machine hold, in the order given,
# after pre-building this kernel's variants for the served shape (so no kernel compiles while
# a server is measured). Runs as vllm_on_gpu's RUN_CMD, from the repo root:
#
#   RUNS="megamoe_sm90:1 default:1 deepgemm:1" bash tools/sglang_on_gpu/rounds.sh
#
#   RUNS        BACKEND:ROUND pairs (serve_bench.sh's BACKEND and ROUND)
#   DEADLINE_S  seconds from the start after which no further server is started (480): the
#               device call's own limit is 600 s
# At the end: each backend's logprobs against the first run's of `default`
# (tools/e2e/compare_logprobs.py, printed and in $OUT/logprobs_compare.txt), and everything else
# in $OUT packed into $OUT/rounds.tgz: the device tool returns at most a few files (round 11 lost
# its logprob files to that limit). Each run's benchmark figures are also printed.
# The variants (the model's MoE shape, 1-1024 tokens per rank, fast numerics, the GPU's tuned
# table) go to $MEGAMOE_CACHE_DIR (default .jitcache_sglang); the build's log is $OUT/jit_build.log.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/sglang_out}
mkdir -p "$OUT"
START=$(date +%s)
export MEGAMOE_CACHE_DIR=${MEGAMOE_CACHE_DIR:-$PWD/.jitcache_sglang}
log() { echo "[rounds $(date +%H:%M:%S)] $*"; }
python3 -m megamoe_plugin.jit --build --model "$HERE/model/config.json" --ep-size 1 --batch-sizes 1-1024 \
  --numerics fast --gpu "$(python3 -c 'import torch; print(torch.cuda.get_device_name())')" \
  --cache-dir "$MEGAMOE_CACHE_DIR" > "$OUT/jit_build.log" 2>&1 || { tail -20 "$OUT/jit_build.log"; exit 1; }
log "variants built in $(( $(date +%s) - START )) s: $(ls "$MEGAMOE_CACHE_DIR" | wc -l) in $MEGAMOE_CACHE_DIR"
# sglang 0.5.17 at world size 1: the mega-MoE path needs the MLP-sync step, whose
# MLPSyncBatchInfo.all_gather builds its gathered table with fallback.expand(1, 1, w).contiguous(),
# a view of `fallback` at world size 1, then writes `fallback` into it by mask; torch refuses that
# write to overlapping memory, so both mega-MoE servers (DeepGEMM's and this one) die on their
# first batch (docs/sglang.md, "Numbers"; fixed by 0.5.23), and the plugin refuses --tp-size 1 on
# such a copy. A copy instead of the view, in the installed file of this machine only:
F=$(python3 -c 'import sglang.srt.managers.scheduler_components.dp_attn as m; print(m.__file__)' 2>/dev/null)
if [ -n "$F" ] && sed -n '/global_info_tensor = fallback_tensor.expand(/,+2p' "$F" | grep -q ").contiguous()"; then
  sed -i '/global_info_tensor = fallback_tensor.expand(/,+2s/).contiguous()/).clone()/' "$F" && log "patched $F: expand(...).clone()"
fi
for run in ${RUNS:?set RUNS, e.g. "megamoe_sm90:1 default:1"}; do
  if [ $(( $(date +%s) - START )) -gt "${DEADLINE_S:-480}" ]; then log "deadline: $run not started"; continue; fi
  before=$(ls "$MEGAMOE_CACHE_DIR" | wc -l)
  BACKEND=${run%%:*} ROUND=${run##*:} bash "$HERE/serve_bench.sh"
  log "$run done at $(( $(date +%s) - START )) s; cache entries $before -> $(ls "$MEGAMOE_CACHE_DIR" | wc -l)"
done
REF=$(ls "$OUT"/logprobs_default_r*.json 2>/dev/null | head -1)
for f in "$OUT"/logprobs_*.json; do
  [ -n "$REF" ] && [ -f "$f" ] && [ "$f" != "$REF" ] || continue
  echo "$(basename "$f") vs $(basename "$REF"): $(python3 "$HERE/../e2e/compare_logprobs.py" "$REF" "$f"; echo "(exit $?)")"
done | tee "$OUT/logprobs_compare.txt"
(cd "$OUT" && tar -czf /tmp/rounds.tgz --exclude=logprobs_compare.txt . && mv /tmp/rounds.tgz .) &&
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name logprobs_compare.txt ! -name rounds.tgz -exec rm -rf {} +
