#!/usr/bin/env bash
# The GPU check of this checkout on a machine with an SM90 (Hopper) GPU: install the package in
# place, run the GPU tests, then the benchmark; further parts on request.
#
#   bash tools/gpu_check.sh [RESULTS_DIR] [-- pytest args...]
#
# It runs in the checkout it belongs to, from any folder. RESULTS_DIR (default ./gpu-check-results,
# relative to the folder it is started from) receives every log, the benchmark's JSON and plot.
# Without an SM90 GPU it stops at once with exit status 1, and so does any failed part.
#
# Environment (all optional):
#   WHEELS=DIR      install the wheels in DIR first, without an index (an offline machine: on one with
#                   network, `pip download -d DIR nvidia-cutlass pytest-timeout`); default: none
#   INSTALL=0       do not `pip install -e .` (the package is installed already)
#   MEGAMOE_CACHE_DIR  the kernel cache (default ~/.cache/megamoe_plugin); a cache pre-built on a
#                   machine with nvcc (PRECOMPILE below, or python -m megamoe_plugin.jit --build)
#                   saves the GPU machine the compiles
#   MEGAMOE_TIMEOUT_S  bound of every in-kernel wait (default here 10 s: a hang fails fast)
#   TEST=0          skip the GPU tests (tests/gpu and tests/test_staging.py); TEST_TIMEOUT (s, 1800)
#   BENCH=0         skip `python -m megamoe_plugin.bench` (BENCH_ARGS: its options; BENCH_TIMEOUT, 600)
#   PRECOMPILE=1    first compile every variant the tests, sanitizer runs and benchmarks load
#                   (python -m tests.gpu.cases; all CPUs; PRECOMPILE_TIMEOUT, 1800)
#   SANITIZER=1     compute-sanitizer memcheck and racecheck of every tile tier on tests/gpu/cases.py's
#                   SANITIZER_SHAPES in both numerics modes (SANITIZER_NUMERICS, SANITIZER_TIERS:
#                   space-separated subsets), through tools/sanitizer_sweep.sh
#   PHASES=1        tools/phase_times.py (PHASES_ARGS): where a call's time goes, phase by phase
#   TIMELINE=1      tools/tile_timeline.py (TIMELINE_ARGS): where each GEMM tile's time goes
#   AUX_STALL=1     tools/aux_stream_stall.py (AUX_STALL_ARGS): what a shared expert's GEMMs beside, before
#                   or after the kernel cost a layer
#   SOAK=1          tools/soak.py (SOAK_ARGS): many calls on one buffer, some checked
#   PYTHON          the interpreter (default python3)
set -u -o pipefail
RESULTS_DIR=./gpu-check-results
if [ $# -gt 0 ] && [ "$1" != "--" ]; then RESULTS_DIR=$1; shift; fi
[ "${1:-}" = "--" ] && shift
TOOLS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$RESULTS_DIR" && RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd) || exit 1
[ -z "${WHEELS:-}" ] || WHEELS=$(cd "$WHEELS" && pwd) || exit 1
cd "$TOOLS/.." || exit 1
export PYTHONUNBUFFERED=1 MEGAMOE_TIMEOUT_S="${MEGAMOE_TIMEOUT_S:-10}"

"$PY" - << 'PY' || exit 1
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: needs torch with CUDA and an SM90 (Hopper) GPU; torch is not installed")
if not torch.cuda.is_available():
    sys.exit("gpu_check: needs an SM90 (Hopper) GPU; CUDA is not available here")
names = [f"{torch.cuda.get_device_name(i)} (SM{''.join(map(str, torch.cuda.get_device_capability(i)))})"
         for i in range(torch.cuda.device_count())]
if torch.cuda.get_device_capability(0) != (9, 0):
    sys.exit(f"gpu_check: needs an SM90 (Hopper) GPU; GPU 0 is {names[0]}")
print("gpu_check: " + ", ".join(names))
PY

if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl > "$RESULTS_DIR/wheels.log" 2>&1 ||
    { cat "$RESULTS_DIR/wheels.log"; echo "gpu_check: installing the wheels of $WHEELS failed" >&2; exit 1; }
fi
if [ "${INSTALL:-1}" != 0 ]; then
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . > "$RESULTS_DIR/install.log" 2>&1 ||
    { cat "$RESULTS_DIR/install.log"; echo "gpu_check: pip install -e . failed" >&2; exit 1; }
fi

rc=0
fail() { echo "gpu_check: $1 failed" >&2; rc=1; }
if [ "${PRECOMPILE:-0}" != 0 ]; then
  timeout "${PRECOMPILE_TIMEOUT:-1800}" "$PY" -m tests.gpu.cases > "$RESULTS_DIR/precompile.log" 2>&1 || fail precompile
  tail -1 "$RESULTS_DIR/precompile.log"
fi
if [ "${TEST:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-1800}" "$PY" -m pytest -q -s -rs --timeout 300 tests/gpu tests/test_staging.py "$@" 2>&1 |
    tee "$RESULTS_DIR/tests.log" || fail "the GPU tests"
fi
if [ "${BENCH:-1}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-600}" "$PY" -m megamoe_plugin.bench --results "$RESULTS_DIR/bench" ${BENCH_ARGS:-} 2>&1 |
    tee "$RESULTS_DIR/bench.log" || fail "the benchmark"
fi
if [ "${SOAK:-0}" != 0 ]; then
  timeout "${SOAK_TIMEOUT:-1800}" "$PY" "$TOOLS/soak.py" ${SOAK_ARGS:-} 2>&1 | tee "$RESULTS_DIR/soak.log" || fail soak
fi
if [ "${PHASES:-0}" != 0 ]; then
  timeout "${PHASES_TIMEOUT:-600}" "$PY" "$TOOLS/phase_times.py" ${PHASES_ARGS:-} 2>&1 |
    tee "$RESULTS_DIR/phase_times.txt" || fail phase_times
fi
if [ "${TIMELINE:-0}" != 0 ]; then
  timeout "${TIMELINE_TIMEOUT:-600}" "$PY" "$TOOLS/tile_timeline.py" ${TIMELINE_ARGS:-} 2>&1 |
    tee "$RESULTS_DIR/tile_timeline.txt" || fail tile_timeline
fi
if [ "${AUX_STALL:-0}" != 0 ]; then
  timeout "${AUX_STALL_TIMEOUT:-600}" "$PY" "$TOOLS/aux_stream_stall.py" ${AUX_STALL_ARGS:-} 2>&1 |
    tee "$RESULTS_DIR/aux_stream_stall.txt" || fail aux_stream_stall
fi
if [ "${SANITIZER:-0}" != 0 ]; then
  numerics=${SANITIZER_NUMERICS:-} tiers=${SANITIZER_TIERS:-}
  "$PY" -m tests.gpu.cases --jobs ${numerics:+--numerics ${numerics// /,}} ${tiers:+--tiers ${tiers// /,}} |
    bash "$TOOLS/sanitizer_sweep.sh" "$RESULTS_DIR/sanitizer" | tail -1 || fail "the sanitizer sweep"
fi
[ "$rc" = 0 ] && echo "gpu_check: passed; logs in $RESULTS_DIR" || echo "gpu_check: FAILED; logs in $RESULTS_DIR" >&2
exit $rc
