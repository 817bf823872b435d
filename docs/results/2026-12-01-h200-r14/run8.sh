#!/usr/bin/env bash
# Next hold, call 2 of 3: where the tiles' time goes in each tree, then the calls, interleaved
# (the experiments, then main) twice, fast numerics. About 8 min with the three experiment trees.
source .carry/next/setup.sh
for tree in $TREES main; do
  in_tree $tree timeout 80 python3 tools/tile_timeline.py --configs v3,v4flash --tokens 2048,8192 2>&1 \
    | sed "s/^/$tree /" | tee -a $OUT/tile_timeline.txt | grep -E "L1:|L2:|call"
done
stamp timeline
AB="--configs v3,v4flash --tokens 128,512,2048,8192 --numerics fast --baseline none"
for i in 1 2; do for tree in $TREES main; do
  in_tree $tree timeout 80 python3 -m megamoe_plugin.bench $AB --results $OUT/ab_${tree}_$i 2>>$OUT/ab_stderr.log \
    | sed "s/^/$tree$i /" | tee -a $OUT/ab.txt | grep -E " (v3|v4flash) "
done; done
stamp ab
cd $OUT && tar -czf logs.tgz *.txt *.log ab_* && ls
