#!/usr/bin/env bash
# Round 23, one H200 (run in the repo root by the device tool; carry .whl and .carry).
#  STEP=tests: the GPU suite, then compute-sanitizer memcheck + racecheck of every tier on round 22's
#              two shapes (../2026-12-04-h200-r22/variants.py).
#  STEP=ab:    main (.carry/r23/main.tar.gz, the tree before this round) against this tree,
#              python -m megamoe_plugin.bench (v3, v4flash), ROUNDS rounds interleaved, then
#              tools/ab_summary.py. BENCH_FLAGS overrides the benchmark's flags.
# Cubins: .carry/r23/jit_new.tar.xz (this tree) and jit_main.tar.xz (main), compiled on the CPU machine.
set -u -o pipefail
JITCACHE_TARBALL=${JITCACHE_TARBALL:-.carry/r23/jit_new.tar.xz}
source tools/device_env.sh
cp .carry/r23/commit.txt "$OUT/commit.txt"  # the commit this tree is (written before the call)
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  timeout 200 python3 -m pytest -q -rs --timeout 150 tests/gpu tests/test_staging.py > /tmp/tests.log 2>&1; rc=$?
  stamp "tests rc $rc"; grep -E "^FAILED|^ERROR|passed|failed" /tmp/tests.log | tail -15
  grep -E "^FAILED|^ERROR|passed|failed|SKIPPED|Error|assert" /tmp/tests.log | head -60 > "$OUT/tests_summary.txt"
  grep -c "megamoe: compiling" /tmp/tests.log | sed 's/^/nvcc runs during the tests: /'
  python3 - > /tmp/sanitizer_jobs.txt <<'PY'
import sys
sys.path.insert(0, "docs/results/2026-12-04-h200-r22")
from variants import SANITIZER_SHAPES
from megamoe_plugin.heuristics import implemented_block_m
for shape, modes in reversed(SANITIZER_SHAPES):
    for numerics in modes:
        for tool in ("racecheck", "memcheck"):
            for bm in implemented_block_m(numerics):
                print(numerics, tool, bm, *shape)
PY
  mkdir -p /tmp/sanitizer
  timeout "${SANITIZER_BUDGET:-300}" xargs -P 7 -L 1 bash -c 'shape="$3 $4 $5 $6 $7"; log=/tmp/sanitizer/${0}_${1}_bm${2}_${3}x${4}.txt; MEGAMOE_NUM_SMS=8 MEGAMOE_NUMERICS=$0 MEGAMOE_BLOCK_M=$2 MEGAMOE_TIMEOUT_S=300 timeout 280 compute-sanitizer --tool $1 --error-exitcode 1 python3 tools/debug_phases.py $shape --phases 0 > $log 2>&1; echo "compute-sanitizer $0 $1 BLOCK_M $2 [$shape]: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" $log | tail -1) $(grep -c " ok" $log) ok-lines"' \
    < /tmp/sanitizer_jobs.txt | sort | tee "$OUT/sanitizer.txt"
  stamp "sanitizers: $(wc -l < "$OUT/sanitizer.txt") of $(wc -l < /tmp/sanitizer_jobs.txt) jobs reported"
  grep -qv "exit 0" "$OUT/sanitizer.txt" && rc=1
  [ "$(wc -l < "$OUT/sanitizer.txt")" -eq "$(wc -l < /tmp/sanitizer_jobs.txt)" ] || rc=1
fi
if [[ " ${STEP} " == *" ab "* ]]; then
  mkdir -p /tmp/tree_main /tmp/jitcache_main && tar -xzf .carry/r23/main.tar.gz -C /tmp/tree_main &&
    tar -xJf .carry/r23/jit_main.tar.xz -C /tmp/jitcache_main &&
    python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_main /tmp/tree_main > /tmp/install_main.log 2>&1 ||
    { cat /tmp/install_main.log; exit 1; }
  stamp "main installed"
  flags="${BENCH_FLAGS:---configs v3,v4flash --numerics fast,exact --baseline none}"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    (cd /tmp && PYTHONPATH=/tmp/site_main:/tmp/site MEGAMOE_CACHE_DIR=/tmp/jitcache_main timeout 150 python3 -m megamoe_plugin.bench \
      $flags --results /tmp/res_main_$r > "$OUT/bench_main_$r.txt" 2> /tmp/bench_main_$r.err); stamp "bench main $r rc $?"
    timeout 150 python3 -m megamoe_plugin.bench $flags --results /tmp/res_new_$r > "$OUT/bench_new_$r.txt" 2> /tmp/bench_new_$r.err
    stamp "bench new $r rc $?"
  done
  grep -c "megamoe: compiling" /tmp/bench_*.err | sed 's/^/nvcc runs: /'
  python3 tools/ab_summary.py --a "$OUT"/bench_main_?.txt --b "$OUT"/bench_new_?.txt --names main,trailing | tee "$OUT/ab.txt"
fi
exit $rc
