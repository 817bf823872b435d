#!/usr/bin/env bash
# Soak + compute-sanitizer of the batched pipelined main loop (4ef1257+), pre-built cache carried.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MEGAMOE_CACHE_DIR=$PWD/.jitcache_final
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_cutlass/*.whl
export PYTHONPATH=/tmp/site MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1
timeout 70 python3 tools/soak.py --calls 60000 2>&1 | tail -8 | tee $OUT/soak.log
for bm in 64 128; do for tool in memcheck racecheck; do
  log=$OUT/sanitizer_fast_${tool}_bm$bm.txt
  MEGAMOE_NUMERICS=fast MEGAMOE_BLOCK_M=$bm MEGAMOE_TIMEOUT_S=300 timeout 45 compute-sanitizer --tool $tool --error-exitcode 1 \
      python3 tools/debug_phases.py 384 256 4 4 16 --phases 0 > $log 2>&1
  echo "compute-sanitizer fast $tool BLOCK_M $bm: exit $? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" $log | tail -1)"
done; done | tee $OUT/sanitizer.txt
