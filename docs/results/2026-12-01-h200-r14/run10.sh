#!/usr/bin/env bash
# Extra call: the microbenchmarks line-buffered (run7's were killed by timeout 60 with nothing printed),
# then three more interleaved A/B rounds of every tree (run8's two rounds scattered by +-5%).
source .carry/next/setup.sh
for b in mainloop mainloop_l2b; do timeout 30 stdbuf -oL -eL $N/$b 2 > $OUT/$b.txt 2>&1; echo "== $b rc $?"; cat $OUT/$b.txt; done
stamp microbench
AB="--configs v3,v4flash --tokens 2048,8192 --numerics fast --baseline none"
for i in 3 4 5; do for tree in $TREES main; do
  in_tree $tree timeout 60 python3 -m megamoe_plugin.bench $AB --results $OUT/ab_${tree}_$i 2>>$OUT/ab_stderr.log \
    | sed "s/^/$tree$i /" | tee -a $OUT/ab.txt | grep -E " (v3|v4flash) "
done; done
stamp ab
cd $OUT && tar -czf logs.tgz *.txt *.log ab_* && ls
