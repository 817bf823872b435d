# call 4: the A/B benchmark (main against pool windows, one GPU), then racecheck of the BLOCK_M 128
# window kernel at three window counts (pool rows 128, 512: several and two windows; 768: one, the
# window kernel idle)
set -u -o pipefail
JITCACHE_TARBALL=.carry/r24/jit_new.tar.xz
source tools/device_env.sh
cp .carry/r24/commit.txt "$OUT/commit.txt"
ROUNDS=3 bash tools/ab_bench.sh .carry/r24/main.tar.gz .carry/r24/jit_main.tar.xz main windows 2>&1 | tail -32
printf '%s\n' "fast racecheck 128 384 256 4 4 64 128" "fast racecheck 128 384 256 4 4 64 512" \
  "fast racecheck 128 384 256 4 4 64 768" "fast racecheck 128 384 256 4 4 16 128" \
  "fast memcheck 128 384 256 4 4 64 512" | SANITIZER_BUDGET=200 bash tools/sanitizer_sweep.sh
cd /tmp/sanitizer && tar -czf $OUT/sanitizer_logs.tar.gz .
