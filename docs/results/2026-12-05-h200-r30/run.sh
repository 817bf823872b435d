#!/usr/bin/env bash
# Round 30's one-H200 hold, main checked out: issue 14's closing run on one commit.
#  STEP=tests: tools/gpu_check.sh's GPU suite (both numerics modes; R = 2/4/8 side by side, skew that
#              fills the pool windows many times over, ranks with 0 and with different token counts,
#              1000 calls with random per-rank counts, CUDA graph replay, exact mode's EP-width
#              invariance) and compute-sanitizer memcheck + racecheck of every tier (SANITIZER=1, 46 jobs).
#  STEP=ab:    tools/ab_bench.sh: python -m megamoe_plugin.bench (v3, v4flash, both numerics modes, every
#              token count) under b2b and main, $ROUNDS (default 4) rounds interleaved, tools/ab_summary.py
#              into ab.txt. b2b = branch b2b-schedule: main's code with the back-to-back schedule put
#              back (every row pulled before L1 behind a grid barrier, a grid barrier between L1 and L2
#              and one before the combine): issue 14 item 4's "no slower than the back-to-back schedule",
#              in both modes, with nothing else differing.
# Carry .whl and .carry/r30 (compiled on the CPU machine, not committed): jit_main.tar.xz (main's cubins,
# python -m tests.gpu.cases: the tests', the sanitizer runs' and the benchmarks'; main's csrc is that of
# round 28's combine-per-token tree, whose tarball it is), b2b.tar.gz (git archive of b2b-schedule) and
# jit_b2b.tar.xz (its benchmark variants, python -m tests.gpu.cases --bench in its checkout).
# Output in $OUT/r30/, packed at the end.
set -u -o pipefail
JITCACHE_TARBALL=.carry/r30/jit_main.tar.xz
source tools/device_env.sh
R="$OUT/r30"; mkdir -p "$R"
cp .carry/r30/commit.txt "$R/commit.txt"
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  OUT=$R TEST_TIMEOUT=400 BENCH=0 SANITIZER=1 bash tools/gpu_check.sh > "$R/gpu_check.txt" 2>&1 || rc=1
  grep -h -E "^FAILED|^ERROR|passed|failed|^sanitizers:" "$R/tests.log" "$R/gpu_check.txt" | tail -16
  stamp "tests and sanitizers done"
fi
if [[ " ${STEP} " == *" ab "* ]]; then
  OUT=$R ROUNDS=${ROUNDS:-4} \
    BENCH_FLAGS="--configs v3,v4flash --numerics ${AB_NUMERICS:-fast,exact} ${AB_TOKENS:+--tokens $AB_TOKENS} --baseline none" \
    bash tools/ab_bench.sh .carry/r30/b2b.tar.gz .carry/r30/jit_b2b.tar.xz b2b main || rc=1
  stamp "ab done"
fi
tar -czf "$OUT/r30_${STEP// /_}.tgz" -C "$OUT" r30 && rm -rf "$R"
exit $rc
