#!/usr/bin/env bash
# Next hold, call 2 (carry [".whl_cutlass", ".carry/next"]), on main: Nsight Compute with warp-stall
# sampling per SASS instruction on v3 at 8192 tokens (BLOCK_M 128), and racecheck at BLOCK_M 128 on
# an 8-CTA grid (it did not end in 225 s on 132, results round 12).
set -u
N=$PWD/.carry/next
mkdir -p /tmp/cache_main && tar -xJf $N/cache_main.tar.xz -C /tmp/cache_main
TEST=0 BENCH=0 NCU=1 NCU_TIMEOUT=330 NCU_ARGS="--configs v3 --tokens 8192" \
  SANITIZER=1 SANITIZER_NUMERICS=fast SANITIZER_TIERS=128 SANITIZER_SMS=8 SANITIZER_TIMEOUT=200 \
  MEGAMOE_CACHE_DIR=/tmp/cache_main WHEELS=.whl_cutlass bash tools/gpu_check.sh
rm -f $OUT/profile.ncu-rep.bak; ls -la $OUT
