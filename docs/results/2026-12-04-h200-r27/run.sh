#!/usr/bin/env bash
# Round 27, one H200 (run in the repo root by the device tool; carry .whl and .carry/r27). Cubins of this
# tree: .carry/r27/jit.tar.xz (the tests', the sanitizer runs' and the benchmark's variants, compiled on
# the CPU machine); main's tree and its benchmark cubins: .carry/r27/main.tar.gz, jit_main.tar.xz; the
# commits: .carry/r27/commit.txt. Everything lands in $OUT/r27/, packed at the end.
#  STEP=tests:  tools/gpu_check.sh's GPU suite (both numerics modes), then compute-sanitizer memcheck +
#               racecheck of every tier (round 24's jobs: docs/results/2026-12-04-h200-r24/variants.py --jobs).
#  STEP=ab:     python -m megamoe_plugin.bench, both configs and modes, under main and under this tree,
#               $ROUNDS rounds alternating; then tools/phase_times.py in exact numerics (v3, v4flash; 128
#               and 2048 tokens) under both, where the pull's publication shows as layout+pull.
set -u -o pipefail
JITCACHE_TARBALL=.carry/r27/jit.tar.xz
source tools/device_env.sh
R="$OUT/r27"; mkdir -p "$R"
cp .carry/r27/commit.txt "$R/commit.txt"
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  OUT=$R TEST_TIMEOUT=400 BENCH=0 bash tools/gpu_check.sh > /dev/null 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$R/tests.log" | tail -15
  grep -q -E "[0-9]+ passed" "$R/tests.log" && ! grep -q -E "[0-9]+ (failed|error)" "$R/tests.log" || rc=1
  grep -c "megamoe: compiling" "$R/tests.log" | sed 's/^/nvcc runs during the tests: /'
  stamp "tests done"
  python3 docs/results/2026-12-04-h200-r24/variants.py --jobs | OUT=$R bash tools/sanitizer_sweep.sh | tail -1 || rc=1
  stamp "sanitizers done"
fi
if [[ " ${STEP} " == *" ab "* ]]; then
  install_tree main .carry/r27/main.tar.gz .carry/r27/jit_main.tar.xz || exit 1
  bench() {
    timeout 200 python3 -m megamoe_plugin.bench --configs v3,v4flash --numerics fast,exact --baseline none \
      --results /tmp/ab_results
  }
  for r in $(seq 1 "${ROUNDS:-2}"); do
    in_tree main bench > "$R/ab_main_$r.txt" 2> "$R/ab_main_$r.err"; echo "main round $r rc $?"
    bench > "$R/ab_new_$r.txt" 2> "$R/ab_new_$r.err"; echo "new round $r rc $?"
  done
  phases() { MEGAMOE_NUMERICS=exact timeout 200 python3 tools/phase_times.py --configs v3,v4flash --tokens 128,2048; }
  for r in 1 2; do
    in_tree main bash -c "cd $PWD && $(declare -f phases); phases" 2>&1 | grep total | sed "s/^/main r$r: /"
    phases 2>&1 | grep total | sed "s/^/new r$r: /"
  done | tee "$R/phase_times_exact.txt"
  grep -c "megamoe: compiling" "$R"/ab_*.err | sed 's/^/compile lines: /'
  stamp "ab done"
fi
tar -czf "$OUT/r27_${STEP// /_}.tgz" -C "$OUT" r27 && rm -rf "$R"
exit $rc
