#!/usr/bin/env bash
# One GPU-machine call: install the package, run the GPU tests, then the benchmark.
# Usage (device tool, carry [".jitcache", ".whl"]): bash tools/gpu_check.sh [pytest args...]
# Env: BENCH_ARGS (passed to python -m megamoe_plugin.bench, which writes its JSON and plot to $OUT/bench;
#      BENCH=0 skips it), TEST=0 skips tests,
#      PHASES=1 adds tools/phase_times.py (PHASES_ARGS), TIMELINE=1 adds tools/tile_timeline.py
#      (TIMELINE_ARGS: where each GEMM tile's time goes), NCU=1 adds an Nsight Compute report of
#      one config (NCU_ARGS, default "--configs v4flash --tokens 1"), per phase, with the
#      shared-memory tables (wavefronts, bank conflicts) and the pipe utilization (tensor);
#      it also samples warp stalls per SASS instruction (ncu_source.csv.gz: which instruction each
#      warp waited at, and why). Those per-instruction counts replay the kernel instrumented, 100x
#      slower or more: v3 at 8192 tokens did not end its L1 launch in 480 s (round 14), so profile
#      2048 tokens or fewer (NCU_ARGS="--configs v3 --tokens 2048" puts L1 and L2 at BLOCK_M 128);
#      the kernel's waits get NCU_KERNEL_TIMEOUT_S (600) instead of MEGAMOE_TIMEOUT_S.
#      MICROBENCH=1 runs tools/microbench/mainloop.cu (the served main loop alone, under producers
#      of decreasing realism, beside the bare WGMMA stream; MICROBENCH_BIN: a binary built off the
#      GPU, else it builds here; MICROBENCH_ARGS: tiles per CTA; each variant in its own process).
#      SANITIZER=1 adds compute-sanitizer memcheck and racecheck of every BLOCK_M tier on
#      tests/gpu/cases.py's SANITIZER_SHAPES (small ones, pool windows among them), in each numerics
#      mode (SANITIZER_NUMERICS, SANITIZER_TIERS: space-separated subsets), through
#      tools/sanitizer_sweep.sh (several at once, 46 jobs in about 210 s; on 8 CTAs: fewer CTAs
#      spinning on flags under the tools; racecheck at BLOCK_M 128 did not end in 225 s on all 132,
#      results round 12). PRECOMPILE=1 first compiles (all CPUs) whatever the tests load that the
#      carried cache lacks (python -m tests.gpu.cases). SOAK=1 adds tools/soak.py (SOAK_ARGS).
set -u -o pipefail
# MEGAMOE_CACHE_DIR and WHEELS default to this tree's .jitcache and .whl; set them to run
# another checkout (e.g. a git worktree of a branch: cd there, bash <main>/tools/gpu_check.sh).
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
rc=0
if [ "${PRECOMPILE:-0}" != 0 ]; then
  ls "$MEGAMOE_CACHE_DIR" 2>/dev/null | grep -v "^\." | wc -l | sed 's/^/cubins carried: /'
  timeout "${PRECOMPILE_TIMEOUT:-300}" python3 -m tests.gpu.cases > "$OUT/precompile.log" 2>&1
  tail -1 "$OUT/precompile.log"
fi
if [ "${TEST:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -s -rs --timeout 300 tests/gpu tests/test_staging.py "$@" 2>&1 | tee "$OUT/tests.log"; rc=$?
fi
if [ "${BENCH:-1}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 -m megamoe_plugin.bench --results "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
if [ "${SOAK:-0}" != 0 ]; then
  timeout "${SOAK_TIMEOUT:-300}" python3 tools/soak.py ${SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.log" || rc=1
fi
if [ "${PHASES:-0}" != 0 ]; then
  timeout "${PHASES_TIMEOUT:-300}" python3 tools/phase_times.py ${PHASES_ARGS:-} 2>&1 | tee "$OUT/phase_times.txt"
fi
if [ "${TIMELINE:-0}" != 0 ]; then
  timeout "${TIMELINE_TIMEOUT:-300}" python3 tools/tile_timeline.py ${TIMELINE_ARGS:-} 2>&1 | tee "$OUT/tile_timeline.txt"
fi
if [ "${NCU:-0}" != 0 ]; then
  MEGAMOE_TIMEOUT_S="${NCU_KERNEL_TIMEOUT_S:-600}" timeout "${NCU_TIMEOUT:-300}" \
    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section SourceCounters -o "$OUT/profile" \
      python3 tools/phase_times.py ${NCU_ARGS:---configs v4flash --tokens 1} --iters 1 --profile > "$OUT/ncu.log" 2>&1
  ncu --import "$OUT/profile.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
  ncu --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu_source.csv.gz"
  tail -5 "$OUT/ncu.log"; grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)" "$OUT/ncu_details.txt"
fi
if [ "${MICROBENCH:-0}" != 0 ]; then
  bin="${MICROBENCH_BIN:-/tmp/mainloop}"
  [ -x "$bin" ] || nvcc $(python3 -c "from megamoe_plugin.jit import nvcc_flags; print(*nvcc_flags())") -I csrc \
      -I "$(python3 -c "from megamoe_plugin.jit import cutlass_include_dir; print(cutlass_include_dir())")" \
      tools/microbench/mainloop.cu -o "$bin" > "$OUT/microbench_build.log" 2>&1
  # One process per variant, each under its own timeout: a hang names its variant, and the rest still run.
  "$bin" 8 --list | while read -r variant; do
    timeout "${MICROBENCH_TIMEOUT:-30}" "$bin" ${MICROBENCH_ARGS:-8} "$variant" 2>&1 || echo "$variant: exit $?"
  done | awk '!seen[$0]++' | tee "$OUT/mainloop.txt"  # the device and column lines once
  if grep -q ": exit \|did not finish\|timed out" "$OUT/mainloop.txt"; then rc=1; fi
fi
if [ "${SANITIZER:-0}" != 0 ]; then  # tests/gpu/cases.py's jobs (shape, mode, tool, tier) for tools/sanitizer_sweep.sh
  numerics=${SANITIZER_NUMERICS:-} tiers=${SANITIZER_TIERS:-}
  python3 -m tests.gpu.cases --jobs ${numerics:+--numerics ${numerics// /,}} ${tiers:+--tiers ${tiers// /,}} |
    bash "$(dirname "${BASH_SOURCE[0]}")/sanitizer_sweep.sh" | tail -1 || rc=1
fi
ls "$MEGAMOE_CACHE_DIR" | grep -v "^\." | sort > "$OUT/jitcache_after.txt"
exit $rc
