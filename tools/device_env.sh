# Sourced (not run) at the start of every GPU-machine script: tools/gpu_check.sh and the rounds'
# docs/results/<round>/run.sh. One place for what each of them needs before its first test:
#  - the NVLink-multicast switches that must stay off on these machines, unbuffered Python;
#  - the carried wheels (.whl, e.g. nvidia-cutlass) installed into /tmp/site, their CUTLASS headers;
#  - the JIT cache: MEGAMOE_CACHE_DIR if set, else the tree's .jitcache, else unpacked from
#    $JITCACHE_TARBALL (a .tar.xz of cubins compiled on the CPU machine) into a folder of that tarball's
#    own, so that another tree's tarball in the same machine session is not shadowed by the first;
#  - the GPU's name and clocks into $OUT/gpu.txt, and this package installed in place (once: a script
#    sourcing this from one that already did, e.g. gpu_check.sh or ab_bench.sh from a round's run.sh,
#    skips both).
# Defines stamp(): seconds since sourcing, for the scripts' progress lines, and install_tree / in_tree.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MEGAMOE_TIMEOUT_S="${MEGAMOE_TIMEOUT_S:-10}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
_device_env_t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - _device_env_t0 )) s] $*"; }

WHEELS="${WHEELS:-.whl}"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/cutlass_library ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  export MEGAMOE_CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
fi

if [ -z "${MEGAMOE_CACHE_DIR:-}" ]; then
  if [ -n "${JITCACHE_TARBALL:-}" ]; then
    export MEGAMOE_CACHE_DIR="/tmp/jitcache_$(echo "$JITCACHE_TARBALL" | tr '/.' '__')"
    [ -d "$MEGAMOE_CACHE_DIR" ] ||
      { mkdir -p "$MEGAMOE_CACHE_DIR" && tar -xJf "$JITCACHE_TARBALL" -C "$MEGAMOE_CACHE_DIR"; }
  else
    export MEGAMOE_CACHE_DIR="$PWD/.jitcache"
  fi
fi
echo "cubins carried: $(ls "$MEGAMOE_CACHE_DIR" 2>/dev/null | grep -vc '^\.')"

if [ -z "${MEGAMOE_DEVICE_ENV_READY:-}" ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 ||
    { cat "$OUT/install.log"; exit 1; }
  export MEGAMOE_DEVICE_ENV_READY=1
fi

# install_tree NAME TREE_TGZ CUBINS_TXZ: another tree (a `git archive` tarball, e.g. main's for an A/B
# run) installed into /tmp/site_NAME and its cubins (compiled on the CPU machine) into
# /tmp/jitcache_NAME, for in_tree.
install_tree() {
  mkdir -p /tmp/tree_$1 /tmp/jitcache_$1 && tar -xzf "$2" -C /tmp/tree_$1 && tar -xJf "$3" -C /tmp/jitcache_$1 &&
    python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_$1 /tmp/tree_$1 > /tmp/install_$1.log 2>&1 ||
    { cat /tmp/install_$1.log; return 1; }
}
# in_tree NAME CMD...: CMD from /tmp (away from this tree's package) with tree NAME's package and cubins.
in_tree() {
  local name=$1; shift
  # A name never installed would import this tree's package instead, silently (round 30, call 4).
  [ -d "/tmp/site_$name" ] || { echo "in_tree: no tree '$name' (install_tree $name ... first)" >&2; return 2; }
  (cd /tmp && PYTHONPATH=/tmp/site_$name:/tmp/site MEGAMOE_CACHE_DIR=/tmp/jitcache_$name "$@")
}
