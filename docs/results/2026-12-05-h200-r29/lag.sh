#!/usr/bin/env bash
# Round 29's plan for the next hold, one H200, with main checked out (round 29 itself had no device
# time): does the L2 scatter ever run while a pull is still going on? Issue 14 item 1 asks that the
# order of work keep pulling and scattering off the same NVLink links at once: a rank's pull reads
# its rows from every rank, and the L2 epilogues of every rank store rows into it, so both share each
# link's direction into a rank. The schedule's order (L2 tiles after their m-block's L1 tiles, a CTA's
# L2 tiles after its L1 share) should keep every scatter behind every pull; this measures it.
#   tools/tile_timeline.py (timeline builds: per-warp pull ends, per-tile L2 epilogue times) for each
#   of tests/gpu/cases.py LAG_RUNS (R = 1 fast and exact, R = 2 side by side on one GPU in fast
#   numerics, where the later rows are pulled during L1), v3 and v4flash at LAG_TOKENS per rank.
# Carry .whl and .carry/r29 (compiled on the CPU machine, not committed): jit_lag.tar.xz (python -m
# tests.gpu.cases --lag) and commit.txt. Output in $OUT/r29_lag/.
set -u -o pipefail
JITCACHE_TARBALL=.carry/r29/jit_lag.tar.xz  # device_env.sh unpacks it into a folder of its own
source tools/device_env.sh
R="$OUT/r29_lag"; mkdir -p "$R"
cp .carry/r29/commit.txt "$R/commit.txt"
read -r -a runs <<< "$(python3 -c 'from tests.gpu.cases import LAG_RUNS; print(" ".join(f"{r}:{n}" for r, n in LAG_RUNS))')"
tokens=$(python3 -c 'from tests.gpu.cases import LAG_TOKENS; print(",".join(map(str, LAG_TOKENS)))')
rc=0
for run in "${runs[@]}"; do
  ranks=${run%%:*} numerics=${run##*:}
  timeout 240 python3 tools/tile_timeline.py --configs v3,v4flash --tokens "$tokens" --numerics "$numerics" \
    --ranks "$ranks" > "$R/lag_r${ranks}_${numerics}.txt" 2>&1 || rc=1
  stamp "R=$ranks $numerics done (rc so far $rc)"
done
grep -h -E "per rank: call|pull and scatter|Error|error" "$R"/lag_*.txt
cat "$R"/lag_*.txt | grep -c "megamoe: compiling" | sed 's/^/nvcc runs: /'
tar -czf "$OUT/r29_lag.tgz" -C "$OUT" r29_lag && rm -rf "$R"
exit $rc
