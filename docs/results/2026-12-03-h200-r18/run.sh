#!/usr/bin/env bash
# One GPU call. STEP=tests: precompile what the carried cache lacks, GPU tests (new tree).
# STEP=bench: A/B of .carry/mainwt (main) against this tree (new), ROUNDS interleaved rounds.
set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MEGAMOE_TIMEOUT_S="${MEGAMOE_TIMEOUT_S:-10}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
[ -d /tmp/site_new ] || python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_new . > "$OUT/install_new.log" 2>&1 || { cat "$OUT/install_new.log"; exit 1; }
[ -d /tmp/site_main ] || python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_main .carry/mainwt > "$OUT/install_main.log" 2>&1 || { cat "$OUT/install_main.log"; exit 1; }
rc=0
if [[ " ${STEP} " == *" tests "* ]]; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site MEGAMOE_CACHE_DIR=$REPO/.jitcache
  ls .jitcache | wc -l | sed 's/^/cubins carried: /'
  timeout 300 python3 -m tests.gpu.cases > "$OUT/precompile.log" 2>&1; echo "precompile rc $?"; tail -1 "$OUT/precompile.log"
  for i in $(seq 1 ${TEST_REPEAT:-1}); do
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rs --timeout 300 ${TEST_PATHS:-tests/gpu tests/test_staging.py} ${TEST_ARGS:-} > "$OUT/tests_$i.log" 2>&1; rc=$?
    echo "tests rc $rc"; grep -E "^FAILED|^ERROR|passed|failed|AssertionError" "$OUT/tests_$i.log" | tail -12
  done
fi
if [[ " ${STEP} " == *" dump "* ]]; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
  PYTHONPATH=/tmp/site MEGAMOE_CACHE_DIR=$REPO/.jitcache timeout 200 python3 -m tests.gpu.cases > "$OUT/precompile.log" 2>&1
  PYTHONPATH=/tmp/site:$REPO/.carry MEGAMOE_CACHE_DIR=$REPO/.jitcache timeout 200 python3 -m pytest -q -s -p dumpfail --timeout 100 tests/gpu/test_forced_tiers.py > "$OUT/dump.log" 2>&1
  grep -E "DUMP|passed|failed" "$OUT/dump.log"
fi
if [[ " ${STEP} " == *" maintests "* ]]; then
  # this tree's forced-tier tests (same seeds, same inputs) against main's kernel
  cp tests/gpu/test_forced_tiers.py tests/gpu/cases.py .carry/mainwt/tests/gpu/
  (cd .carry/mainwt && python3 setup.py -q build_ext --inplace > "$OUT/build_main.log" 2>&1 &&
   export PYTHONPATH=/tmp/site MEGAMOE_CACHE_DIR=$REPO/.carry/mainwt/.jitcache &&
   timeout 200 python3 -m tests.gpu.cases > "$OUT/precompile_main.log" 2>&1; tail -1 "$OUT/precompile_main.log"
   timeout 200 python3 -m pytest -q --timeout 100 tests/gpu/test_forced_tiers.py > "$OUT/tests_main.log" 2>&1
   grep -E "^FAILED|passed|failed|AssertionError" "$OUT/tests_main.log" | tail -12)
fi
if [[ " ${STEP} " == *" diag "* ]]; then
  export PYTHONPATH=/tmp/site_new:/tmp/site MEGAMOE_CACHE_DIR=$REPO/.jitcache
  if [ -n "${SEQ:-}" ]; then
    timeout 150 python3 -m pytest -q --timeout 100 tests/gpu/test_forced_tiers.py 2>&1 | tail -4 | tee "$OUT/forced_tiers_again.txt"
    timeout 200 python3 .carry/diag.py seq $SEQ 2>&1 | grep -v "compiling" | tee "$OUT/seq_new.txt"
    (cd /tmp && PYTHONPATH=/tmp/site_main:/tmp/site MEGAMOE_CACHE_DIR=$REPO/.carry/mainwt/.jitcache timeout 200 python3 $REPO/.carry/diag.py seq $SEQ 2>&1 | grep -v "compiling" | tee "$OUT/seq_main.txt")
  fi
  [ -n "${SEQ:-}" ] || timeout 200 python3 .carry/diag.py grid ${DIAG_SEEDS:-10} 2>&1 | grep -v "compiling kernels" | tee "$OUT/diag_grid.txt"
  [ -n "${SEQ:-}" ] || timeout 200 python3 .carry/diag.py exact ${DIAG_SEEDS:-10} 2>&1 | grep -v "compiling kernels" | tee "$OUT/diag_exact_new.txt"
  [ -n "${SEQ:-}" ] || (cd /tmp && PYTHONPATH=/tmp/site_main:/tmp/site MEGAMOE_CACHE_DIR=$REPO/.carry/mainwt/.jitcache timeout 200 python3 $REPO/.carry/diag.py exact ${DIAG_SEEDS:-10} 2>&1 | grep -v "compiling kernels" | tee "$OUT/diag_exact_main.txt")
fi
if [[ " ${STEP} " == *" bench "* ]] && [ $rc = 0 ]; then
  cd /tmp
  for r in $(seq 1 ${ROUNDS:-3}); do
    for tree in main new; do
      if [ $tree = main ]; then cache=$REPO/.carry/mainwt/.jitcache; else cache=$REPO/.jitcache; fi
      PYTHONPATH=/tmp/site_$tree:/tmp/site MEGAMOE_CACHE_DIR=$cache timeout 300 python3 -m megamoe_plugin.bench \
        --configs ${CONFIGS:-v3,v4flash} --tokens ${TOKENS:-1,8,32,128,512,2048,8192} --numerics ${NUMERICS:-fast} \
        --baseline none --results /tmp/b > "$OUT/bench_${tree}_$r.txt" 2>> "$OUT/bench_stderr.log"
    done
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import sys, glob, statistics, re
out = sys.argv[1]
def load(tree):
    runs = {}
    for f in sorted(glob.glob(f"{out}/bench_{tree}_*.txt")):
        for line in open(f):
            m = re.match(r"(\S+)\s+(fast|exact)\s+(\d+)\s+([\d.]+)", line)
            if m: runs.setdefault((m[1], m[2], int(m[3])), []).append(float(m[4]))
    return runs
a, b = load("main"), load("new")
for k in sorted(a, key=lambda k: (k[0], k[1], k[2])):
    if k in b:
        ma, mb = statistics.median(a[k]), statistics.median(b[k])
        print(f"{k[0]:8s} {k[1]:5s} {k[2]:6d}  main {ma:8.1f} {a[k]}  new {mb:8.1f} {b[k]}  {100*(mb/ma-1):+.1f}%")
PY
fi
exit $rc
