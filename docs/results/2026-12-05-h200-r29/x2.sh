#!/usr/bin/env bash
# Round 29's plan for a two-GPU hold (nvidia-h200-x2, NVLink; never lent since round 7's): what only
# real NVLink shows. Run by the device tool in the repo root with TREE's branch checked out:
#   TREE=main      main;
#   TREE=combine   branch combine-per-token (issue 14 item 1: a token's combine waits for its own rows'
#                  count; the rows are stored by the math threads and made visible by warp 1's
#                  fence.sc.sys before its red.add.sys: only a remote owner shows that they land first).
#  STEP=tests: torchrun -m tests.gpu.multi_rank (both numerics, two shapes, every routing, judged
#              against the float32 reference) with its steps $REPEATS times over (default 25: 100
#              calls per shape and mode on one buffer, fresh inputs each), then tests/gpu/test_two_gpus.py.
#  STEP=lag:   torchrun tools/tile_timeline.py (v3, v4flash at LAG_TOKENS per rank, fast numerics: the later
#              rows are pulled during L1): per rank, whether an L2 epilogue scattered before its pull
#              ended, and how long its L1 tiles waited for pulled rows, over real NVLink (round 29's
#              lag.sh runs the same on one GPU).
#  STEP=ab:    (TREE=combine) tools/ab_bench.sh under torchrun: python -m megamoe_plugin.bench at R = 2
#              (v3, v4flash, $AB_NUMERICS default both, $AB_TOKENS default all), main against the branch,
#              $ROUNDS (default 2) rounds interleaved; the table has each rank's NVLink MB and the NVLink floor.
# Carry .whl and .carry/r29: jit_x2_$TREE.tar.xz (python -m tests.gpu.cases --x2 in TREE's checkout: the
# tests', the benchmark's and the lag's variants),
# for STEP=ab also main.tar.gz (git archive of main) and jit_x2_main.tar.xz; commit.txt.
# Output in $OUT/r29_x2_$TREE/, packed at the end.
set -u -o pipefail
case "${TREE:-}" in main|combine) ;; *) echo "TREE=main or TREE=combine"; exit 2 ;; esac
JITCACHE_TARBALL=.carry/r29/jit_x2_$TREE.tar.xz
source tools/device_env.sh
R="$OUT/r29_x2_$TREE"; mkdir -p "$R"
cp .carry/r29/commit.txt "$R/commit.txt"
nvidia-smi topo -m > "$R/topo.txt" 2>&1
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  timeout 400 python3 -m torch.distributed.run --nproc-per-node 2 -m tests.gpu.multi_rank --repeats "${REPEATS:-25}" \
    > "$R/multi_rank.txt" 2> "$R/multi_rank.err" || rc=1
  echo "multi_rank: $(grep -c ' ok$' "$R/multi_rank.txt") ok, $(grep -c ' FAIL ' "$R/multi_rank.txt") FAIL (rc $rc)"
  grep " FAIL " "$R/multi_rank.txt" | head -5
  timeout 300 python3 -m pytest -q -s -rs tests/gpu/test_two_gpus.py > "$R/test_two_gpus.txt" 2>&1 || rc=1
  tail -2 "$R/test_two_gpus.txt"
  grep -c "megamoe: compiling" "$R/multi_rank.err" | sed 's/^/nvcc runs: /'
  stamp "tests done"
fi
if [[ " ${STEP} " == *" lag "* ]]; then
  tokens=$(python3 -c 'from tests.gpu.cases import LAG_TOKENS; print(",".join(map(str, LAG_TOKENS)))')
  timeout 300 python3 -m torch.distributed.run --nproc-per-node 2 tools/tile_timeline.py --configs v3,v4flash \
    --tokens "$tokens" --numerics fast > "$R/lag_x2_fast.txt" 2>&1 || rc=1
  grep -E "per rank: call|pull and scatter" "$R/lag_x2_fast.txt"
  stamp "lag done"
fi
if [[ " ${STEP} " == *" ab "* ]]; then
  OUT=$R ROUNDS=${ROUNDS:-2} BENCH_RUN_TIMEOUT=240 \
    BENCH_LAUNCH="python3 -m torch.distributed.run --nproc-per-node 2 -m" \
    BENCH_FLAGS="--configs v3,v4flash --numerics ${AB_NUMERICS:-fast,exact} ${AB_TOKENS:+--tokens $AB_TOKENS} --baseline none" \
    bash tools/ab_bench.sh .carry/r29/main.tar.gz .carry/r29/jit_x2_main.tar.xz main "$TREE" || rc=1
  stamp "ab done"
fi
tar -czf "$OUT/r29_x2_${TREE}_${STEP// /_}.tgz" -C "$OUT" "r29_x2_$TREE" && rm -rf "$R"
exit $rc
