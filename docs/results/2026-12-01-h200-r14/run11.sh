#!/usr/bin/env bash
# NCU retry: run9's v3 n=8192 L1-phase launch died (LaunchFailed after "taking more time than
# expected") -- the kernel's own 30 s wait timeout firing under SourceCounters' instrumented replay.
# MEGAMOE_TIMEOUT_S=400, fewer sections.
source .carry/next/setup.sh
export MEGAMOE_CACHE_DIR=/tmp/cache_main MEGAMOE_TIMEOUT_S=400
timeout 500 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
  --section SourceCounters -o $OUT/profile python3 tools/phase_times.py --configs v3 --tokens 8192 --iters 1 --profile > $OUT/ncu.log 2>&1
echo "ncu rc $?"; tail -8 $OUT/ncu.log
ncu --import $OUT/profile.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
ncu --import $OUT/profile.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/ncu_source.csv.gz
grep -E "Duration|Compute \(SM\)|Stall|Warp Cycles" $OUT/ncu_details.txt | head -40
stamp ncu
