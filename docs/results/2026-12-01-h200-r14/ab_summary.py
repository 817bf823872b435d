"""Median call time per (config, tokens, tree) over the interleaved A/B rounds of call2/ab.txt
(rounds 1-2) and call3/ab.txt (rounds 3-5), and each experiment's change against main's median.
Run: python3 ab_summary.py > ab_summary.txt"""
import collections
import pathlib
import statistics

here = pathlib.Path(__file__).parent
times = collections.defaultdict(list)
for log in ("call2/ab.txt", "call3/ab.txt"):
    for line in (here / log).read_text().splitlines():
        f = line.split()
        if len(f) > 4 and f[1] in ("v3", "v4flash") and f[3].isdigit():
            times[(f[1], int(f[3]), f[0].rstrip("0123456789"))].append(float(f[4]))
print("config  tokens   main us (runs) | change of the median against main's, per experiment tree")
for cfg in ("v3", "v4flash"):
    for tokens in (128, 512, 2048, 8192):
        main = statistics.median(times[(cfg, tokens, "main")])
        row = f"{cfg:8}{tokens:6} {main:8.1f} ({len(times[(cfg, tokens, 'main')])})"
        for tree in ("epi", "l2b", "both"):
            t = times[(cfg, tokens, tree)]
            row += f" | {tree} {statistics.median(t):7.1f} {100 * (statistics.median(t) / main - 1):+5.1f}%"
        print(row + f"   [main {min(times[(cfg, tokens, 'main')]):.0f}-{max(times[(cfg, tokens, 'main')]):.0f},"
              f" both {min(times[(cfg, tokens, 'both')]):.0f}-{max(times[(cfg, tokens, 'both')]):.0f}]")
