#!/usr/bin/env bash
# Round 30, call 5: where the back-to-back schedule loses time, by phase stops (tools/phase_times.py),
# b2b (installed as tree `a`, as ab_bench.sh does) and main alternating, $RUNS (default 3) processes
# each, v3 and v4flash at 2048 and 8192 tokens in $MODES (default: exact, fast). Carry as run.sh.
set -u -o pipefail
JITCACHE_TARBALL=.carry/r30/jit_main.tar.xz
source tools/device_env.sh
R="$OUT/r30_phases"; mkdir -p "$R"
cp .carry/r30/commit.txt "$R/commit.txt"
install_tree a .carry/r30/b2b.tar.gz .carry/r30/jit_b2b.tar.xz || exit 1
for mode in ${MODES:-exact fast}; do
  for i in $(seq 1 "${RUNS:-3}"); do
    in_tree a env MEGAMOE_NUMERICS=$mode timeout 150 python3 "$PWD/tools/phase_times.py" --configs v3,v4flash \
      --tokens 2048,8192 > "$R/phase_b2b_${mode}_$i.txt" 2>&1
    MEGAMOE_NUMERICS=$mode timeout 150 python3 tools/phase_times.py --configs v3,v4flash --tokens 2048,8192 \
      > "$R/phase_main_${mode}_$i.txt" 2>&1
  done
done
grep -c "megamoe: compiling" "$R"/phase_*.txt | grep -v ':0$' | sed 's/^/compiled: /'
for f in "$R"/phase_*_1.txt; do echo "== $(basename "$f")"; grep "total" "$f"; done
stamp "phase times done"
tar -czf "$OUT/r30_phases.tgz" -C "$OUT" r30_phases && rm -rf "$R"
