"""R ranks as R processes on one GPU, as EP ranks on separate GPUs would be: each process
allocates its buffer storage, the others map it through CUDA IPC (torch.multiprocessing
queues), each builds its SymmBuffer from the addresses it sees, with its share of the SMs,
and a gloo group serves the warm-up barrier. Each process has its own host words, so every
rank's own failure report can be seen (side-by-side ranks in one process share one).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamoe_plugin.buffer import BufferShape, SymmBuffer, get_symm_buffer_size


def ipc_rank_buffer(rank, num_ranks, init_file, queues, shape):
    """This process's rank of the group: (buffer, the storages it maps; keep them until leave()).
    `shape`: (hidden, intermediate, topk, local experts, max tokens, ...)."""
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=num_ranks)
    hidden, inter, topk, local_experts, max_tokens = shape[:5]
    num_experts = local_experts * num_ranks
    storage = torch.zeros(get_symm_buffer_size(num_ranks, num_experts, max_tokens, topk, hidden, inter),
                          dtype=torch.uint8, device="cuda")
    for peer in range(num_ranks):
        if peer != rank:
            queues[peer].put((rank, storage))
    storages = {rank: storage}
    for _ in range(num_ranks - 1):
        peer, peer_storage = queues[rank].get()
        storages[peer] = peer_storage
    peer_ptrs = tuple(storages[r].data_ptr() for r in range(num_ranks))
    buf_shape = BufferShape(num_ranks, num_experts, max_tokens, topk, hidden, inter)
    sms = torch.cuda.get_device_properties(0).multi_processor_count // num_ranks
    return SymmBuffer(buf_shape, storage, rank, peer_ptrs, group=dist.group.WORLD, num_sms=sms), storages


def leave():
    """Ends a rank's process once every rank has its outcome (a gloo barrier: no CUDA call, so it
    also works after a trap). After it no rank uses a peer's storage, so the process exits at once,
    freeing nothing itself (after a trap the context is lost and freeing would fail)."""
    print(f"rank {dist.get_rank()}: leaving", file=sys.stderr, flush=True)
    dist.barrier()
    print(f"rank {dist.get_rank()}: left", file=sys.stderr, flush=True)
    os._exit(0)


def run_ipc_ranks(rank_main, num_ranks, tmp_path, *args):
    """Runs rank_main(rank, num_ranks, init_file, queues, results, *args) in num_ranks processes;
    returns {rank: what that rank put on `results` as (rank, value)}."""
    ctx = mp.get_context("spawn")
    queues = [ctx.SimpleQueue() for _ in range(num_ranks)]
    results = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(num_ranks, str(tmp_path / "init"), queues, results, *args),
                       nprocs=num_ranks, join=True, start_method="spawn")
    by_rank = {}
    while not results.empty():
        rank, value = results.get()
        by_rank[rank] = value
    return by_rank
