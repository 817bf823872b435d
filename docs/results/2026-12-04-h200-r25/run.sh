#!/usr/bin/env bash
# Round 25, one H200 (run in the repo root by the device tool; carry .whl and .carry/r25).
#  STEP=tests:    the GPU suite, then (unless SANITIZE=0) compute-sanitizer memcheck + racecheck of every
#                 tier on round 24's sanitizer shapes (tools/sanitizer_sweep.sh), pool windows among them.
#  STEP=poolcost: tools/pool_window_cost.py (what pool windows cost, interleaved buffers), $POOL_ARGS.
#  STEP=windiag:  tests/gpu/test_pool_windows.py alone (its seeds as in the suite), then v4flash at 8192
#                 tokens with the default pools and pools 128 rows short (windowed): tools/phase_times.py
#                 three times each, alternating, and tools/tile_timeline.py once each.
#  STEP=bench:    python -m megamoe_plugin.bench, both configs and modes, $ROUNDS rounds back to back.
#  STEP=combineab: combine_ab.py here under main and under this tree, $ROUNDS rounds alternating ($COMBINE_ARGS).
#  STEP=placement: combine_placement.py here for $PLACEMENT_CONFIGS (y at several offsets, one buffer).
# The tree's cubins: .carry/r25/jit.tar.xz; the commit it is: .carry/r25/commit.txt (both written on
# the CPU machine before the call).
set -u -o pipefail
JITCACHE_TARBALL=${JITCACHE_TARBALL:-.carry/r25/jit.tar.xz}
source tools/device_env.sh
cp .carry/r25/commit.txt "$OUT/commit.txt"
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -rs --timeout 200 tests/gpu tests/test_staging.py ${TESTS:-} \
    > /tmp/tests.log 2>&1; rc=$?
  stamp "tests rc $rc"; grep -E "^FAILED|^ERROR|passed|failed" /tmp/tests.log | tail -15
  grep -E "^FAILED|^ERROR|passed|failed|SKIPPED|Error|assert" /tmp/tests.log | head -60 > "$OUT/tests_summary.txt"
  gzip -c /tmp/tests.log > "$OUT/tests.log.gz"
  grep -c "megamoe: compiling" /tmp/tests.log | sed 's/^/nvcc runs during the tests: /'
  if [ "${SANITIZE:-1}" != 0 ]; then
    python3 docs/results/2026-12-04-h200-r24/variants.py --jobs | bash tools/sanitizer_sweep.sh | tail -1 || rc=1
    stamp "sanitizers done"
  fi
fi
if [[ " ${STEP} " == *" poolcost "* ]]; then
  python3 tools/pool_window_cost.py ${POOL_ARGS:-} 2>&1 | tee "$OUT/pool_window_cost.txt"
  stamp "pool cost done"
fi
if [[ " ${STEP} " == *" windiag "* ]]; then
  timeout 300 python3 -m pytest -q -rs --timeout 200 tests/gpu/test_pool_windows.py > /tmp/windows.log 2>&1
  stamp "test_pool_windows rc $?"; tail -3 /tmp/windows.log
  grep -E "^FAILED|^E  +AssertionError|passed|failed" /tmp/windows.log | cut -c1-1500 > "$OUT/windows_tests.txt"
  for r in 1 2 3; do
    for pool in "" "--pool-rows short128"; do
      python3 tools/phase_times.py --configs v4flash --tokens 8192 $pool 2>&1 | sed "s/^/round $r ${pool:-default}: /"
    done
  done | tee "$OUT/phase_times.txt"
  for pool in "" "--pool-rows short128"; do
    echo "== ${pool:-default pools}"; python3 tools/tile_timeline.py --configs v4flash --tokens 8192 $pool 2>&1
  done | tee "$OUT/tile_timeline.txt"
  stamp "windiag done"
fi
if [[ " ${STEP} " == *" placement "* ]]; then
  for c in ${PLACEMENT_CONFIGS:-v4flash v3}; do
    python3 docs/results/2026-12-04-h200-r25/combine_placement.py --config $c 2>&1
  done | tee "$OUT/combine_placement.txt"
  stamp "placement done"
fi
if [[ " ${STEP} " == *" combineab "* ]]; then
  # main (.carry/r25ab/main.tar.gz, its cubins jit_main.tar.xz) against this tree (jit_new.tar.xz).
  mkdir -p /tmp/tree_a /tmp/jitcache_a /tmp/jitcache_b && tar -xzf .carry/r25ab/main.tar.gz -C /tmp/tree_a &&
    tar -xJf .carry/r25ab/jit_main.tar.xz -C /tmp/jitcache_a && tar -xJf .carry/r25ab/jit_new.tar.xz -C /tmp/jitcache_b &&
    python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_a /tmp/tree_a > /tmp/install_a.log 2>&1 ||
    { cat /tmp/install_a.log; exit 1; }
  script=$PWD/docs/results/2026-12-04-h200-r25/combine_ab.py
  for r in $(seq 1 "${ROUNDS:-2}"); do
    (cd /tmp && PYTHONPATH=/tmp/site_a:/tmp/site MEGAMOE_CACHE_DIR=/tmp/jitcache_a python3 $script --label "main r$r" $COMBINE_ARGS)
    MEGAMOE_CACHE_DIR=/tmp/jitcache_b python3 $script --label "new r$r" $COMBINE_ARGS
  done 2>&1 | grep -v "^\s*$" | tee "$OUT/combine_ab.txt"
  grep -c "megamoe: compiling" "$OUT/combine_ab.txt" | sed 's/^/nvcc runs: /'
  stamp "combineab done"
fi
if [[ " ${STEP} " == *" bench "* ]]; then
  for r in $(seq 1 "${ROUNDS:-2}"); do
    timeout 200 python3 -m megamoe_plugin.bench --configs v3,v4flash --numerics fast,exact --baseline none \
      > "$OUT/bench_$r.txt" 2> /tmp/bench_$r.err; echo "bench round $r rc $?"
  done
  grep -c "megamoe: compiling" /tmp/bench_*.err | sed 's/^/nvcc runs: /'
  stamp "bench done"
fi
exit $rc
