#!/usr/bin/env bash
# compute-sanitizer over a list of jobs, several at once, on the GPU machine (after tools/device_env.sh).
# Reads one job per line on stdin: numerics tool BLOCK_M H I K E N pool_rows ("-": the default pools)
# CTAs, from python3 -m tests.gpu.cases --jobs (whose variants the carried cache holds). Each runs
# tools/debug_phases.py H I K E N --phases 0 on that many CTAs with that tier forced, and writes one
# line per job to $OUT/sanitizer.txt. Exits 1 unless every job reported exit 0.
# Env: SANITIZER_BUDGET (s, all jobs), SANITIZER_JOBS (in parallel).
set -u -o pipefail
jobs=$(cat)
mkdir -p /tmp/sanitizer
echo "$jobs" | timeout "${SANITIZER_BUDGET:-300}" xargs -P "${SANITIZER_JOBS:-7}" -L 1 bash -c '
  numerics=$0 tool=$1 bm=$2 shape="$3 $4 $5 $6 $7" pool=$8 ctas=$9
  extra=""; [ "$pool" != "-" ] && extra="--pool-rows $pool"
  log=/tmp/sanitizer/${numerics}_${tool}_bm${bm}_${3}x${4}x${7}_pool${pool}.txt
  MEGAMOE_NUM_SMS=$ctas MEGAMOE_NUMERICS=$numerics MEGAMOE_BLOCK_M=$bm MEGAMOE_TIMEOUT_S=300 timeout 280 \
    compute-sanitizer --tool $tool --error-exitcode 1 python3 tools/debug_phases.py $shape --phases 0 $extra > $log 2>&1
  echo "compute-sanitizer $numerics $tool BLOCK_M $bm [$shape] pool_rows $pool: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" $log | tail -1) $(grep -c " ok" $log) ok-lines"' |
  sort | tee "$OUT/sanitizer.txt"
expected=$(echo "$jobs" | grep -c .)
echo "sanitizers: $(wc -l < "$OUT/sanitizer.txt") of $expected jobs reported"
[ "$(wc -l < "$OUT/sanitizer.txt")" -eq "$expected" ] && ! grep -qv "exit 0" "$OUT/sanitizer.txt"
