"""No cross-rank timeout from a slow start: rank 1 sleeps longer than the wait bound
before its warm-up (a cold JIT stands in for the sleep) while rank 0, already warmed up,
waits at the warm-up's group barrier; then both run calls that match the reference.
Two processes share the one GPU (ipc_ranks), as two EP ranks on separate GPUs would.
"""
import math
import os
import time

import torch
import torch.distributed as dist

import megamoe_plugin as mm
from megamoe_plugin.testing import fill_buffer, output_errors, reference_outputs

from .ipc_ranks import ipc_rank_buffer, leave, run_ipc_ranks
from .multi_rank import MULTI_RANK_SHAPES, make_world, step_inputs

BOUND_S = 2.0      # MEGAMOE_TIMEOUT_S
DELAY_S = 2 * BOUND_S + 1
NUM_RANKS = 2
SHAPE = MULTI_RANK_SHAPES[1]  # precompiled for two ranks on 132 // 2 SMs (tests/gpu/cases.py)
NUMERICS = "fast"


def _rank_main(rank, num_ranks, init_file, queues, results):
    os.environ["MEGAMOE_TIMEOUT_S"] = str(BOUND_S)
    buf, storages = ipc_rank_buffer(rank, num_ranks, init_file, queues, SHAPE)
    group = buf.group
    hidden, inter, topk, local_experts, max_tokens, steps = SHAPE
    num_experts = local_experts * num_ranks
    layers, gen = make_world(NUM_RANKS, SHAPE, "cuda", seed=5)
    dist.barrier(group)  # both ready: from here rank 1 is late on purpose

    if rank == 1:
        time.sleep(DELAY_S)
    start = time.monotonic()
    mm.ops.warmup(buf, layers[rank].l1, layers[rank].l2, steps, numerics=NUMERICS)
    warmup_s = time.monotonic() - start

    lines = []
    for step, tokens in enumerate(steps):
        routing = ("uniform", "masked", "half_empty", "one_expert")[step % 4]
        inputs = step_inputs(NUM_RANKS, SHAPE, tokens, step, routing, "cuda", gen)
        fill_buffer(buf, inputs[rank])
        y = torch.full((inputs[rank]["x"].shape[0], hidden), math.nan, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        if step:
            dist.barrier(group)  # the reference of the last step took each rank its own time
        mm.fp8_mega_moe(y, layers[rank].l1, layers[rank].l2, buf, config_num_tokens=tokens, numerics=NUMERICS)
        mm.ops.synchronize()
        refs = reference_outputs(inputs, layers, num_experts)
        ys = refs[:rank] + [y] + refs[rank + 1:]  # output_errors judges all ranks: the peer's are stand-ins
        lines.append((step, y.shape[0], routing, output_errors(ys, inputs, layers, num_experts, NUMERICS)[rank]))
    results.put((rank, (warmup_s, lines)))
    leave()


def test_late_rank_waits_at_the_warmup_barrier_not_in_the_kernel(tmp_path):
    by_rank = run_ipc_ranks(_rank_main, NUM_RANKS, tmp_path)
    assert sorted(by_rank) == list(range(NUM_RANKS))
    failures = []
    for rank, (warmup_s, lines) in sorted(by_rank.items()):
        print(f"\n  rank {rank}: warm-up incl. barrier {warmup_s:.2f} s", end="")
        for step, n, routing, err in lines:
            print(f"\n  rank {rank} step {step} n={n} {routing}: {'ok' if err is None else err}", end="")
            if err is not None:
                failures.append(f"rank {rank} step {step}: {err}")
    # Rank 0 really waited at the barrier longer than the bound (its peer was asleep).
    assert by_rank[0][0] > DELAY_S - 0.5 > BOUND_S
    assert not failures, "\n".join(failures)
