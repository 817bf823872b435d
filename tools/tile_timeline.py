"""Where a GEMM tile's time goes: one call per (config, tokens) with per-tile clock records
(megamoe_plugin.timeline; the variant built with MEGAMOE_TIMELINE), summarized per phase:
main loop per tile and per k-block, the part of it waiting for loaded stages, epilogue, gaps
between tiles, the producer's waits for free stages, and the phase's tail; then whether the
pull and the L2 scatter ever ran at once (timeline.pull_scatter_lag: on NVLink both use every
link's direction into a rank, so the schedule should keep the scatter behind the pull).

    python3 tools/tile_timeline.py [--configs v4flash,v3] [--tokens 128,2048,8192] [--local-experts 32]
        [--numerics fast] [--ranks R]   (R ranks side by side on one GPU, each on its share of the SMs)
    torchrun --nproc-per-node 2 tools/tile_timeline.py ...   (one rank per GPU over NVLink; each rank
                                                              prints its own records, lag on its own clock)

The records come from a call after a warm-up call, with the L2 cache flushed before it. The
variant is the one the call selects (MEGAMOE_BLOCK_M / MEGAMOE_NUM_STAGES apply), with the
clock reads added: compare its total time with tools/phase_times.py's to see what they cost.
"""
import argparse
import os

import torch

import megamoe_plugin as mm
from megamoe_plugin.bench.cli import CONFIGS
from megamoe_plugin.ops import timeline_for
from megamoe_plugin.testing import fill_buffer, random_inputs
from megamoe_plugin.timeline import format_lag, format_summary, pull_scatter_lag, summarize
from megamoe_plugin.timing import l2_flusher
from phase_times import add_call_arguments, calls, layer_for  # tools/ is this script's folder


def rank_calls(args, num_ranks, local_bufs, seed):
    """As phase_times.calls, for R ranks: per (config, tokens) the layers, buffers and outputs of the
    ranks this process runs (`local_bufs(experts, max tokens, top-k, H, I)` makes their buffers), each
    rank with `tokens` tokens routed uniformly over all R ranks' experts."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    experts = args.local_experts * num_ranks
    for name in args.configs.split(","):
        hidden, inter, topk = CONFIGS[name]
        bufs = local_bufs(experts, max(tokens_list), topk, hidden, inter)
        layers = [layer_for(args, hidden, inter, gen) for _ in bufs]
        for n in tokens_list:
            for buf in bufs:
                fill_buffer(buf, random_inputs(n, hidden, experts, topk, "uniform", "cuda", gen))
            yield name, hidden, inter, layers, bufs, [torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
                                                      for _ in bufs]
        del layers, bufs
        torch.cuda.empty_cache()


def launch(layers, bufs, ys, streams, numerics, timelines):
    """Every rank's call on its own stream before any wait (side by side ranks must overlap), after
    what the current stream did; the current stream then waits for them all."""
    current = torch.cuda.current_stream()
    for layer, buf, y, stream, timeline in zip(layers, bufs, ys, streams, timelines):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics=numerics, _timeline=timeline)
    for stream in streams:
        current.wait_stream(stream)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_call_arguments(parser, tokens="128,2048,8192")
    parser.add_argument("--numerics", default="fast", choices=("fast", "exact"))
    parser.add_argument("--ranks", type=int, default=1, help="R ranks side by side on one GPU (default 1)")
    args = parser.parse_args()
    if args.ranks > 1 and args.pool_rows is not None:
        parser.error("--pool-rows is for one rank (side by side ranks get the default pools)")
    dist, label = None, ""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one rank per GPU
        if args.ranks > 1 or args.pool_rows is not None:
            parser.error("under torchrun each process is one rank: no --ranks, no --pool-rows")
        import torch.distributed as dist

        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        label = f"[rank {dist.get_rank()}/{dist.get_world_size()}] "
    flush = l2_flusher()
    if dist is not None:  # this process's rank, one per GPU, on a symmetric buffer of the group (NVLink)
        world = rank_calls(args, dist.get_world_size(), lambda *shape: [mm.get_symm_buffer(dist.group.WORLD, *shape)],
                           seed=dist.get_rank())
    elif args.ranks == 1:
        world = ((name, hidden, inter, [layer], [buf], [y]) for name, hidden, inter, layer, buf, y in calls(args))
    else:  # R ranks side by side on one GPU, each on its share of the SMs
        world = rank_calls(args, args.ranks, lambda *shape: mm.buffer.get_local_rank_buffers(args.ranks, *shape), seed=0)
    for name, hidden, inter, layers, bufs, ys in world:
        streams = [torch.cuda.current_stream()] if len(bufs) == 1 else [torch.cuda.Stream() for _ in bufs]
        timelines = [timeline_for(buf) for buf in bufs]
        launch(layers, bufs, ys, streams, args.numerics, timelines)  # compiles, warms up
        for timeline in timelines:
            timeline.zero_()
        flush()
        if dist is not None:  # the ranks start the timed call together
            torch.cuda.synchronize()
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(layers, bufs, ys, streams, args.numerics, timelines)
        end.record()
        torch.cuda.synchronize()
        ranks = dist.get_world_size() if dist is not None else len(bufs)
        print(f"{label}{name} {args.numerics} R={ranks} n={ys[0].shape[0]} per rank: call "
              f"{start.elapsed_time(end) * 1e3:.1f} us (with the clock reads)", flush=True)
        for rank, timeline in enumerate(timelines):
            for line in format_summary(summarize(timeline, {"L1": hidden // 128, "L2": inter // 128})):
                print(f"{label}  rank {rank} " + line if len(bufs) > 1 else f"{label}  " + line, flush=True)
        print(f"{label}  " + format_lag(pull_scatter_lag(timelines)), flush=True)
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
