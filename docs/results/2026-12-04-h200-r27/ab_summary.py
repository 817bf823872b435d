"""Round 27: run.sh STEP=ab's benchmark files side by side, the base tree (main, or b2b) against this
tree, per cell: each round's time (us), and the change of the medians and of the fastest rounds.

    python ab_summary.py <folder with ab_{main or b2b,new}_N.txt>
"""
import collections
import glob
import statistics
import sys

times = collections.defaultdict(list)  # (tree, config, numerics, tokens) -> us per round
for path in sorted(glob.glob(f"{sys.argv[1]}/ab_*_*.txt")):
    tree = path.rsplit("/", 1)[1].split("_")[1]
    for line in open(path):
        f = line.split()
        if len(f) > 4 and f[0] in ("v3", "v4flash") and f[1] in ("fast", "exact"):
            times[(tree, f[0], f[1], int(f[2]))].append(float(f[3]))
for tree, config, numerics, tokens in sorted(k for k in times if k[0] != "new"):
    base, new = times[(tree, config, numerics, tokens)], times[("new", config, numerics, tokens)]
    median = (statistics.median(new) / statistics.median(base) - 1) * 100
    fastest = (min(new) / min(base) - 1) * 100
    print(f"{config:8s} {numerics:6s} {tokens:5d}  {tree} {' / '.join(f'{t:8.1f}' for t in base)}"
          f"  new {' / '.join(f'{t:8.1f}' for t in new)}  median {median:+5.1f}%  fastest {fastest:+5.1f}%")
