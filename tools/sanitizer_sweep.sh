#!/usr/bin/env bash
# compute-sanitizer over a list of jobs, several at once, on a machine with an SM90 GPU.
#
#   python3 -m tests.gpu.cases --jobs | bash tools/sanitizer_sweep.sh [RESULTS_DIR]
#
# Reads one job per line on stdin: numerics tool BLOCK_M H I K E N pool_rows ("-": the default pools)
# CTAs shared_experts weights (fp8, mxfp4; fp8 when left out). python3 -m tests.gpu.cases --jobs writes
# them; tools/gpu_check.sh SANITIZER=1 runs this. Each job runs tools/debug_phases.py H I K E N --phases 0 on that many CTAs with that tier forced,
# its log in RESULTS_DIR (default ./sanitizer-results), and adds one line to RESULTS_DIR/sanitizer.txt.
# Exits 1 unless every job reported exit 0.
# Env: SANITIZER_BUDGET (s, all jobs; 600), SANITIZER_JOBS (in parallel; 7), PYTHON (python3).
set -u -o pipefail
RESULTS_DIR=${1:-./sanitizer-results}
mkdir -p "$RESULTS_DIR" && RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd) || exit 1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export RESULTS_DIR PY="${PYTHON:-python3}"
jobs=$(cat)
echo "$jobs" | timeout "${SANITIZER_BUDGET:-600}" xargs -P "${SANITIZER_JOBS:-7}" -L 1 bash -c '
  numerics=$0 tool=$1 bm=$2 shape="$3 $4 $5 $6 $7" pool=$8 ctas=$9 shared=${10} weights=${11:-fp8}
  extra=""; [ "$pool" != "-" ] && extra="--pool-rows $pool"
  [ "$shared" != 0 ] && extra="$extra --shared-experts $shared"
  [ "$weights" != fp8 ] && extra="$extra --weights $weights"
  log=$RESULTS_DIR/${numerics}_${tool}_bm${bm}_${3}x${4}x${7}_pool${pool}_shared${shared}_${weights}.txt
  MEGAMOE_NUM_SMS=$ctas MEGAMOE_NUMERICS=$numerics MEGAMOE_BLOCK_M=$bm MEGAMOE_TIMEOUT_S=300 timeout 280 \
    compute-sanitizer --tool $tool --error-exitcode 1 $PY tools/debug_phases.py $shape --phases 0 $extra > $log 2>&1
  echo "compute-sanitizer $numerics $tool BLOCK_M $bm [$shape] pool_rows $pool shared $shared $weights: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" $log | tail -1) $(grep -c " ok" $log) ok-lines"' |
  sort | tee "$RESULTS_DIR/sanitizer.txt"
expected=$(echo "$jobs" | grep -c .)
echo "sanitizers: $(wc -l < "$RESULTS_DIR/sanitizer.txt") of $expected jobs reported"
[ "$(wc -l < "$RESULTS_DIR/sanitizer.txt")" -eq "$expected" ] && ! grep -qv "exit 0" "$RESULTS_DIR/sanitizer.txt"
