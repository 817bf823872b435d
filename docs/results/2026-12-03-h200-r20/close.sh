#!/usr/bin/env bash
# Round 20 closing run of issue 12, one H200. STEP=tests | bench (run in the repo root by the device tool).
set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MEGAMOE_TIMEOUT_S="${MEGAMOE_TIMEOUT_S:-10}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
REPO=$PWD
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ ! -d /tmp/site/cutlass_library ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
export MEGAMOE_CACHE_DIR=/tmp/jitcache
if [ ! -d /tmp/jitcache ]; then mkdir -p /tmp/jitcache && tar -xJf .carry/caches.tar.xz -C /tmp/jitcache; fi
ls /tmp/jitcache | grep -v "^\." | wc -l | sed 's/^/cubins: /'
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
cp .carry/commit.txt "$OUT/commit.txt"
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  timeout 200 python3 -m tests.gpu.cases > "$OUT/precompile.log" 2>&1; stamp "precompile rc $? $(tail -1 $OUT/precompile.log)"
  timeout 420 python3 -m pytest -q -rs --timeout 300 tests/gpu tests/test_staging.py > "$OUT/tests.log" 2>&1; rc=$?
  stamp "tests rc $rc"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -12
  # compute-sanitizer memcheck + racecheck, every tier of both modes, 8 CTAs, four at once
  for numerics in fast exact; do
    for bm in $(python3 -c "from megamoe_plugin.heuristics import implemented_block_m; print(*implemented_block_m('$numerics'))"); do
      for tool in memcheck racecheck; do echo "$numerics $tool $bm"; done; done; done > /tmp/sanitizer_jobs.txt
  mkdir -p "$OUT/sanitizer"
  export OUT
  xargs -P 4 -L 1 bash -c 'log=$OUT/sanitizer/${0}_${1}_bm${2}.txt; MEGAMOE_NUM_SMS=8 MEGAMOE_NUMERICS=$0 MEGAMOE_BLOCK_M=$2 MEGAMOE_TIMEOUT_S=300 timeout 240 compute-sanitizer --tool $1 --error-exitcode 1 python3 tools/debug_phases.py 384 256 4 4 16 --phases 0 > $log 2>&1; echo "compute-sanitizer $0 $1 BLOCK_M $2: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" $log | tail -1)"' \
    < /tmp/sanitizer_jobs.txt | sort | tee "$OUT/sanitizer.txt"
  stamp "sanitizers done"
  grep -qv "exit 0" "$OUT/sanitizer.txt" && rc=1
  # round 18's two deterministic tolerance misses, replayed on run 5's inputs (dumpfail.py)
  rm -rf /tmp/replay && mkdir /tmp/replay && cp -r tests megamoe_plugin docs /tmp/replay/
  (cd /tmp/replay && patch -p1 < docs/results/2026-12-03-h200-r18/run5_forced_twice/forced_tiers_as_run5.diff > "$OUT/replay_patch.log" 2>&1 &&
   PYTHONPATH=/tmp/site:/tmp/replay/docs/results/2026-12-03-h200-r18 timeout 200 python3 -m pytest -q -s -p dumpfail --timeout 150 \
     -p no:cacheprovider tests/gpu/test_forced_tiers.py > "$OUT/replay_dump.log" 2>&1)
  stamp "replay rc $?"; grep -E "DUMP|passed|failed" "$OUT/replay_dump.log" | tail -30
  for numerics in fast exact; do
    MEGAMOE_NUMERICS=$numerics timeout 150 python3 tools/phase_times.py --configs v3,v4flash --tokens 1,32,128 > "$OUT/phase_times_$numerics.txt" 2>&1
  done
  stamp "phase times done"
fi
if [[ " ${STEP} " == *" bench "* ]]; then
  # Both modes on this tree (main), interleaved with fast rounds of the experiment (.carry/exp.diff:
  # L2 trailing L1 at BLOCK_M 64), each installed apart and run from /tmp.
  if [ -f .carry/exp.diff ] && [ ! -d /tmp/site_exp ]; then
    rm -rf /tmp/exptree && mkdir /tmp/exptree && cp -r setup.py pyproject.toml README.md csrc megamoe_plugin configs /tmp/exptree/ &&
      (cd /tmp/exptree && patch -p1 < $REPO/.carry/exp.diff > $OUT/exp_patch.log) &&
      python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_exp /tmp/exptree > "$OUT/install_exp.log" 2>&1 || cat "$OUT/install_exp.log"
    mkdir -p /tmp/jitcache_exp && tar -xJf .carry/exp_caches.tar.xz -C /tmp/jitcache_exp
  fi
  for r in $(seq 1 ${ROUNDS:-2}); do
    (cd /tmp && timeout 280 python3 -m megamoe_plugin.bench --configs v3,v4flash --numerics fast,exact --baseline none \
      --results "$OUT/bench_main_$r" > "$OUT/bench_main_$r.txt" 2> "$OUT/bench_main_${r}_stderr.log"); stamp "bench main round $r rc $?"
    if [ -d /tmp/site_exp ]; then
      (cd /tmp && PYTHONPATH=/tmp/site_exp:/tmp/site MEGAMOE_CACHE_DIR=/tmp/jitcache_exp timeout 200 python3 -m megamoe_plugin.bench \
        --configs v3,v4flash --numerics fast --baseline none --results "$OUT/bench_exp_$r" > "$OUT/bench_exp_$r.txt" \
        2> "$OUT/bench_exp_${r}_stderr.log"); stamp "bench exp round $r rc $?"
    fi
  done
  cat "$OUT/bench_main_1.txt"
  python3 tools/ab_summary.py --a "$OUT"/bench_main_?.txt --b "$OUT"/bench_exp_?.txt --names main,exp | tee "$OUT/ab_summary.txt"
fi
if [[ " ${STEP} " == *" tune "* ]]; then
  timeout 420 python3 -m megamoe_plugin.tune --output-dir "$OUT/table" > "$OUT/tune.log" 2>&1; stamp "tune rc $?"; tail -5 "$OUT/tune.log"
  timeout 120 python3 tools/tile_timeline.py --configs v3 --tokens 128,8192 > "$OUT/tile_timeline.txt" 2>&1; stamp "timeline rc $?"
fi
ls /tmp/jitcache | grep -v "^\." | sort > "$OUT/jitcache_after.txt"
exit $rc
