#!/usr/bin/env bash
# Next hold, call 1 (carry [".whl_cutlass", ".carry/next"]): the main-loop microbenchmark, then the
# epilogue-rows experiment (branch exp/epilogue-rows, copied to .carry/next/epi): its GPU tests,
# its outputs bitwise against main's, its tile timeline and an interleaved A/B bench against main.
# Call 2 is run8.sh (NCU stall sampling, racecheck on 8 CTAs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD N=$ROOT/.carry/next EPI=$ROOT/.carry/next/epi
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_cutlass/*.whl
export PYTHONPATH=/tmp/site MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
cp megamoe_plugin/_runtime*.so $EPI/megamoe_plugin/
mkdir -p /tmp/cache_main /tmp/cache_epi
tar -xJf $N/cache_main.tar.xz -C /tmp/cache_main && tar -xJf $N/cache_epi.tar.xz -C /tmp/cache_epi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
stamp "setup: $(ls /tmp/cache_main | wc -l) + $(ls /tmp/cache_epi | wc -l) cubins carried"
tree_env() {  # tree_env main|epi: the folder and the cache of that tree
  if [ "$1" = epi ]; then echo "$EPI /tmp/cache_epi"; else echo "$ROOT /tmp/cache_main"; fi
}
in_tree() {  # in_tree main|epi CMD...: CMD in that tree, with its own kernel cache
  local d c; read -r d c <<< "$(tree_env "$1")"; shift
  (cd "$d" && MEGAMOE_CACHE_DIR=$c PYTHONPATH=$d:/tmp/site "$@")
}

# 1. The served main loop alone (tools/microbench/mainloop.cu), 8 tiles of 56 k-blocks per CTA.
timeout 60 $N/mainloop 8 > $OUT/mainloop.txt 2>&1; cat $OUT/mainloop.txt
stamp microbench

# 2. The experiment: GPU tests (both modes, every tier), bitwise outputs against main.
in_tree epi python3 -c "import megamoe_plugin; print('epi imports', megamoe_plugin.__file__)"
in_tree epi timeout 240 python3 -m pytest -q -x -rs --timeout 200 tests/gpu > $OUT/tests_epi.log 2>&1
tail -3 $OUT/tests_epi.log; stamp tests
for tree in main epi; do in_tree $tree timeout 90 python3 $N/outputs_digest.py > $OUT/digest_$tree.txt 2>&1; done
cat $OUT/digest_epi.txt; diff $OUT/digest_main.txt $OUT/digest_epi.txt > /dev/null && echo "digest: main and epi bitwise equal" || echo "digest: DIFFERENT"
stamp digest

# 3. Where the tiles' time goes, then the calls, interleaved epi/main/epi/main.
for tree in epi main; do
  in_tree $tree timeout 90 python3 tools/tile_timeline.py --configs v3,v4flash --tokens 2048,8192 2>&1 \
    | sed "s/^/$tree /" | tee -a $OUT/tile_timeline.txt | grep -E "L1:|L2:|call"
done
stamp timeline
AB="--configs v3,v4flash --tokens 128,512,2048,8192 --numerics fast --baseline none"
for i in 1 2; do for tree in epi main; do
  in_tree $tree timeout 100 python3 -m megamoe_plugin.bench $AB --results $OUT/ab_${tree}_$i 2>>$OUT/ab_stderr.log \
    | sed "s/^/$tree$i /" | tee -a $OUT/ab.txt | grep -E " (v3|v4flash) "
done; done
stamp ab
cd $OUT && tar -czf logs.tgz *.txt *.log ab_* 2>/dev/null; ls $OUT
