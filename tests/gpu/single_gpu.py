"""What the one-GPU kernel tests share (test_kernel.py, test_forced_tiers.py): seeded
generators, a layer and buffer per shape, a NaN-poisoned timed call, and the sequence
of calls with changing token counts, routings, clamp and fast_math on one buffer, each
judged by docs/design.md section 2's checks for its numerics mode (testing.check_outputs)."""
import itertools
import math

import torch

import megamoe_plugin as mm
from megamoe_plugin.kernel_variant import NUM_THREADS
from megamoe_plugin.testing import check_outputs, fill_buffer, random_inputs, random_layer


class SeedStream:
    """Each `next_generator()` is a fresh CUDA generator seeded with the stream's next seed."""

    def __init__(self, first_seed: int):
        self._seeds = itertools.count(first_seed)

    def next_generator(self) -> torch.Generator:
        return torch.Generator(device="cuda").manual_seed(next(self._seeds))


def layer_and_buffer(s, generator: torch.Generator):
    """A random layer and a one-GPU buffer for shape `s` (tests/gpu/cases.py Shape)."""
    torch.cuda.empty_cache()
    layer = random_layer(s.local_experts, s.hidden, s.intermediate, "cuda", generator)
    buf = mm.get_symm_buffer(None, s.local_experts, s.max_tokens, s.topk, s.hidden, s.intermediate)
    return layer, buf


def run(buf, layer, inputs, numerics, clamp=None, fast_math=True, stats=None):
    """One call on NaN-poisoned output; returns (y, device microseconds)."""
    n = fill_buffer(buf, inputs)
    y = torch.full((n, buf.hidden), math.nan, dtype=torch.bfloat16, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, activation_clamp=clamp, fast_math=fast_math,
                    cumulative_local_expert_recv_stats=stats, numerics=numerics)
    end.record()
    mm.ops.synchronize()
    return y, start.elapsed_time(end) * 1e3


def check_call_sequence(s, layer, buf, seeds: SeedStream, numerics, label=""):
    """Consecutive calls on one buffer: n max, 1, 0, odd; every routing; clamp and
    fast_math on and off; each against the reference, and the recv stats exact."""
    stats = torch.zeros(s.local_experts, dtype=torch.int32, device="cuda")
    expected_stats = torch.zeros_like(stats, dtype=torch.int64)
    plan = [
        (s.max_tokens, "uniform", None, True),
        (1, "uniform", None, True),
        (0, "uniform", None, True),
        (s.max_tokens // 2 | 1, "masked", 3.0, True),
        (s.max_tokens, "one_expert", None, False),
        (max(1, s.max_tokens - 3), "half_empty", 2.0, False),
        (s.max_tokens, "masked", None, True),
        # The most tokens whose entries CTA 0 counts alone, one per thread (kernel.cuh mega_moe), and one more.
        (min(s.max_tokens, NUM_THREADS // s.topk), "uniform", None, True),
        (min(s.max_tokens, NUM_THREADS // s.topk + 1), "uniform", None, True),
    ]
    for n, routing, clamp, fast_math in plan:
        inputs = random_inputs(n, s.hidden, s.local_experts, s.topk, routing, "cuda", seeds.next_generator())
        y, us = run(buf, layer, inputs, numerics, clamp, fast_math, stats)
        print(f"\n  {s}{label} {numerics} n={n} {routing} clamp={clamp} fast_math={fast_math}: {us:.1f} us", end="")
        check_outputs([y], [inputs], [layer], s.local_experts, numerics, activation_clamp=clamp)
        valid = inputs["topk_idx"][inputs["topk_idx"] >= 0]
        expected_stats += torch.bincount(valid, minlength=s.local_experts)
        assert torch.equal(stats.long(), expected_stats), "cumulative_local_expert_recv_stats is wrong"


def check_repeatable(s, layer, buf, seeds: SeedStream, numerics):
    """The same inputs three times give bit-identical outputs (a moving result is a race)."""
    inputs = random_inputs(s.max_tokens, s.hidden, s.local_experts, s.topk, "uniform", "cuda", seeds.next_generator())
    outs = [run(buf, layer, inputs, numerics)[0] for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "outputs differ between identical calls"
