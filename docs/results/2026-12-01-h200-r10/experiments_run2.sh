#!/usr/bin/env bash
# Experiments (timing only; wrong results): X1 one wait+promote per k-block, X2 no TMA loads after
# the first stages, X3 both, X4 no L2 epilogue stores. Baseline = main a596e7f.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD
mkdir -p .jitcache && tar -xJf .carry/jit2.tar.xz -C .jitcache
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include MEGAMOE_CACHE_DIR=$ROOT/.jitcache
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1
ARGS="--configs v3,v4flash --tokens 2048,8192 --iters 5"
for x in base X1 X2 X3 X4 base; do
  if [ $x = base ]; then d=$ROOT; else d=$ROOT/.carry/exp/$x; cp $ROOT/megamoe_plugin/_runtime*.so $d/megamoe_plugin/; fi
  (cd $d && PYTHONPATH=$d:/tmp/site python3 -c "import megamoe_plugin.paths as p; print('$x', p.CSRC_DIR)" && \
   PYTHONPATH=$d:/tmp/site timeout 120 python3 tools/phase_times.py $ARGS) 2>&1 | tee -a $OUT/exp.txt
done
ls .jitcache | wc -l
