"""The decode throughput an SGLang server logged: the median, over its "Decode batch" reports with a
given number of running requests, of the report's gen throughput (tokens generated per second over
the decode steps since the previous report, prefills between them included). A steadier measure of
the MoE's decode speed than the serving benchmark's TPOT, which mixes in each request's prefill
waits.

    python3 tools/e2e/decode_steps.py SERVER_LOG [--running N]

N defaults to the most frequent running-request count of the log (the benchmark's concurrency once
the server is full). Prints one line: N, the number of reports, and the median with its quartiles.
Exit 1 if the log has no decode report with N running requests."""
import argparse
import re
import statistics
import sys
from collections import Counter
from typing import Dict, List, Optional, TextIO

REPORT = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([0-9.]+)")


def reports(lines: TextIO) -> Dict[int, List[float]]:
    """{running requests: [gen throughput of each decode report with that many]}."""
    out: Dict[int, List[float]] = {}
    for line in lines:
        m = REPORT.search(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    return out


def summary(by_running: Dict[int, List[float]], running: Optional[int] = None) -> Optional[str]:
    if running is None:
        if not by_running:
            return None
        running = Counter({n: len(v) for n, v in by_running.items()}).most_common(1)[0][0]
    values = sorted(by_running.get(running, []))
    if not values:
        return None
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return (f"decode reports with {running} running requests: {len(values)}, gen throughput median "
            f"{statistics.median(values):.0f} tok/s (quartiles {q[0]:.0f}, {q[2]:.0f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--running", type=int, help="running requests of the reports to take (default: the most frequent)")
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as f:
        line = summary(reports(f), args.running)
    if line is None:
        print(f"{args.log}: no decode report" + (f" with {args.running} running requests" if args.running else ""),
              file=sys.stderr)
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
