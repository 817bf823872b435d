#!/usr/bin/env bash
# A/B benchmark on the GPU machine: this tree against another one, carried as a tarball of its files
# (git archive) with a tarball of its cubins (.tar.xz, compiled on the CPU machine), `python -m
# megamoe_plugin.bench` rounds interleaved, then tools/ab_summary.py into $OUT/ab.txt.
# Usage: tools/ab_bench.sh A_TREE.tar.gz A_CUBINS.tar.xz [A_NAME] [B_NAME]
# Env: ROUNDS (2), BENCH_FLAGS (default: v3 and v4flash, both numerics modes, no baseline), BENCH_LAUNCH
# (default "python3 -m"; on two GPUs "python3 -m torch.distributed.run --nproc-per-node 2 -m"),
# BENCH_RUN_TIMEOUT (seconds per benchmark run, default 150).
set -u -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"  # install_tree, in_tree
a_tree=$1 a_cubins=$2 a_name=${3:-main} b_name=${4:-new}
install_tree a "$a_tree" "$a_cubins" || exit 1
flags="${BENCH_FLAGS:---configs v3,v4flash --numerics fast,exact --baseline none}"
launch="${BENCH_LAUNCH:-python3 -m}" limit="${BENCH_RUN_TIMEOUT:-150}"
for r in $(seq 1 "${ROUNDS:-2}"); do
  in_tree a timeout "$limit" $launch megamoe_plugin.bench $flags > "$OUT/bench_${a_name}_$r.txt" 2> /tmp/bench_a_$r.err
  echo "bench $a_name $r rc $?"
  timeout "$limit" $launch megamoe_plugin.bench $flags > "$OUT/bench_${b_name}_$r.txt" 2> /tmp/bench_b_$r.err
  echo "bench $b_name $r rc $?"
done
grep -c "megamoe: compiling" /tmp/bench_?_*.err | sed 's/^/nvcc runs: /'
# Every round's file by its number (a `_?` glob dropped rounds 10 and up).
rounds=$(seq 1 "${ROUNDS:-2}")
python3 tools/ab_summary.py --a $(printf "$OUT/bench_${a_name}_%s.txt " $rounds) \
  --b $(printf "$OUT/bench_${b_name}_%s.txt " $rounds) --names "$a_name,$b_name" |
  tee "$OUT/ab.txt"
