#!/usr/bin/env bash
# Round 30, call 4: the one cell whose calls disagreed in sign (v3 exact 2048 tokens: b2b against main
# -2.6% / +2.7% / -1.1% in calls 1-3): $ROUNDS (default 16) more interleaved rounds of that cell alone,
# then tools/phase_times.py (the phase stops: where the time goes) under both trees. Carry as run.sh.
# As run in call 4 the b2b phase times said `in_tree b2b`, but ab_bench.sh installs its base tree as `a`
# (/tmp/site_a): with no /tmp/site_b2b they imported main's package (and compiled its variant into an
# empty cache), so call 4's phase_b2b_*.txt are main's. Fixed below.
set -u -o pipefail
JITCACHE_TARBALL=.carry/r30/jit_main.tar.xz
source tools/device_env.sh
R="$OUT/r30_cell"; mkdir -p "$R"
cp .carry/r30/commit.txt "$R/commit.txt"
OUT=$R ROUNDS=${ROUNDS:-16} BENCH_FLAGS="--configs v3 --numerics exact --tokens 2048 --baseline none" \
  bash tools/ab_bench.sh .carry/r30/b2b.tar.gz .carry/r30/jit_b2b.tar.xz b2b main | sed -E 's/\[[^]]*\]//g'
stamp "ab done"
for i in 1 2; do
  in_tree a env MEGAMOE_NUMERICS=exact timeout 120 python3 "$PWD/tools/phase_times.py" --configs v3 --tokens 2048 > "$R/phase_b2b_$i.txt" 2>&1
  MEGAMOE_NUMERICS=exact timeout 120 python3 tools/phase_times.py --configs v3 --tokens 2048 > "$R/phase_main_$i.txt" 2>&1
done
tail -n 12 "$R"/phase_*_1.txt
stamp "phase times done"
tar -czf "$OUT/r30_cell.tgz" -C "$OUT" r30_cell && rm -rf "$R"
