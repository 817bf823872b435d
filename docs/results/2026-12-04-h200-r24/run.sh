#!/usr/bin/env bash
# Round 24, one H200, from call 3 on (run in the repo root by the device tool; carry .whl and .carry).
#  STEP=tests: the GPU suite, then compute-sanitizer memcheck + racecheck of every tier on the shapes of
#              variants.py here (tools/sanitizer_sweep.sh), pool windows among them; since round 28
#              tests/gpu/cases.py holds them (SANITIZER_SHAPES), and variants.py and bench_variants.py are
#              python -m tests.gpu.cases and its --bench.
#  STEP=ab:    main (.carry/r24/main.tar.gz and its cubins jit_main.tar.xz) against this tree
#              (tools/ab_bench.sh; ROUNDS, BENCH_FLAGS).
# This tree's cubins: .carry/r24/jit_new.tar.xz; the commit it is: .carry/r24/commit.txt (both written
# on the CPU machine before the call).
set -u -o pipefail
JITCACHE_TARBALL=${JITCACHE_TARBALL:-.carry/r24/jit_new.tar.xz}
source tools/device_env.sh
cp .carry/r24/commit.txt "$OUT/commit.txt"
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  timeout "${TEST_TIMEOUT:-260}" python3 -m pytest -q -rs --timeout 150 tests/gpu tests/test_staging.py ${TESTS:-} \
    > /tmp/tests.log 2>&1; rc=$?
  stamp "tests rc $rc"; grep -E "^FAILED|^ERROR|passed|failed" /tmp/tests.log | tail -15
  grep -E "^FAILED|^ERROR|passed|failed|SKIPPED|Error|assert" /tmp/tests.log | head -60 > "$OUT/tests_summary.txt"
  grep -c "megamoe: compiling" /tmp/tests.log | sed 's/^/nvcc runs during the tests: /'
  python3 -m tests.gpu.cases --jobs | bash tools/sanitizer_sweep.sh | tail -1 || rc=1
  stamp "sanitizers done"
fi
if [[ " ${STEP} " == *" ab "* ]]; then
  bash tools/ab_bench.sh .carry/r24/main.tar.gz .carry/r24/jit_main.tar.xz main new
fi
exit $rc
