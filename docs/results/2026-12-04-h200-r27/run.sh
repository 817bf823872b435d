#!/usr/bin/env bash
# Round 27, one H200 (run in the repo root by the device tool; carry .whl and .carry/r27). Cubins of this
# tree: .carry/r27/jit.tar.xz (the tests', the sanitizer runs' and the benchmark's variants, compiled on
# the CPU machine); main's tree and its benchmark cubins: .carry/r27/main.tar.gz, jit_main.tar.xz; the
# commits: .carry/r27/commit.txt. Everything lands in $OUT/r27/, packed at the end.
#  STEP=tests:  tools/gpu_check.sh's GPU suite (both numerics modes), then compute-sanitizer memcheck +
#               racecheck of every tier (round 24's jobs, now python3 -m tests.gpu.cases --jobs).
#  STEP=ab:     tools/ab_bench.sh: python -m megamoe_plugin.bench (v3, v4flash; $AB_NUMERICS, default both
#               modes; $AB_TOKENS, default all) under the base tree and this one, $ROUNDS rounds
#               interleaved, tools/ab_summary.py into ab.txt; then (PHASES=1, the default)
#               tools/phase_times.py in exact numerics (v3, v4flash; 128 and 2048 tokens) under both,
#               where the pull's publication shows as layout+pull. The base: main f74a37a
#               (.carry/r27/main.tar.gz, jit_main.tar.xz), or with BASE=b2b round 26's 1eaabda, the
#               back-to-back schedule (a grid barrier between the pull and exact L1; .carry/r26/main.tar.gz,
#               jit.tar.xz). Calls 2-4 ran the same benchmark commands from a loop in this file (their files
#               are ab_{BASE,new}_N.txt, summary.txt by tools/ab_summary.py).
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
  python3 -m tests.gpu.cases --jobs | OUT=$R bash tools/sanitizer_sweep.sh | tail -1 || rc=1
  stamp "sanitizers done"
fi
if [[ " ${STEP} " == *" ab "* ]]; then
  BASE=${BASE:-main}
  case $BASE in
    main) base_tree=.carry/r27/main.tar.gz base_cubins=.carry/r27/jit_main.tar.xz ;;
    b2b) base_tree=.carry/r26/main.tar.gz base_cubins=.carry/r26/jit.tar.xz ;;
  esac
  OUT=$R BENCH_FLAGS="--configs v3,v4flash --numerics ${AB_NUMERICS:-fast,exact} ${AB_TOKENS:+--tokens $AB_TOKENS} --baseline none" \
    bash tools/ab_bench.sh $base_tree $base_cubins $BASE new || exit 1
  # ab_bench.sh installed the base tree under the name `a`.
  phases() { MEGAMOE_NUMERICS=exact timeout 200 python3 tools/phase_times.py --configs v3,v4flash --tokens 128,2048; }
  for r in $(seq 1 $(( ${PHASES:-1} ? 2 : 0 ))); do
    in_tree a bash -c "cd $PWD && $(declare -f phases); phases" 2>&1 | grep total | sed "s/^/$BASE r$r: /"
    phases 2>&1 | grep total | sed "s/^/new r$r: /"
  done | tee "$R/phase_times_exact.txt"
  stamp "ab done"
fi
tar -czf "$OUT/r27_${STEP// /_}.tgz" -C "$OUT" r27 && rm -rf "$R"
exit $rc
