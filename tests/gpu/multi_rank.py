"""Multi-rank correctness runs shared by the one-GPU test (R ranks' kernels side by side
on one GPU) and the real multi-GPU run (`torchrun --nproc-per-node R -m tests.gpu.multi_rank`).

Every rank builds the same R layers and R input sets from one seed, so each can compute
the whole reference itself and check its own output.
"""
import itertools
import math
import sys

import torch

import megamoe_plugin as mm
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.reference import calc_diff
from megamoe_plugin.testing import fill_buffer, output_errors, random_inputs, random_layer, reference_outputs

# (hidden, intermediate, topk, local experts, max tokens, tokens per rank per step)
MULTI_RANK_SHAPES = [
    (4096, 1536, 8, 8, 128, [128, 0, 37, 1]),
    (2048, 768, 6, 4, 64, [64, 17, 0, 64]),
]


def make_world(num_ranks, shape, device, seed, make_layer=random_layer):
    """A layer per rank (make_layer: testing.random_layer, or random_mxfp4_layer) and the generator."""
    hidden, inter, topk, local_experts, _, _ = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    return [make_layer(local_experts, hidden, inter, device, gen) for _ in range(num_ranks)], gen


def step_inputs(num_ranks, shape, tokens, step, routing, device, gen):
    hidden, _, topk, local_experts, _, _ = shape
    counts = [tokens if (r + step) % 2 == 0 else max(0, tokens // 2 - r) for r in range(num_ranks)]
    return [random_inputs(n, hidden, local_experts * num_ranks, topk, routing, device, gen) for n in counts]


def launch_side_by_side(bufs, layers, inputs, streams, tokens, numerics, stop_after_phase=0):
    """One step of R ranks on one GPU: every rank's kernel launched on its own stream before
    any wait (they must overlap); returns the NaN-poisoned outputs, synchronized. `tokens`: the
    config_num_tokens of every rank, or a list of each rank's. `stop_after_phase`: the debugging
    switch (ops.fp8_mega_moe's _stop_after_phase)."""
    config_tokens = tokens if isinstance(tokens, (list, tuple)) else [tokens] * len(bufs)
    ys = []
    for buf, rank_inputs in zip(bufs, inputs):
        fill_buffer(buf, rank_inputs)
        ys.append(torch.full((rank_inputs["x"].shape[0], buf.hidden), math.nan, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    for buf, layer, y, stream, config in zip(bufs, layers, ys, streams, config_tokens):
        with torch.cuda.stream(stream):
            # by default every rank picks its kernel by the same token count, as vLLM's DP padding does
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, config_num_tokens=config, numerics=numerics,
                            _stop_after_phase=stop_after_phase)
    mm.ops.synchronize()
    return ys


def run_local(num_ranks, shape, numerics, seed=0, make_layer=random_layer):
    """R ranks on one GPU, each on its own stream and share of SMs, with make_world's layers. Returns a
    list of (step, rank, calc_diff, error or None)."""
    hidden, inter, topk, local_experts, max_tokens, steps = shape
    layers, gen = make_world(num_ranks, shape, "cuda", seed, make_layer)
    bufs = mm.buffer.get_local_rank_buffers(num_ranks, local_experts * num_ranks, max_tokens, topk, hidden, inter)
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    results = []
    for step, tokens in enumerate(steps):
        routing = ("uniform", "masked", "half_empty", "one_expert")[step % 4]
        inputs = step_inputs(num_ranks, shape, tokens, step, routing, "cuda", gen)
        ys = launch_side_by_side(bufs, layers, inputs, streams, tokens, numerics)
        refs = reference_outputs(inputs, layers, local_experts * num_ranks)
        errors = output_errors(ys, inputs, layers, local_experts * num_ranks, numerics)
        results += [(step, r, calc_diff(ys[r], refs[r]), errors[r]) for r in range(num_ranks)]
    return results


def main_distributed(repeats=1):
    """One process per GPU (torchrun). Prints one line per (shape, step, rank). `repeats`: the
    shape's steps that many times over on one buffer, fresh inputs each time (a cross-rank
    ordering bug over NVLink shows in some calls only)."""
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    failures = 0
    for numerics, shape in itertools.product(NUMERICS_MODES, MULTI_RANK_SHAPES):
        hidden, inter, topk, local_experts, max_tokens, steps = shape
        layers, gen = make_world(world, shape, "cuda", 1)
        buf = mm.get_symm_buffer(dist.group.WORLD, local_experts * world, max_tokens, topk, hidden, inter)
        for step, tokens in enumerate(steps * repeats):
            routing = ("uniform", "masked", "half_empty", "one_expert")[step % 4]
            inputs = step_inputs(world, shape, tokens, step, routing, "cuda", gen)
            fill_buffer(buf, inputs[rank])
            y = torch.full((inputs[rank]["x"].shape[0], hidden), math.nan, dtype=torch.bfloat16, device="cuda")
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            mm.fp8_mega_moe(y, layers[rank].l1, layers[rank].l2, buf, config_num_tokens=tokens, numerics=numerics)
            end.record()
            mm.ops.synchronize()
            refs = reference_outputs(inputs, layers, local_experts * world)
            ref = refs[rank]
            ys = refs[:rank] + [y] + refs[rank + 1:]  # output_errors judges all ranks: the peers' are stand-ins
            err = output_errors(ys, inputs, layers, local_experts * world, numerics)[rank]
            failures += err is not None
            print(f"rank {rank}/{world} {numerics} H{hidden} I{inter} K{topk} E{local_experts * world} step {step} "
                  f"n={y.shape[0]} {routing}: {start.elapsed_time(end) * 1e3:.0f} us: calc_diff "
                  f"{calc_diff(y, ref):.2e} {'ok' if err is None else 'FAIL ' + err}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return failures


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the cross-rank protocol over NVLink, one process per GPU (torchrun)")
    ap.add_argument("--repeats", type=int, default=1, help="run each shape's steps this many times (default 1)")
    sys.exit(1 if main_distributed(ap.parse_args().repeats) else 0)
