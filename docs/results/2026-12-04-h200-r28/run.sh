#!/usr/bin/env bash
# Round 28's plan for the next hold, one H200 (round 28 itself had no device time): a branch against
# main. Run in the repo root by the device tool with the branch checked out, TREE naming it:
#   TREE=combine   branch combine-per-token (issue 14 item 1: a token's combine waits for its own rows,
#                  counted per token, instead of a cross-rank barrier after L2);
#   TREE=prefetch  branch weight-prefetch (decode tiers ask L2 for the first L1 tiles' weights while
#                  the dispatch phases run).
# Carry .whl and .carry/r28 (compiled on the CPU machine, not committed): jit_$TREE.tar.xz, the branch's
# cubins (python -m tests.gpu.cases: the tests', the sanitizer runs' and the benchmarks' variants);
# main.tar.gz and jit_main.tar.xz, main's tree and its benchmark variants (python -m tests.gpu.cases
# --bench in a checkout of main); commit.txt, the commits. Everything lands in $OUT/r28_$TREE/, packed
# at the end.
#  STEP=tests:  tools/gpu_check.sh's GPU suite (both numerics modes; the R = 2/4/8 tests run the
#               combine across ranks, 1000 calls with random per-rank token counts among them) and
#               compute-sanitizer memcheck + racecheck of every tier (SANITIZER=1, 46 jobs).
#  STEP=ab:     tools/ab_bench.sh: python -m megamoe_plugin.bench (v3, v4flash; $AB_NUMERICS, default
#               both modes; $AB_TOKENS, default all) under main and the branch, $ROUNDS (default 4)
#               rounds interleaved, tools/ab_summary.py into ab.txt.
set -u -o pipefail
case "${TREE:-}" in combine|prefetch) ;; *) echo "TREE=combine or TREE=prefetch"; exit 2 ;; esac
JITCACHE_TARBALL=.carry/r28/jit_$TREE.tar.xz  # device_env.sh unpacks each tarball into a folder of its own
source tools/device_env.sh
R="$OUT/r28_$TREE"; mkdir -p "$R"
cp .carry/r28/commit.txt "$R/commit.txt"
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  OUT=$R TEST_TIMEOUT=400 BENCH=0 SANITIZER=1 bash tools/gpu_check.sh > "$R/gpu_check.txt" 2>&1 || rc=1
  grep -h -E "^FAILED|^ERROR|passed|failed|^sanitizers:" "$R/tests.log" "$R/gpu_check.txt" | tail -16
  grep -c "megamoe: compiling" "$R/tests.log" | sed 's/^/nvcc runs during the tests: /'
  stamp "tests and sanitizers done"
fi
if [[ " ${STEP} " == *" ab "* ]]; then
  OUT=$R ROUNDS=${ROUNDS:-4} \
    BENCH_FLAGS="--configs v3,v4flash --numerics ${AB_NUMERICS:-fast,exact} ${AB_TOKENS:+--tokens $AB_TOKENS} --baseline none" \
    bash tools/ab_bench.sh .carry/r28/main.tar.gz .carry/r28/jit_main.tar.xz main "$TREE" || rc=1
  stamp "ab done"
fi
tar -czf "$OUT/r28_${TREE}_${STEP// /_}.tgz" -C "$OUT" "r28_$TREE" && rm -rf "$R"
exit $rc
