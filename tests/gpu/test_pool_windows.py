"""Pool windows (issue 14, bounded memory): pools that hold fewer rows than a call's routing needs
(buffer.BufferShape.pool_rows, windowed) run the call's m-blocks in windows, the first in the fused
kernel and the rest in the window kernel (csrc/megamoe/kernel.cuh mega_moe_windows).

- One rank, every tier of both modes, forced with MEGAMOE_BLOCK_M, on 128-row pools: the call
  sequence of test_forced_tiers (token counts max, 1, 0, odd; every routing, one_expert filling the
  pool many times over; clamp, fast_math; recv stats counted once) against the reference, then the
  same inputs on default pools: bit for bit the same rows, since a window moves rows, not tiles.
- R = 2, 4 and 8 ranks side by side on one GPU with 128-row pools, both modes: skewed routings
  (every token to one expert, half the experts empty), ranks with 0 tokens and with different
  counts; against the reference and bit for bit against the ranks on unwindowed pools.
- CUDA graph replay of a windowed call (the window kernel is a node of the graph); 1000 calls in a
  row at R = 2, 4 and 8 with random per-rank token counts and routings, each bit for bit its first
  result.
- Exact mode's EP-width invariance: a token's row at R ranks is bit for bit its row on one rank
  that holds all R ranks' experts."""
import math
import random

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.testing import (ROUTINGS, Layer, check_outputs, fill_buffer, output_errors, random_inputs,
                                    random_layer)
from megamoe_plugin.timing import graphed

from .cases import FORCED_TIERS, WINDOW_POOL_ROWS, WINDOW_RANK_SHAPE, WINDOW_SHAPES
from .multi_rank import launch_side_by_side
from .single_gpu import SeedStream, check_call_sequence, run

_seeds = SeedStream(97531)


@pytest.fixture(scope="module", params=WINDOW_SHAPES, ids=str)
def setup(request):
    s = request.param
    torch.cuda.empty_cache()
    layer = random_layer(s.local_experts, s.hidden, s.intermediate, "cuda", _seeds.next_generator())
    whole = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate)
    windowed = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate,
                                  pool_rows=WINDOW_POOL_ROWS)
    assert windowed.shape.windowed and not whole.shape.windowed
    assert windowed.layout.total_bytes < whole.layout.total_bytes
    return s, layer, whole, windowed


@pytest.mark.parametrize("numerics, block_m", FORCED_TIERS)
def test_windows_on_one_rank(setup, numerics, block_m, monkeypatch):
    s, layer, whole, windowed = setup
    monkeypatch.setenv("MEGAMOE_BLOCK_M", str(block_m))
    variant = mm.ops.select_variant(windowed, s.max_tokens, True, numerics)
    assert variant.block_m == block_m and variant.windowed
    check_call_sequence(s, layer, windowed, _seeds, numerics, label=f" BLOCK_M {block_m}, {WINDOW_POOL_ROWS}-row pools")
    for n, routing in ((s.max_tokens, "one_expert"), (s.max_tokens | 1, "uniform"), (s.max_tokens // 3, "half_empty")):
        n = min(n, s.max_tokens)
        inputs = random_inputs(n, s.hidden, s.local_experts, s.topk, routing, "cuda", _seeds.next_generator())
        y_windowed, y_whole = run(windowed, layer, inputs, numerics)[0], run(whole, layer, inputs, numerics)[0]
        assert torch.equal(y_windowed.view(torch.int16), y_whole.view(torch.int16)), (
            f"n={n} {routing}: the windowed pools' rows differ from the whole pool's")


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
def test_windowed_call_in_a_cuda_graph(setup, numerics):
    s, layer, _, windowed = setup
    n = s.max_tokens
    y = torch.empty(n, s.hidden, dtype=torch.bfloat16, device="cuda")
    first = random_inputs(n, s.hidden, s.local_experts, s.topk, "uniform", "cuda", _seeds.next_generator())
    fill_buffer(windowed, first)
    replay = graphed(lambda: mm.fp8_mega_moe(y, layer.l1, layer.l2, windowed, numerics=numerics))
    for routing in ("one_expert", "uniform", "one_expert"):
        inputs = random_inputs(n, s.hidden, s.local_experts, s.topk, routing, "cuda", _seeds.next_generator())
        fill_buffer(windowed, inputs)
        y.fill_(math.nan)
        replay()
        mm.ops.synchronize()
        check_outputs([y], [inputs], [layer], s.local_experts, numerics)


def _ranks(num_ranks, pool_rows):
    """WINDOW_RANK_SHAPE's buffers for R ranks side by side on one GPU, with pool_rows-row pools (None:
    the default)."""
    hidden, inter, topk, local_experts, max_tokens = WINDOW_RANK_SHAPE
    return mm.buffer.get_local_rank_buffers(num_ranks, local_experts * num_ranks, max_tokens, topk, hidden, inter,
                                            pool_rows=pool_rows)


def _rank_world(num_ranks, pool_rows):
    """The test's generator (the module's next seed), a random layer per rank drawn from it, _ranks's
    buffers and a stream per rank."""
    hidden, inter, topk, local_experts, max_tokens = WINDOW_RANK_SHAPE
    gen = _seeds.next_generator()
    layers = [random_layer(local_experts, hidden, inter, "cuda", gen) for _ in range(num_ranks)]
    return gen, layers, _ranks(num_ranks, pool_rows), [torch.cuda.Stream() for _ in range(num_ranks)]


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_windowed_ranks_side_by_side(num_ranks, numerics):
    hidden, inter, topk, local_experts, max_tokens = WINDOW_RANK_SHAPE
    gen, layers, windowed, streams = _rank_world(num_ranks, WINDOW_POOL_ROWS)
    whole = _ranks(num_ranks, windowed[0].shape.max_pool_rows)
    assert windowed[0].shape.windowed and not whole[0].shape.windowed
    num_experts = local_experts * num_ranks
    steps = [(max_tokens, "one_expert"), (max_tokens, "uniform"), (max_tokens // 2 + 1, "half_empty"),
             (0, "uniform"), (max_tokens, "masked"), (1, "one_expert")]
    failures = []
    for step, (tokens, routing) in enumerate(steps):
        # Rank r has a different count from its neighbours; rank 1 has none in odd steps.
        counts = [0 if (r == 1 and step % 2) else max(0, tokens - 3 * r) for r in range(num_ranks)]
        inputs = [random_inputs(n, hidden, num_experts, topk, routing, "cuda", gen) for n in counts]
        ys = launch_side_by_side(windowed, layers, inputs, streams, tokens, numerics)
        ys_whole = launch_side_by_side(whole, layers, inputs, streams, tokens, numerics)
        errors = output_errors(ys, inputs, layers, num_experts, numerics)
        for r in range(num_ranks):
            print(f"\n  R={num_ranks} {numerics} step {step} {routing} rank {r} n={counts[r]}: "
                  f"{'ok' if errors[r] is None else errors[r]}", end="")
            if errors[r] is not None:
                failures.append(f"step {step} rank {r}: {errors[r]}")
            elif not torch.equal(ys[r].view(torch.int16), ys_whole[r].view(torch.int16)):
                failures.append(f"step {step} rank {r}: rows differ from the unwindowed pools'")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_windowed_ranks_a_thousand_calls(num_ranks, numerics):
    """R ranks on 128-row pools, 1000 calls in a row, each with random per-rank token counts and
    routing drawn from 24 input sets (each judged against the reference once): every call's rows are
    bit for bit the first call's of its set. Leftover state (the window flag, the counters, the L2
    claim counter) or a race would show as a wrong or moving row, or as a hang."""
    hidden, inter, topk, local_experts, max_tokens = WINDOW_RANK_SHAPE
    gen, layers, bufs, streams = _rank_world(num_ranks, WINDOW_POOL_ROWS)
    num_experts = local_experts * num_ranks
    pick = random.Random(2024)
    sets = []
    for i in range(24):
        counts = [pick.choice([0, 1, pick.randrange(max_tokens + 1), max_tokens]) for _ in range(num_ranks)]
        inputs = [random_inputs(n, hidden, num_experts, topk, ROUTINGS[i % len(ROUTINGS)], "cuda", gen) for n in counts]
        sets.append((inputs, max(counts)))
    first = {}
    mismatches = []
    for call in range(1000):
        i = call % len(sets) if call < len(sets) else pick.randrange(len(sets))
        inputs, tokens = sets[i]
        ys = launch_side_by_side(bufs, layers, inputs, streams, tokens, numerics)
        if i not in first:
            errors = output_errors(ys, inputs, layers, num_experts, numerics)
            assert all(e is None for e in errors), f"set {i}: {errors}"
            first[i] = ys
        elif not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(ys, first[i])):
            mismatches.append(call)
    assert not mismatches, f"{len(mismatches)} of 1000 calls differ from their set's first call: {mismatches[:10]}"


def _one_rank_layer(layers) -> Layer:
    """The experts of every rank's layer, in rank order, as one rank's layer."""
    def cat(pairs):
        return tuple(torch.cat([pair[i] for pair in pairs]) for i in range(2))

    checkpoint = {k: torch.cat([layer.checkpoint[k] for layer in layers]) for k in layers[0].checkpoint}
    return Layer(checkpoint, cat([layer.l1 for layer in layers]), cat([layer.l2 for layer in layers]))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_exact_rows_do_not_depend_on_the_ep_width(num_ranks):
    hidden, inter, topk, local_experts, max_tokens = WINDOW_RANK_SHAPE
    gen, layers, bufs, streams = _rank_world(num_ranks, None)
    one_rank = mm.get_symm_buffer(None, local_experts * num_ranks, max_tokens, topk, hidden, inter)
    all_experts = _one_rank_layer(layers)
    num_experts = local_experts * num_ranks
    for routing in ("uniform", "masked", "one_expert"):
        counts = [max_tokens - 5 * r for r in range(num_ranks)]
        inputs = [random_inputs(n, hidden, num_experts, topk, routing, "cuda", gen) for n in counts]
        ys = launch_side_by_side(bufs, layers, inputs, streams, max_tokens, "exact")
        for r in range(num_ranks):
            alone = run(one_rank, all_experts, inputs[r], "exact")[0]
            assert torch.equal(ys[r].view(torch.int16), alone.view(torch.int16)), (
                f"{routing}: rank {r}'s rows at R={num_ranks} differ from the same tokens on one rank")


@pytest.mark.parametrize("name, bound_gib", [("v4flash", 1.0), ("v3", 2.0)])
def test_ep8_buffers_allocate_within_the_bound(name, bound_gib):
    """Issue 14's memory bound by a real allocation: eight ranks' buffers for 8192 tokens per rank at
    EP8 (256 experts) take at most bound_gib each on the device, as get_symm_buffer_size says."""
    from megamoe_plugin.configs import REFERENCE_SHAPES

    ref = REFERENCE_SHAPES[name]
    args = (8, 256, 8192, ref.num_topk, ref.hidden, ref.intermediate_size)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    bufs = mm.buffer.get_local_rank_buffers(*args)
    allocated = torch.cuda.memory_allocated() - before
    size = mm.get_symm_buffer_size(*args)
    assert all(b.storage.numel() == size for b in bufs) and bufs[0].shape.windowed
    assert size <= bound_gib * 2 ** 30 and allocated <= 8 * (size + 2 ** 21), (size, allocated)
    del bufs
