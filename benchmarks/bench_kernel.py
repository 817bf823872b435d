"""Kernel benchmark against the floors of docs/design.md section 8, on one GPU or on R GPUs.

For each reference config (32 local experts per rank) and token count per rank: kernel
device time (median of --iters calls, L2 flushed and ranks aligned by a barrier before
each; with R ranks the slowest rank's median), TFLOPS, and rank 0's floor max(bytes /
measured HBM bandwidth, FLOPs / measured FP8 GEMM rate, NVLink bytes / measured peer
bandwidth) with time / floor. The ceilings are measured in the same run.

    python benchmarks/bench_kernel.py [--configs v3,v4flash] [--tokens 1,8,128] [--iters 20] [--no-fast-math]
    torchrun --nproc-per-node 2 benchmarks/bench_kernel.py ...     # R = 2 over NVLink
"""
import argparse
import itertools
import functools
import os
import sys
import warnings

import torch

import megamoe_plugin as mm
from megamoe_plugin.configs import REFERENCE_SHAPES
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer
from megamoe_plugin.timing import l2_flusher, median_call_seconds, timed_seconds

# docs/design.md section 8's reference configs, (H, I, K); every one has 32 local experts per rank.
CONFIGS = {name: (s.hidden, s.intermediate_size, s.num_topk) for name, s in REFERENCE_SHAPES.items()}
LOCAL_EXPERTS = 32
assert all(s.num_local_experts == LOCAL_EXPERTS for s in REFERENCE_SHAPES.values())


def require_sm90_gpu(prog: str) -> None:
    """Exits with a one-line error unless an SM90 GPU is usable: every benchmark launches the
    kernel, and a CUDA traceback from deep inside torch would not say that."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        # torch says why as a warning (e.g. "The NVIDIA driver on your system is too old").
        why = f" ({str(caught[0].message).splitlines()[0]})" if caught else ""
        sys.exit(f"{prog}: needs an SM90 (Hopper) GPU; CUDA is not available here{why}")
    if torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        sys.exit(f"{prog}: needs an SM90 (Hopper) GPU; {torch.cuda.get_device_name()} is sm_{major}{minor}")


def measure_hbm_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * src.numel() * 10 / timed_seconds(lambda: dst.copy_(src), 10)


def measure_fp8_rate() -> float:
    """FLOP/s of an 8192^3 FP8 GEMM through torch._scaled_mm."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")

    def gemm():
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    for _ in range(3):
        gemm()
    return 2 * n ** 3 * 10 / timed_seconds(gemm, 10)


def measure_peer_bandwidth(buf) -> float:
    """Bytes/s of this rank reading the next rank's symmetric buffer over NVLink."""
    region = buf.layout.regions["pool_x"]
    nbytes = min(region.nbytes, 1 << 30)
    peer = (buf.rank + 1) % buf.num_ranks
    src = buf._symm_handle.get_buffer(peer, (nbytes,), torch.uint8, region.offset)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    return nbytes * 10 / timed_seconds(lambda: dst.copy_(src), 10)


def rank_floor(all_idx, rank, num_ranks, hidden, inter, ceilings, local_experts=LOCAL_EXPERTS):
    """(floor seconds, FLOPs) of one rank, from every rank's routing (list of [n, K] ids)."""
    bandwidth, fp8_rate, peer_bandwidth = ceilings
    local = range(rank * local_experts, (rank + 1) * local_experts)
    rows = pulled = returned = 0
    experts_hit = set()
    for src, idx in enumerate(all_idx):
        valid = idx[idx >= 0]
        mine = valid[(valid >= local.start) & (valid < local.stop)]
        rows += mine.numel()
        experts_hit.update(mine.unique().tolist())
        if src != rank:
            pulled += mine.numel()  # rows this rank pulls in, and scatters back out
        else:
            returned += int(((valid < local.start) | (valid >= local.stop)).sum())  # rows others send back
    weight_bytes = len(experts_hit) * 3 * inter * hidden
    act_bytes = all_idx[rank].shape[0] * hidden * 3 + rows * (hidden + 2 * inter + 2 * hidden)
    nvlink_in = (pulled * (hidden + hidden // 128 * 4) + returned * 2 * hidden) if num_ranks > 1 else 0
    nvlink_out = pulled * 2 * hidden if num_ranks > 1 else 0
    flops = 2 * rows * 3 * inter * hidden
    floor = max((weight_bytes + act_bytes) / bandwidth, flops / fp8_rate,
                max(nvlink_in, nvlink_out) / peer_bandwidth if num_ranks > 1 else 0.0)
    return floor, flops


def init_world():
    """(rank, number of ranks, process group): torchrun's world, or one rank without it."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, None
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="v3,v4flash",
                   help=f"comma-separated reference configs to time, of {', '.join(CONFIGS)} (default: %(default)s)")
    p.add_argument("--tokens", default="1,8,32,128,512,2048,8192",
                   help="comma-separated token counts per rank (default: %(default)s)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point; the median is reported "
                                                         "(default: %(default)s)")
    p.add_argument("--no-fast-math", dest="fast_math", action="store_false",
                   help="call with fast_math=False (exact SwiGLU math)")
    p.add_argument("--numerics", default="fast,exact",
                   help="comma-separated numerics modes to time (docs/design.md section 2): fast, exact "
                        "(default: %(default)s)")
    return p


def main():
    p = parser()
    args = p.parse_args()
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    require_sm90_gpu("bench_kernel.py")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    rank, num_ranks, group = init_world()
    if group is not None:
        import torch.distributed as dist
    say = print if rank == 0 else (lambda *a, **k: None)
    bandwidth, fp8_rate = measure_hbm_bandwidth(), measure_fp8_rate()
    flush = l2_flusher()
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    peer_bandwidth = None
    for name in args.configs.split(","):
        hidden, inter, topk = CONFIGS[name]
        num_experts = LOCAL_EXPERTS * num_ranks
        layer = random_layer(LOCAL_EXPERTS, hidden, inter, "cuda", gen)
        buf = mm.get_symm_buffer(group, num_experts, max(tokens_list), topk, hidden, inter)
        if peer_bandwidth is None:
            peer_bandwidth = float("inf")  # no NVLink term with one rank (or if it cannot be measured)
            if num_ranks > 1:
                try:
                    peer_bandwidth = measure_peer_bandwidth(buf)
                except (AttributeError, RuntimeError, TypeError) as exc:
                    say(f"peer bandwidth not measured ({exc}); the NVLink floor term is left out")
            say(f"{num_ranks} x {torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, FP8 GEMM "
                f"{fp8_rate / 1e12:.0f} TFLOP/s, fast_math={args.fast_math}" + (f", peer read {peer_bandwidth / 1e9:.0f} GB/s" if num_ranks > 1
                                                   else ""))
            say(f"{'config':8s} {'numerics':8s} {'tokens':>6s} {'time_us':>9s} {'TFLOPS':>7s} {'floor_us':>9s} "
                f"{'ratio':>6s}")
        for numerics, n in itertools.product(args.numerics.split(","), tokens_list):
            inputs = random_inputs(n, hidden, num_experts, topk, "uniform", "cuda", gen)
            fill_buffer(buf, inputs)
            y = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")

            def before_call():
                flush()
                if group is not None:
                    dist.barrier(group)

            t = median_call_seconds(functools.partial(mm.fp8_mega_moe, y, layer.l1, layer.l2, buf,
                                                      fast_math=args.fast_math, numerics=numerics), args.iters,
                                    before_call)
            all_idx = [inputs["topk_idx"]]
            if group is not None:
                all_idx = [None] * num_ranks
                dist.all_gather_object(all_idx, inputs["topk_idx"].cpu(), group)
                per_rank = [None] * num_ranks
                dist.all_gather_object(per_rank, t, group)
                t = max(per_rank)  # the slowest rank bounds the step
            floor, flops = rank_floor([i.cpu() for i in all_idx], rank, num_ranks, hidden, inter,
                                      (bandwidth, fp8_rate, peer_bandwidth))
            say(f"{name:8s} {numerics:8s} {n:6d} {t * 1e6:9.1f} {flops / t / 1e12:7.1f} {floor * 1e6:9.1f} "
                f"{t / floor:6.2f}", flush=True)
        del layer, buf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
