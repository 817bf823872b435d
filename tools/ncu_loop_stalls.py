"""Where a main loop's warps stall, from the per-SASS-instruction warp-stall samples of
tools/gpu_check.sh NCU=1 (ncu_source.csv.gz: one section per profiled launch; phase_times.py
--profile launches the kernel once per phase prefix, so launch k covers phases 0..k: 1 pull, 2 L1, 3 L2, 4 combine).

Usage: python3 tools/ncu_loop_stalls.py ncu_source.csv.gz [--launch K] [--minus J] [--top N]
  --launch K  the launch to read (default: the last);
  --minus J   subtract launch J's samples instruction by instruction (launch 2 minus 1 = the L1 phase);
  --top N     list the N instructions with the most samples in each loop (default 12).

A loop runs from a backward branch's target to the branch (one executed at least 100000 times:
the k-block loops of a GEMM phase); the one with the most samples is printed first. Samples no
named stall reason accounts for are shown as "other" (on SM90 mostly the WGMMA pipeline's
back-pressure at a warpgroup's first WGMMA of a batch).
"""
import argparse
import collections
import csv
import gzip
import io


def launches(path):
    text = gzip.open(path, "rt").read()
    for part in text.split('"Kernel Name"')[1:]:
        rows = list(csv.reader(io.StringIO('"Kernel Name"' + part)))
        header = rows[1]
        yield header, [r for r in rows[2:] if len(r) == len(header)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--launch", type=int, default=-1)
    ap.add_argument("--minus", type=int, default=None)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    all_launches = list(launches(args.csv))
    header, rows = all_launches[args.launch]
    stall_cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    sample_col, executed_col = header.index("Warp Stall Sampling (All Samples)"), header.index("Instructions Executed")

    def counts(row):
        return [int(row[sample_col])] + [int(row[i]) for i in stall_cols]

    per_instr = [counts(r) for r in rows]
    if args.minus is not None:
        _, base = all_launches[args.minus]
        per_instr = [[a - b for a, b in zip(c, counts(r))] for c, r in zip(per_instr, base)]
    total = sum(c[0] for c in per_instr)
    print(f"launch {args.launch}" + (f" minus {args.minus}" if args.minus is not None else "") + f": {total} samples")

    # Loops: a backward branch executed at least 100000 times, from its target to itself (the
    # k-block loops of a GEMM phase); a loop inside a larger one is dropped.
    address = {int(r[0], 16): i for i, r in enumerate(rows)}
    loops = []
    for i, r in enumerate(rows):
        text = r[1].split()
        if "BRA" in r[1] and text[-1].startswith("0x") and int(r[executed_col] or 0) >= 100000:
            target = address.get(int(text[-1], 16))
            if target is not None and target < i:
                loops.append((target, i + 1))
    loops = [l for l in loops if not any(o != l and o[0] <= l[0] and l[1] <= o[1] for o in loops)]
    loops.sort(key=lambda lo_hi: -sum(per_instr[j][0] for j in range(*lo_hi)))
    for lo, hi in loops:
        samples = sum(per_instr[j][0] for j in range(lo, hi))
        if samples < 0.02 * total:
            continue
        by_reason = collections.Counter()
        for j in range(lo, hi):
            named = 0
            for k, col in enumerate(stall_cols):
                by_reason[header[col][len("stall_"):]] += per_instr[j][k + 1]
                named += per_instr[j][k + 1]
            by_reason["other"] += per_instr[j][0] - named
        body = [rows[j][1].strip() for j in range(lo, hi)]
        print(f"\nloop {rows[lo][0]}..{rows[hi - 1][0]}: {hi - lo} instructions "
              f"({sum('GMMA' in t for t in body)} WGMMA, {sum(t.startswith('FFMA') for t in body)} FFMA, "
              f"{sum('R2UR' in t for t in body)} R2UR), executed {rows[lo][executed_col]} times, "
              f"{samples} samples ({100 * samples / total:.1f}% of the launch)")
        for reason, n in by_reason.most_common():
            if n:
                print(f"  {reason:18s} {n:7d} {100 * n / samples:5.1f}%")
        print("  top instructions:")
        for j in sorted(range(lo, hi), key=lambda j: -per_instr[j][0])[: args.top]:
            reasons = sorted(((per_instr[j][k + 1], header[c][len("stall_"):]) for k, c in enumerate(stall_cols)),
                             reverse=True)[:2]
            print(f"    +{j - lo:3d} {per_instr[j][0]:6d}  {rows[j][1].strip()[:64]:64s} "
                  + ", ".join(f"{r} {n}" for n, r in reasons if n))


if __name__ == "__main__":
    main()
