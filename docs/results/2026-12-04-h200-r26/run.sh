#!/usr/bin/env bash
# Round 26, one H200: issue 12's closing run on one commit (run in the repo root by the device tool;
# carry .whl and .carry/r26; the calls ran it before install_tree and in_tree became functions, since
# round 27 tools/device_env.sh's). Cubins:
# .carry/r26/jit.tar.xz (every variant below, compiled on the CPU machine; $JITCACHE_TARBALL for
# another tree's); the commit: .carry/r26/commit.txt. Everything lands in $OUT/r26/, packed at the end.
#  STEP=tests:  the GPU suite (both numerics modes), then compute-sanitizer memcheck + racecheck of every
#               tier (round 24's jobs, now python3 -m tests.gpu.cases --jobs).
#  STEP=bench:  python -m megamoe_plugin.bench, both configs and modes, $ROUNDS rounds back to back.
#  STEP=tune:   the tuning sweep (python -m megamoe_plugin.tune, every shape, token count and mode) into
#               $OUT/r26/table (the shipped table is not touched).
#  STEP=exactab: exact_ab.py under this tree and under d7f41be (.carry/r26/old.tar.gz, its cubins
#               jit_old.tar.xz: the design contract's FP16-L1 kernel), $ROUNDS rounds alternating.
#  STEP=trailab: python -m megamoe_plugin.bench --numerics $AB_NUMERICS (default exact) under main
#               (.carry/r26/main.tar.gz, its cubins jit.tar.xz) and under this tree ($JITCACHE_TARBALL),
#               $ROUNDS rounds alternating: exact L1 tiles trailing the pull instead of a grid barrier.
set -u -o pipefail
JITCACHE_TARBALL=${JITCACHE_TARBALL:-.carry/r26/jit.tar.xz}
source tools/device_env.sh
R="$OUT/r26"; mkdir -p "$R"
cp .carry/r26/commit.txt "$R/commit.txt"
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -rs --timeout 200 tests/gpu tests/test_staging.py > "$R/tests.log" 2>&1
  rc=$?; stamp "tests rc $rc"; grep -E "^FAILED|^ERROR|passed|failed" "$R/tests.log" | tail -15
  grep -c "megamoe: compiling" "$R/tests.log" | sed 's/^/nvcc runs during the tests: /'
  python3 -m tests.gpu.cases --jobs | bash tools/sanitizer_sweep.sh | tail -1 || rc=1
  cp "$OUT/sanitizer.txt" "$R/" && rm "$OUT/sanitizer.txt"
  stamp "sanitizers done"
fi
if [[ " ${STEP} " == *" bench "* ]]; then
  for r in $(seq 1 "${ROUNDS:-3}"); do
    timeout 200 python3 -m megamoe_plugin.bench --configs v3,v4flash --numerics fast,exact --baseline none \
      > "$R/bench_$r.txt" 2> "$R/bench_$r.err"; echo "bench round $r rc $?"
  done
  grep -c "megamoe: compiling" "$R"/bench_*.err | sed 's/^/nvcc runs: /'
  stamp "bench done"
fi
if [[ " ${STEP} " == *" tune "* ]]; then
  timeout 400 python3 -m megamoe_plugin.tune --output-dir "$R/table" > "$R/tune.log" 2>&1; echo "tune rc $?"
  grep -c "compiling" "$R/tune.log" | sed 's/^/tune compile lines: /'; tail -5 "$R/tune.log"
  stamp "tune done"
fi
if [[ " ${STEP} " == *" exactab "* ]]; then
  install_tree old .carry/r26/old.tar.gz .carry/r26/jit_old.tar.xz || exit 1
  script=$PWD/docs/results/2026-12-04-h200-r26/exact_ab.py
  for r in $(seq 1 "${ROUNDS:-3}"); do
    in_tree old python3 $script --label "d7f41be r$r"
    python3 $script --label "main r$r"
  done 2>&1 | grep -v "^\s*$" | tee "$R/exact_ab.txt"
  grep -c "compiling" "$R/exact_ab.txt" | sed 's/^/compile lines: /'
  stamp "exactab done"
fi
if [[ " ${STEP} " == *" trailab "* ]]; then
  install_tree main .carry/r26/main.tar.gz .carry/r26/jit.tar.xz || exit 1
  ab_bench() {
    timeout 200 python3 -m megamoe_plugin.bench --configs v3,v4flash --numerics "${AB_NUMERICS:-exact}" --baseline none \
      --results /tmp/ab_results
  }
  for r in $(seq 1 "${ROUNDS:-3}"); do
    in_tree main ab_bench > "$R/trailab_main_$r.txt" 2> "$R/trailab_main_$r.err"; echo "trailab main round $r rc $?"
    ab_bench > "$R/trailab_new_$r.txt" 2> "$R/trailab_new_$r.err"; echo "trailab new round $r rc $?"
  done
  grep -c "megamoe: compiling" "$R"/trailab_*.err | sed 's/^/compile lines: /'
  stamp "trailab done"
fi
tar -czf "$OUT/r26_${STEP// /_}.tgz" -C "$OUT" r26 && rm -rf "$R"
exit $rc
