"""A/B summary of `python -m megamoe_plugin.bench` runs: the median time of each (config,
numerics, tokens) cell over the rounds of each tree, B's change against A, and the change of B's
fastest round against A's (a cell whose rounds are bimodal moves its median more than its fastest).

    python3 tools/ab_summary.py --a OUT/bench_main_*.txt --b OUT/bench_exp_*.txt [--names main,exp]

A cell that only A measured is printed without a comparison. The device runs' scripts interleave the rounds (A, B, A, B) so
that drift of the clocks falls on both sides.
"""
import argparse
import re
import statistics

# bench's table row: config, numerics, tokens, time_us, ...
ROW = re.compile(r"(\S+)\s+(fast|exact)\s+(\d+)\s+([\d.]+)\s")


def load(paths):
    """{(config, numerics, tokens): [time_us of each round]} from bench's stdout files."""
    runs = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                m = ROW.match(line)
                if m:
                    runs.setdefault((m[1], m[2], int(m[3])), []).append(float(m[4]))
    return runs


def summary(a, b, names=("A", "B")):
    lines = []
    for key in sorted(a):
        ma = statistics.median(a[key])
        line = f"{key[0]:8s} {key[1]:5s} {key[2]:6d}  {names[0]} {ma:8.1f} {a[key]}"
        if key in b:
            mb = statistics.median(b[key])
            line += (f"  {names[1]} {mb:8.1f} {b[key]}  {100 * (mb / ma - 1):+.1f}%"
                     f"  fastest {100 * (min(b[key]) / min(a[key]) - 1):+.1f}%")
        lines.append(line)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="+", required=True, help="tree A's bench outputs, one per round")
    ap.add_argument("--b", nargs="*", default=[], help="tree B's bench outputs, one per round")
    ap.add_argument("--names", default="A,B", help="the two trees' names, comma-separated")
    args = ap.parse_args(argv)
    print("\n".join(summary(load(args.a), load(args.b), tuple(args.names.split(",")))))


if __name__ == "__main__":
    main()
