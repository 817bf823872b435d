# Sourced by run7.sh / run8.sh / run9.sh: the CUTLASS wheel, main installed, the experiment trees
# beside it (TREES, default "epi l2b both": exp/epilogue-rows, exp/l2-rows128 and the two merged,
# exp/both), every tree's carried kernel cache.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD N=$ROOT/.carry/next TREES="${TREES:-epi l2b both}"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_cutlass/*.whl
export PYTHONPATH=/tmp/site MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
for tree in main $TREES; do
  mkdir -p /tmp/cache_$tree && tar -xJf $N/cache_$tree.tar.xz -C /tmp/cache_$tree
  [ $tree = main ] || cp megamoe_plugin/_runtime*.so $N/$tree/megamoe_plugin/
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
stamp "setup: $(for tree in main $TREES; do echo -n "$tree $(ls /tmp/cache_$tree | wc -l) "; done)cubins"
in_tree() {  # in_tree TREE CMD...: CMD in that tree (main or one of TREES), with its own kernel cache
  local tree=$1 d=$ROOT; shift
  [ $tree = main ] || d=$N/$tree
  (cd "$d" && MEGAMOE_CACHE_DIR=/tmp/cache_$tree PYTHONPATH=$d:/tmp/site "$@")
}
