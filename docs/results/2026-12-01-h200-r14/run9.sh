#!/usr/bin/env bash
# Next hold, call 3 of 3, on main: Nsight Compute with warp-stall sampling per SASS instruction on
# v3 at 8192 tokens (BLOCK_M 128), and racecheck at BLOCK_M 128 on an 8-CTA grid (it did not end in
# 225 s on 132, results round 12). At most 9.5 min (the timeouts: 220 s + 2 x 150 s).
source .carry/next/setup.sh
TEST=0 BENCH=0 NCU=1 NCU_TIMEOUT=220 NCU_ARGS="--configs v3 --tokens 8192" \
  SANITIZER=1 SANITIZER_NUMERICS=fast SANITIZER_TIERS=128 SANITIZER_SMS=8 SANITIZER_TIMEOUT=150 \
  MEGAMOE_CACHE_DIR=/tmp/cache_main WHEELS=.whl_cutlass bash tools/gpu_check.sh
ls -la $OUT
