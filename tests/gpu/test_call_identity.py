"""Every rank runs the same call, or every rank hears why not (docs/design.md section 3).

The ranks compare each call's identity (layer, numerics, fast_math, refused) at the kernel's
cross-rank barrier. Each case runs R = 2 and 4 ranks as processes on one GPU (ipc_ranks), so
every rank's own report is seen; the last rank is the one that goes astray. Each rank first
runs one good call of layer 0, checked against the reference, then the case:
- a skipped call, an extra call, another layer, another numerics mode, a refused call
  (invalid arguments on one rank): every rank stops at that call with an error that names the
  other rank and what differed, long before the wait bound; no rank completes it;
- a rank that never calls: every other rank's timeout names it;
- a rank that stops right after the barrier: the others' later waits time out, named;
- a rank with expert ids outside [-1, E): every rank's call completes and is right (the bad
  slots dropped), and that rank raises a ValueError after its call has taken part, so the next
  calls of every rank stay paired.
Ranks whose calls select different kernel variants (tiers, depths) compute their calls right:
test_ranks_on_different_tiers (side by side in one process).
"""
import faulthandler
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.heuristics import implemented_block_m
from megamoe_plugin.testing import fill_buffer, output_errors, reference_slot_outputs, worst_slots

from .ipc_ranks import ipc_rank_buffer, leave, run_ipc_ranks
from .multi_rank import MULTI_RANK_SHAPES, launch_side_by_side, make_world, step_inputs

BOUND_S = 3.0  # MEGAMOE_TIMEOUT_S
SHAPE = MULTI_RANK_SHAPES[1]
TOKENS = SHAPE[4]  # every call's config_num_tokens: one variant per numerics mode
RANK_DEADLINE_S = 45  # a rank process's whole run
MISMATCH = "stopped at the cross-rank barrier's call check"


def _call(buf, layer, inputs, numerics="fast", **kwargs):
    fill_buffer(buf, inputs)
    y = torch.full((inputs["x"].shape[0], buf.hidden), math.nan, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, config_num_tokens=TOKENS, numerics=numerics, **kwargs)
    return y


def _rank_main(rank, num_ranks, init_file, queues, results, case):
    """One rank of `case`; puts (rank, outcome): {"good": the first call's check, "raised": the
    ValueError the astray rank's call raised, "error": what synchronize raised, "seconds": how long
    the case's call took to fail or end, "checks": the outputs' checks where the calls complete}."""
    import torch.distributed as dist

    # A rank that hangs prints where and exits, failing the test, instead of holding it until its timeout.
    faulthandler.dump_traceback_later(RANK_DEADLINE_S, exit=True)
    os.environ["MEGAMOE_TIMEOUT_S"] = str(BOUND_S)
    buf, storages = ipc_rank_buffer(rank, num_ranks, init_file, queues, SHAPE)
    num_experts = SHAPE[3] * num_ranks
    worlds = [make_world(num_ranks, SHAPE, "cuda", seed) for seed in (11, 12)]  # layers 0 and 1
    layers = [world[0] for world in worlds]
    gen = worlds[0][1]
    numerics_modes = ("fast", "exact") if case == "numerics" else ("fast",)
    for numerics in numerics_modes:
        mm.ops.warmup(buf, layers[0][rank].l1, layers[0][rank].l2, [TOKENS], numerics=numerics,
                      other_layers=[(layers[1][rank].l1, layers[1][rank].l2)])
    astray = rank == num_ranks - 1
    outcome = {}

    inputs = step_inputs(num_ranks, SHAPE, TOKENS, 0, "uniform", "cuda", gen)
    y = _call(buf, layers[0][rank], inputs[rank])
    mm.ops.synchronize()
    outcome["good"] = _own_error(y, rank, inputs, layers[0], num_experts)
    dist.barrier()

    inputs = step_inputs(num_ranks, SHAPE, TOKENS, 1, "uniform", "cuda", gen)
    start = time.monotonic()
    try:
        if case == "skip":  # the astray rank skips layer 0's call and makes layer 1's
            _call(buf, layers[1 if astray else 0][rank], inputs[rank])
        elif case == "extra":  # the astray rank makes layer 0's call again where the others go on to layer 1
            _call(buf, layers[0 if astray else 1][rank], inputs[rank])
        elif case == "layer":
            _call(buf, layers[1 if astray else 0][rank], inputs[rank])
        elif case == "numerics":
            _call(buf, layers[0][rank], inputs[rank], numerics="exact" if astray else "fast")
        elif case == "refused":
            if astray:  # y of the wrong dtype
                y = torch.empty(inputs[rank]["x"].shape[0], buf.hidden, dtype=torch.float32, device="cuda")
                try:
                    mm.fp8_mega_moe(y, layers[0][rank].l1, layers[0][rank].l2, buf, config_num_tokens=TOKENS)
                except ValueError as exc:
                    outcome["raised"] = str(exc)
            else:
                _call(buf, layers[0][rank], inputs[rank])
        elif case == "missing":
            if not astray:
                _call(buf, layers[0][rank], inputs[rank])
        elif case == "stopped":
            _call(buf, layers[0][rank], inputs[rank], _stop_after_phase=2 if astray else 0)
        elif case == "bad_ids":
            if astray:
                inputs[rank]["topk_idx"][0, 0] = num_experts + 3
            ys = [_call(buf, layers[0][rank], inputs[rank])]
            torch.cuda.synchronize()  # the kernel has counted the bad id: the next call raises after its launch
            dist.barrier()
            next_inputs = step_inputs(num_ranks, SHAPE, TOKENS, 2, "uniform", "cuda", gen)
            try:
                ys.append(_call(buf, layers[0][rank], next_inputs[rank]))
            except ValueError as exc:
                outcome["raised"] = str(exc)
                ys.append(None)
            mm.ops.synchronize()
            inputs[rank]["topk_idx"][inputs[rank]["topk_idx"] >= num_experts] = -1  # as the kernel drops it
            outcome["checks"] = [_own_error(ys[0], rank, inputs, layers[0], num_experts)]
            if ys[1] is not None:
                outcome["checks"].append(_own_error(ys[1], rank, next_inputs, layers[0], num_experts))
        mm.ops.synchronize()
    except RuntimeError as exc:
        outcome["error"] = str(exc)
    outcome["seconds"] = time.monotonic() - start
    print(f"rank {rank}: {case} ended after {outcome['seconds']:.2f} s", file=sys.stderr, flush=True)
    results.put((rank, outcome))
    leave()


def _own_error(y, rank, inputs, layers, num_experts):
    """This rank's output against the reference (the peers' rows are the reference's own)."""
    from megamoe_plugin.testing import reference_outputs

    refs = reference_outputs(inputs, layers, num_experts)
    return output_errors(refs[:rank] + [y] + refs[rank + 1:], inputs, layers, num_experts, "fast")[rank]


def _run(case, num_ranks, tmp_path):
    by_rank = run_ipc_ranks(_rank_main, num_ranks, tmp_path, case)
    assert sorted(by_rank) == list(range(num_ranks))
    for rank, outcome in sorted(by_rank.items()):
        print(f"\n  R={num_ranks} {case} rank {rank}: {outcome}", end="")
        assert outcome["good"] is None, f"rank {rank}'s first call: {outcome['good']}"
    return by_rank


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("case, differs", [("skip", "the layer"), ("extra", "the layer"), ("layer", "the layer"),
                                           ("numerics", "the numerics mode"), ("refused", "a refused call")])
def test_calls_that_differ_stop_every_rank_by_name(case, differs, num_ranks, tmp_path):
    by_rank = _run(case, num_ranks, tmp_path)
    astray = num_ranks - 1
    for rank, outcome in by_rank.items():
        error = outcome.get("error")
        assert error is not None, f"rank {rank} completed a call its peers did not make"
        assert MISMATCH in error and f"; rank {rank}, kernel " in error, error
        assert f"differ in {differs}" in error, error
        # A rank in step names the astray one; the astray rank names one of the others.
        other = int(re.search(r"; rank (\d+) made ", error).group(1))
        assert other == astray if rank != astray else other != astray, error
        assert outcome["seconds"] < BOUND_S, f"rank {rank} took {outcome['seconds']:.1f} s: it waited for a timeout"
    if case == "refused":
        assert "y must be torch.bfloat16" in by_rank[astray]["raised"]
        assert f"rank {astray} made a refused call" in by_rank[0]["error"]


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("case, waited_for", [
    ("missing", "the cross-rank barrier: rank {astray} never arrived"),  # a rank that never calls
    ("stopped", "the (rows of a token to combine|L1 rows|pulled rows)"),  # one that stops after the barrier
])
def test_a_rank_that_leaves_a_call_undone_is_named_by_the_others(case, waited_for, num_ranks, tmp_path):
    by_rank = _run(case, num_ranks, tmp_path)
    astray = num_ranks - 1
    for rank in range(astray):
        error = by_rank[rank].get("error") or ""
        assert re.search("timed out waiting on " + waited_for.format(astray=astray), error), error
    assert "error" not in by_rank[astray]


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_bad_expert_ids_on_one_rank_raise_after_the_call_took_part(num_ranks, tmp_path):
    by_rank = _run("bad_ids", num_ranks, tmp_path)
    astray = num_ranks - 1
    for rank, outcome in by_rank.items():
        assert "error" not in outcome, outcome
        assert outcome["checks"] == [None] * len(outcome["checks"]), outcome["checks"]
    assert "1 topk_idx entry outside [-1, num_experts)" in by_rank[astray]["raised"]
    assert len(by_rank[astray]["checks"]) == 1  # its second call raised after taking part: its y is not judged
    for rank in range(astray):
        assert "raised" not in by_rank[rank] and len(by_rank[rank]["checks"]) == 2


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_ranks_on_different_tiers(num_ranks, numerics):
    """Each rank picks its variant by its own token count (no common config_num_tokens): every mix
    of tiers computes the call right, so the tier is no part of the call's identity."""
    hidden, inter, topk, local_experts, max_tokens, _ = SHAPE
    layers, gen = make_world(num_ranks, SHAPE, "cuda", 21)
    bufs = mm.buffer.get_local_rank_buffers(num_ranks, local_experts * num_ranks, max_tokens, topk, hidden, inter)
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    by_tier = {}  # tier -> the first token count that selects it
    for tokens in range(1, 257):
        by_tier.setdefault(mm.ops.select_variant(bufs[0], tokens, True, numerics).block_m, tokens)
    assert sorted(by_tier) == sorted(implemented_block_m(numerics)), by_tier
    tiers = sorted(by_tier)
    # Every variant loaded before the first call: a module load waits for the kernels running in the
    # context, among them a rank's call that waits for a peer whose launch is behind that load.
    for buf, layer in zip(bufs, layers):
        mm.ops.warmup(buf, layer.l1, layer.l2, list(by_tier.values()), numerics=numerics)
    mixes = ([(a, b) for a in tiers for b in tiers if a != b] if num_ranks == 2
             else [tuple(tiers[(i + r) % len(tiers)] for r in range(num_ranks)) for i in range(len(tiers))])
    failures = []
    for step, mix in enumerate(mixes):
        inputs = step_inputs(num_ranks, SHAPE, max_tokens, step, ("uniform", "masked", "one_expert")[step % 3], "cuda",
                             gen)
        ys = launch_side_by_side(bufs, layers, inputs, streams, [by_tier[t] for t in mix], numerics)
        errors = output_errors(ys, inputs, layers, local_experts * num_ranks, numerics)
        print(f"\n  R={num_ranks} {numerics} tiers {mix}: {errors}", end="")
        if any(errors):  # which (token, slot) rows of the combine buffers differ from the reference's
            slots = reference_slot_outputs(inputs, layers, local_experts * num_ranks)
            errors = [e if e is None else f"{e}; worst slots: " + "; ".join(worst_slots(
                bufs[r].view("combine")[:inputs[r]["x"].shape[0]], slots[r], inputs[r]["topk_idx"]))
                for r, e in enumerate(errors)]
        failures += [f"tiers {mix} rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    assert not failures, "\n".join(failures)


SIDE_BY_SIDE = textwrap.dedent("""
    import math, sys, time
    import torch, megamoe_plugin as mm
    from tests.gpu.multi_rank import MULTI_RANK_SHAPES, launch_side_by_side, make_world, step_inputs
    from megamoe_plugin.testing import output_errors
    num_ranks, case = int(sys.argv[1]), sys.argv[2]
    shape = MULTI_RANK_SHAPES[1]
    hidden, inter, topk, local_experts, max_tokens, _ = shape
    layers = [make_world(num_ranks, shape, "cuda", seed)[0] for seed in (11, 12)]
    gen = torch.Generator(device="cuda").manual_seed(3)
    bufs = mm.buffer.get_local_rank_buffers(num_ranks, local_experts * num_ranks, max_tokens, topk, hidden, inter)
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    for buf, rank in zip(bufs, range(num_ranks)):
        for numerics in ("fast", "exact"):
            mm.ops.warmup(buf, layers[0][rank].l1, layers[0][rank].l2, [max_tokens], numerics=numerics,
                          other_layers=[(layers[1][rank].l1, layers[1][rank].l2)])
    inputs = step_inputs(num_ranks, shape, max_tokens, 0, "uniform", "cuda", gen)
    ys = launch_side_by_side(bufs, layers[0], inputs, streams, max_tokens, "fast")
    assert output_errors(ys, inputs, layers[0], local_experts * num_ranks, "fast") == [None] * num_ranks
    print("first call right", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    start = time.monotonic()
    for rank, (buf, stream) in enumerate(zip(bufs, streams)):
        astray = rank == num_ranks - 1
        layer = layers[1 if astray and case == "layer" else 0][rank]
        y = torch.empty(max_tokens, hidden, dtype=torch.float32 if astray and case == "refused" else torch.bfloat16,
                        device="cuda")
        with torch.cuda.stream(stream):
            try:
                mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, config_num_tokens=max_tokens,
                                numerics="exact" if astray and case == "numerics" else "fast")
            except ValueError as exc:
                print("raised:", exc, file=sys.stderr, flush=True)
    try:
        mm.ops.synchronize()
        print("completed", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print(f"after {time.monotonic() - start:.2f} s: {exc}", file=sys.stderr, flush=True)
""")


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("case, differs", [("layer", "the layer"), ("numerics", "the numerics mode"),
                                           ("refused", "a refused call")])
def test_side_by_side_calls_that_differ_stop_by_name(case, differs, num_ranks):
    """The same check with the ranks side by side in one process, where one report (the first
    rank's to fail) stands for all: it names two ranks and what differed, soon."""
    proc = subprocess.run([sys.executable, "-c", SIDE_BY_SIDE, str(num_ranks), case], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, MEGAMOE_TIMEOUT_S=str(BOUND_S)),
                          cwd=str(Path(__file__).resolve().parents[2]))
    print(proc.stderr[-1500:])
    assert "first call right" in proc.stderr and "completed" not in proc.stderr
    match = re.search(r"after ([0-9.]+) s: megamoe kernel stopped at the cross-rank barrier's call check; rank (\d), "
                      r".*differ in " + differs + r": (rank \d|another rank) .*made .*; rank (\d) made ", proc.stderr)
    assert match, proc.stderr[-1500:]
    assert float(match.group(1)) < BOUND_S
    # The astray rank is one of the two named; where the ranks' shared report mixes two ranks' stores,
    # the unnamed one ("another rank").
    reporter, peer = match.group(3), match.group(4)
    assert reporter in (f"rank {num_ranks - 1}", "another rank") or peer == str(num_ranks - 1)
    if case == "refused":
        assert "raised: y must be torch.bfloat16" in proc.stderr
