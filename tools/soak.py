"""Soak: many calls on one buffer, as a server makes them (serving for days).

Random token counts from 0 to the buffer's maximum on every call, no host sync between
calls; every --check-every-th call is checked against docs/design.md section 2 for its numerics
mode (testing.check_outputs, NaN-poisoned output), on fresh inputs. Prints progress, the
calls per second of the unchecked stretches, and every failed check (it goes on after one, so
a rare tolerance miss is counted, not hidden); exits non-zero if any check failed.

    python3 tools/soak.py [--calls 100000] [--check-every 100] [--numerics fast,exact]
"""
import argparse
import math
import sys
import time

import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import fill_buffer, output_errors, random_inputs, random_layer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="total kernel calls on the one buffer")
    parser.add_argument("--check-every", type=int, default=100, help="check every N-th call against the reference")
    parser.add_argument("--numerics", default="fast,exact", help="modes, cycled per checked stretch")
    parser.add_argument("--shape", default="2048,768,8,16,256",
                        help="hidden,intermediate,topk,local experts,max tokens")
    args = parser.parse_args()
    hidden, inter, topk, experts, max_tokens = (int(v) for v in args.shape.split(","))
    modes = args.numerics.split(",")
    gen = torch.Generator(device="cuda").manual_seed(2026)
    layer = random_layer(experts, hidden, inter, "cuda", gen)
    buf = mm.get_symm_buffer(None, experts, max_tokens, topk, hidden, inter)
    mm.ops.warmup(buf, layer.l1, layer.l2, range(max_tokens + 1), numerics=modes[0])
    for mode in modes[1:]:
        mm.ops.warmup(buf, layer.l1, layer.l2, range(max_tokens + 1), numerics=mode)
    y_all = torch.empty(max_tokens, hidden, dtype=torch.bfloat16, device="cuda")
    # Token counts drawn up front on the host: the loop itself does nothing but launch.
    counts = torch.randint(0, max_tokens + 1, (args.calls,), generator=torch.Generator().manual_seed(7)).tolist()
    checked = unchecked_calls = 0
    failures = []
    unchecked_seconds = 0.0
    start = time.monotonic()
    call = 0
    while call < args.calls:
        mode = modes[(call // args.check_every) % len(modes)]
        n = counts[call]
        inputs = random_inputs(n, hidden, experts, topk, ("uniform", "masked", "half_empty")[checked % 3], "cuda", gen)
        fill_buffer(buf, inputs)
        y = y_all[:n]
        y.fill_(math.nan)
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics=mode)
        mm.ops.synchronize()
        error = output_errors([y], [inputs], [layer], experts, mode)[0]
        if error is not None:
            failures.append(f"call {call} (n={n}, {mode}): {error}")
            print(f"soak: FAILED {failures[-1]}", flush=True)
        checked += 1
        stretch = min(args.check_every - 1, args.calls - call - 1)
        t0 = time.monotonic()
        for i in range(stretch):  # the buffer still holds the max-token inputs' first n rows
            m = counts[call + 1 + i]
            mm.fp8_mega_moe(y_all[:m], layer.l1, layer.l2, buf, numerics=mode)
        torch.cuda.synchronize()
        unchecked_seconds += time.monotonic() - t0
        unchecked_calls += stretch
        call += stretch + 1
        if checked % 50 == 0 or call >= args.calls:
            print(f"soak: {call}/{args.calls} calls, {checked} checked, {len(failures)} failed, "
                  f"{unchecked_calls / max(unchecked_seconds, 1e-9):.0f} calls/s unchecked, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
    if not torch.isfinite(y_all[:counts[-1]].float()).all():
        failures.append("the last (unchecked) call left NaN or Inf")
    print(f"soak: {'PASS' if not failures else 'FAIL'} {args.calls} calls on one buffer ({checked} checked against "
          f"the reference, {len(failures)} failed), shape H{hidden} I{inter} K{topk} E{experts} N{max_tokens}, "
          f"modes {modes}")
    for failure in failures:
        print(f"soak: failure: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
