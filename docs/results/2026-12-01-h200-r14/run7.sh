#!/usr/bin/env bash
# Next hold, call 1 of 3 (carry [".whl_cutlass", ".carry/next"]): the main-loop microbenchmark
# (main's and l2b's builds), the experiments' GPU tests, and every tree's outputs digest (equal
# lines: bitwise-equal outputs). About 7 min with the three experiment trees.
source .carry/next/setup.sh
for b in mainloop mainloop_l2b; do timeout 60 $N/$b 8 > $OUT/$b.txt 2>&1; echo "== $b"; cat $OUT/$b.txt; done
stamp microbench
for tree in $TREES; do
  in_tree $tree python3 -c "import megamoe_plugin; print('$tree imports', megamoe_plugin.__file__)"
  in_tree $tree timeout 150 python3 -m pytest -q -x -rs --timeout 120 tests/gpu > $OUT/tests_$tree.log 2>&1
  echo "tests $tree: $(tail -1 $OUT/tests_$tree.log)"
done
stamp tests
for tree in main $TREES; do in_tree $tree timeout 60 python3 $N/outputs_digest.py > $OUT/digest_$tree.txt 2>&1; done
cat $OUT/digest_main.txt
for tree in $TREES; do cmp -s $OUT/digest_main.txt $OUT/digest_$tree.txt && echo "digest $tree: bitwise equal to main" || { echo "digest $tree: DIFFERENT"; diff $OUT/digest_main.txt $OUT/digest_$tree.txt; }; done
stamp digest
cd $OUT && tar -czf logs.tgz *.txt *.log && ls
