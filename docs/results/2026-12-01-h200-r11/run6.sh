#!/usr/bin/env bash
# RS token operand at BLOCK_M 128 (mma.cuh kRegisterA): build, the pending masked-slot test, GPU tests, A/B vs HEAD (1e93f92).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD
export MEGAMOE_CACHE_DIR=$ROOT/.jitcache
mkdir -p .jitcache
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_cutlass/*.whl
export PYTHONPATH=/tmp/site MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install0.log 2>&1
cp megamoe_plugin/_runtime*.so .carry/exp/base/megamoe_plugin/
t0=$(date +%s)
for tree in $ROOT $ROOT/.carry/exp/base; do
for shape in "--hidden 7168 --intermediate-size 2048 --num-experts 32 --topk 8" "--hidden 4096 --intermediate-size 2048 --num-experts 32 --topk 6"; do
  (cd $tree && PYTHONPATH=$tree:/tmp/site python3 -m megamoe_plugin.jit --build $shape --batch-sizes 128,512,2048,8192 --numerics fast --gpu "NVIDIA H200" --cache-dir $ROOT/.jitcache > $OUT/build.log 2>&1) || tail -3 $OUT/build.log
done; done
echo "build: $(( $(date +%s) - t0 )) s"
AB="--configs v3,v4flash --tokens 128,512,2048,8192 --numerics fast --baseline none"
for i in 1 2; do for tree in new base; do
  d=$ROOT; [ $tree = base ] && d=$ROOT/.carry/exp/base
  (cd $d && PYTHONPATH=$d:/tmp/site timeout 200 python3 -m megamoe_plugin.bench $AB --results $OUT/ab_${tree}_$i 2>>$OUT/ab_stderr.log | sed "s/^/$tree$i /") | tee -a $OUT/ab.txt | grep -E " (v3|v4flash) "
done; done
timeout 300 python3 -m tests.gpu.cases > $OUT/precompile.log 2>&1; tail -1 $OUT/precompile.log; grep -c SPILLS $OUT/precompile.log
TEST=1 BENCH=0 TEST_TIMEOUT=300 bash tools/gpu_check.sh -x 2>&1 | tail -4
