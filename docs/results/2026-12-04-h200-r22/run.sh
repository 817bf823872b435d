#!/usr/bin/env bash
# Round 22, one H200 (run in the repo root by the device tool; carry .whl and .carry).
#  STEP=tests: the GPU suite, then compute-sanitizer memcheck + racecheck of every tier on two shapes
#              (variants.py beside this: round 21's, and an I 2048 one that pulls rows during L1).
#  STEP=tune:  main (.carry/r22/main.tar.gz, the tree before this round) against this tree on the
#              I 768 shapes at 2048 / 8192 tokens, BLOCK_M 64 and 128, two rounds interleaved; then
#              this tree's sweep of the I < 2048 shapes in fast numerics into $OUT/table (the
#              shipped table's other entries kept).
# Cubins: .carry/r22/jit_new.tar.xz (this tree) and jit_main.tar.xz (main), compiled on the CPU machine.
set -u -o pipefail
JITCACHE_TARBALL=${JITCACHE_TARBALL:-.carry/r22/jit_new.tar.xz}
source tools/device_env.sh
REPO=$PWD
cp .carry/r22/commit.txt "$OUT/commit.txt"  # the commit this tree is (written before the call)
rc=0
if [[ " ${STEP} " == *" exact "* ]]; then
  mkdir -p /tmp/tree_main /tmp/jitcache_main && tar -xzf .carry/r22/main.tar.gz -C /tmp/tree_main &&
    tar -xJf .carry/r22/jit_new.tar.xz -C /tmp/jitcache_main &&
    python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_main /tmp/tree_main > /tmp/install_main.log 2>&1 ||
    { cat /tmp/install_main.log; exit 1; }
  for r in 1 2; do
    (cd /tmp && PYTHONPATH=/tmp/site_main:/tmp/site MEGAMOE_CACHE_DIR=/tmp/jitcache_main timeout 120 python3 -m megamoe_plugin.bench \
      --configs v3,v4flash --numerics exact --baseline none --results /tmp/res_main_$r > "$OUT/bench_exact_main_$r.txt" 2>/dev/null)
    stamp "bench main $r rc $?"
    timeout 120 python3 -m megamoe_plugin.bench --configs v3,v4flash --numerics exact --baseline none --results /tmp/res_new_$r \
      > "$OUT/bench_exact_new_$r.txt" 2>/dev/null; stamp "bench new $r rc $?"
  done
  python3 tools/ab_summary.py --a "$OUT"/bench_exact_main_?.txt --b "$OUT"/bench_exact_new_?.txt --names main,width | tee "$OUT/ab_exact.txt"
  SANITIZER_MODES=exact
  STEP="$STEP tests"
fi
if [[ " ${STEP} " == *" tests "* ]]; then
  timeout 200 python3 -m pytest -q -rs --timeout 150 tests/gpu tests/test_staging.py > /tmp/tests.log 2>&1; rc=$?
  stamp "tests rc $rc"; grep -E "^FAILED|^ERROR|passed|failed" /tmp/tests.log | tail -15
  grep -E "^FAILED|^ERROR|passed|failed|SKIPPED|Error|assert" /tmp/tests.log | head -60 > "$OUT/tests_summary.txt"
  grep -c "megamoe: compiling" /tmp/tests.log | sed 's/^/nvcc runs during the tests: /'
  SANITIZER_MODES="${SANITIZER_MODES:-}" python3 - > /tmp/sanitizer_jobs.txt <<'EOF'
import sys
sys.path.insert(0, "docs/results/2026-12-04-h200-r22")
from variants import SANITIZER_SHAPES
from megamoe_plugin.heuristics import implemented_block_m
import os
only = os.environ.get("SANITIZER_MODES")
for shape, modes in reversed(SANITIZER_SHAPES):  # the new shape first
    for numerics in modes:
        if only and numerics not in only.split():
            continue
        for tool in ("racecheck", "memcheck"):
            for bm in implemented_block_m(numerics):
                print(numerics, tool, bm, *shape)
EOF
  mkdir -p /tmp/sanitizer
  timeout "${SANITIZER_BUDGET:-330}" xargs -P 7 -L 1 bash -c 'shape="$3 $4 $5 $6 $7"; log=/tmp/sanitizer/${0}_${1}_bm${2}_${3}x${4}.txt; MEGAMOE_NUM_SMS=8 MEGAMOE_NUMERICS=$0 MEGAMOE_BLOCK_M=$2 MEGAMOE_TIMEOUT_S=300 timeout 280 compute-sanitizer --tool $1 --error-exitcode 1 python3 tools/debug_phases.py $shape --phases 0 > $log 2>&1; echo "compute-sanitizer $0 $1 BLOCK_M $2 [$shape]: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" $log | tail -1) $(grep -c " ok" $log) ok-lines"' \
    < /tmp/sanitizer_jobs.txt | sort | tee "$OUT/sanitizer.txt"
  stamp "sanitizers: $(wc -l < "$OUT/sanitizer.txt") of $(wc -l < /tmp/sanitizer_jobs.txt) jobs reported"
  grep -qv "exit 0" "$OUT/sanitizer.txt" && rc=1
  [ "$(wc -l < "$OUT/sanitizer.txt")" -eq "$(wc -l < /tmp/sanitizer_jobs.txt)" ] || rc=1
fi
if [[ " ${STEP} " == *" tune "* ]]; then
  if [ ! -d /tmp/site_main ]; then
    mkdir -p /tmp/tree_main /tmp/jitcache_main && tar -xzf .carry/r22/main.tar.gz -C /tmp/tree_main &&
      tar -xJf .carry/r22/jit_main.tar.xz -C /tmp/jitcache_main &&
      python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_main /tmp/tree_main > /tmp/install_main.log 2>&1 ||
      { cat /tmp/install_main.log; exit 1; }
  fi
  ab_flags="--shapes e2e,qwen30 --tokens 2048,8192 --numerics fast --tiers 128,64 --stages 4,5"
  for r in 1 2; do
    (cd /tmp && PYTHONPATH=/tmp/site_main:/tmp/site MEGAMOE_CACHE_DIR=/tmp/jitcache_main timeout 120 python3 -m megamoe_plugin.tune \
      $ab_flags --output-dir /tmp/cfg_main_$r > "$OUT/tune_ab_main_$r.txt" 2> /tmp/tune_main_$r.err); stamp "tune main $r rc $?"
    timeout 120 python3 -m megamoe_plugin.tune $ab_flags --output-dir /tmp/cfg_new_$r > "$OUT/tune_ab_new_$r.txt" 2> /tmp/tune_new_$r.err
    stamp "tune new $r rc $?"
  done
  mkdir -p "$OUT/table" && cp configs/NVIDIA_H200.json "$OUT/table/"
  timeout 300 python3 -m megamoe_plugin.tune --shapes e2e,qwen30,qwen235 --numerics fast --output-dir "$OUT/table" \
    > "$OUT/tune_sweep.txt" 2> /tmp/tune_sweep.err; stamp "sweep rc $?"; tail -25 "$OUT/tune_sweep.txt"
fi
if [[ " ${STEP} " == *" bench "* ]]; then
  for r in $(seq 1 "${ROUNDS:-3}"); do
    timeout 200 python3 -m megamoe_plugin.bench --configs v3,v4flash --numerics fast,exact --baseline none \
      --results /tmp/bench_$r > "$OUT/bench_$r.txt" 2> /tmp/bench_$r.err; stamp "bench round $r rc $?"
  done
  grep -c "megamoe: compiling" /tmp/bench_*.err | sed 's/^/nvcc runs: /'
  python3 tools/ab_summary.py --a "$OUT"/bench_?.txt --names committed | tee "$OUT/bench_summary.txt"
fi
exit $rc
