"""Kernel benchmark against the floors of docs/design.md section 8 and against the MoE a
user would otherwise run, on one GPU or on R GPUs (torchrun).

For each config and token count per rank: the kernel's device time (median of --iters
calls, L2 flushed and ranks aligned by a barrier before each; with R ranks the slowest
rank's median), TFLOPS, rank 0's floor (bytes / measured HBM bandwidth, FLOPs / measured
FP8 GEMM rate, NVLink bytes / measured peer bandwidth: the ceilings are measured in the
same run) and time / floor; then e2e_us, the call from BF16 hidden states (stage_inputs +
the kernel), beside the baseline's time on the same inputs and the speedup (baseline /
e2e), and with R ranks rank 0's NVLink traffic per call (nvlink_MB: the larger direction, in MB,
bench/floors.py rank_floor). The table goes to stdout, a JSON file and a PNG plot to --results.

    python -m megamoe_plugin.bench [--configs v3,v4flash] [--tokens 1,8,128] [--iters 20]
    python -m megamoe_plugin.bench --model /models/Qwen3-30B-A3B          # a model's MoE shape
    torchrun --nproc-per-node 2 -m megamoe_plugin.bench ...                 # R = 2 over NVLink
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

from ..configs import REFERENCE_SHAPES, REFERENCE_TOKENS_PER_RANK
from ..heuristics import NUMERICS_MODES, WEIGHT_FORMATS, WEIGHT_NAME_SUFFIX, Numerics

PROG = "megamoe-bench"
# docs/design.md section 8's reference configs, (H, I, K); every one has 32 local experts per rank.
CONFIGS = {name: (s.hidden, s.intermediate_size, s.num_topk) for name, s in REFERENCE_SHAPES.items()}
LOCAL_EXPERTS = 32
assert all(s.num_local_experts == LOCAL_EXPERTS for s in REFERENCE_SHAPES.values())


def require_sm90_gpu(prog: str) -> None:
    """Exits with a one-line error unless an SM90 GPU is usable: every benchmark launches the
    kernel, and a CUDA traceback from deep inside torch would not say that."""
    import torch

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


def parser() -> argparse.ArgumentParser:
    from ..model_config import add_shape_arguments
    from .baselines import BASELINES

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="v3,v4flash",
                   help=f"comma-separated reference configs to time, of {', '.join(CONFIGS)}, each with "
                        f"{LOCAL_EXPERTS} local experts per rank (default: %(default)s)")
    add_shape_arguments(p, required=False)
    p.add_argument("--tokens", default=",".join(map(str, REFERENCE_TOKENS_PER_RANK)),
                   help="comma-separated token counts per rank (default: %(default)s)")
    p.add_argument("--numerics", default=",".join(NUMERICS_MODES),
                   help="comma-separated numerics modes to time (docs/design.md section 2): fast, exact "
                        "(default: %(default)s)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point; the median is reported "
                                                         "(default: %(default)s)")
    p.add_argument("--no-fast-math", dest="fast_math", action="store_false",
                   help="call with fast_math=False (exact SwiGLU math)")
    p.add_argument("--baseline", choices=BASELINES, default="auto",
                   help="what to time beside megamoe on one GPU: vllm (vLLM's Triton fused MoE), torch (an unfused "
                        "per-expert torch path: torch._scaled_mm with block scales, SwiGLU, FP8 requant), auto "
                        "(vllm if importable, else torch) or none; none with --shared-experts (docs/design.md "
                        "section 2: the fused call's floor counts them) (default: %(default)s)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="fp8",
                   help="the experts' weight format: fp8 (128x128 blocks) or mxfp4 (E2M1 codes with E8M0 scales per "
                        "32, read at 4 bits; fast numerics); its configs are named +w4, and the floor reads 4.25 "
                        "bits per weight (default: %(default)s)")
    p.add_argument("--results", default="megamoe-bench-results", metavar="DIR",
                   help="folder for the JSON file and the PNG plot (matplotlib) (default: %(default)s)")
    return p


def parse_args(argv: Optional[List[str]] = None):
    """(args, [(config name, (H, I, K), routed experts E or None for LOCAL_EXPERTS per rank)], tokens,
    numerics modes), args.shared_experts the S of every config; exits through parser.error on a
    bad option."""
    from ..model_config import shape_from_args

    p = parser()
    args = p.parse_args(argv)
    shape = shape_from_args(args, p, required=False)
    # The model's shared experts (an explicit --shared-experts already in the shape), else the
    # option's for every reference config.
    args.shared_experts = shape.num_shared_experts if shape is not None else args.shared_experts or 0
    if shape is not None:
        configs = [(shape.name, (shape.hidden, shape.intermediate_size, shape.num_topk), shape.num_experts)]
    else:
        unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
        if unknown:
            p.error(f"--configs: unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
        configs = [(name, CONFIGS[name], None) for name in args.configs.split(",")]
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens: {args.tokens!r} is not a comma-separated list of counts")
    if not tokens or min(tokens) < 0:
        p.error(f"--tokens: counts must be >= 0, got {args.tokens!r}")
    numerics = args.numerics.split(",")
    unknown = [mode for mode in numerics if mode not in NUMERICS_MODES]
    if unknown:
        p.error(f"--numerics: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(NUMERICS_MODES)}")
    if args.iters < 1:
        p.error("--iters must be >= 1")
    if args.weights == "mxfp4" and (numerics != ["fast"] or args.shared_experts or args.baseline not in ("none", "auto")):
        p.error("--weights mxfp4: with --numerics fast, no shared experts and --baseline none (the kernel runs MXFP4 "
                "weights in fast numerics; the baselines take FP8 weights)")
    if args.weights == "mxfp4":
        args.baseline = "none"
    if args.baseline == "vllm" and importlib.util.find_spec("vllm") is None:
        p.error("--baseline vllm: vllm is not installed (pip install 'megamoe_plugin[vllm]'), or use --baseline torch")
    return args, configs, tokens, numerics


def init_world():
    """(rank, number of ranks, process group): torchrun's world, or one rank without it."""
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, None
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def main(argv: Optional[List[str]] = None) -> int:
    args, configs, tokens_list, numerics_modes = parse_args(argv)
    require_sm90_gpu(PROG)
    import torch

    from .. import ops
    from ..progress import progress_bar
    from . import report
    from .baselines import make_baseline
    from .floors import Ceilings, measure_fp8_rate, measure_hbm_bandwidth, measure_peer_bandwidth
    from ..timing import GpuClockSampler

    rank, num_ranks, group = init_world()
    say = print if rank == 0 else (lambda *a, **k: None)
    clock = GpuClockSampler()
    if not clock.available:
        say("the SM clock is not sampled (no nvidia-ml-py, or NVML does not see this GPU): "
            "pip install nvidia-ml-py for the sm_MHz, min_MHz and limit columns")
    fp8_rate = measure_fp8_rate(clock)  # a short burst, which a power cap may not reach while long calls do
    gemm_clock = clock.summary()
    sustained_rate = measure_fp8_rate(clock, sustained=True)  # printed beside it; the floor keeps the burst's
    sustained_clock = clock.summary()
    ceilings = Ceilings(measure_hbm_bandwidth(), fp8_rate)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    progress = progress_bar(len(configs) * len(tokens_list) * len(numerics_modes), "megamoe-bench", "point") \
        if rank == 0 else None
    results = dict(device=torch.cuda.get_device_name(), num_ranks=num_ranks, fast_math=args.fast_math,
                   iters=args.iters, date=time.strftime("%Y-%m-%d %H:%M:%S"), baseline="none", points=[])
    for index, (name, (hidden, inter, topk), num_experts) in enumerate(configs):
        num_experts = num_experts or LOCAL_EXPERTS * num_ranks
        if num_experts % num_ranks:
            sys.exit(f"{PROG}: {name}'s {num_experts} experts do not divide over {num_ranks} ranks")
        local_experts = num_experts // num_ranks
        timer = _Timer(args, ceilings, group, rank, num_ranks, name, hidden, inter, topk, num_experts, local_experts,
                       max(tokens_list), gen, clock)
        if index == 0:
            if num_ranks > 1:
                ceilings = timer.ceilings = _with_peer_bandwidth(ceilings, timer.buf, measure_peer_bandwidth, say)
            say(f"{num_ranks} x {results['device']}: copy {ceilings.hbm_bytes_per_s / 1e12:.2f} TB/s, FP8 GEMM "
                f"{ceilings.fp8_flops_per_s / 1e12:.0f} TFLOP/s{report.clock_note(gemm_clock)} (sustained "
                f"{sustained_rate / 1e12:.0f}{report.clock_note(sustained_clock)}), fast_math={args.fast_math}"
                + (f", peer read {ceilings.peer_bytes_per_s / 1e9:.0f} GB/s" if num_ranks > 1 else ""))
        baseline, results["baseline"] = make_baseline(
            args.baseline if num_ranks == 1 and not args.shared_experts else "none", timer.layer.checkpoint)
        if index == 0:
            say(f"baseline: {results['baseline']}" + (" (one GPU only)" if num_ranks > 1 else "")
                + (f"; {args.shared_experts} shared expert(s) in every call" if args.shared_experts else ""))
            say(report.header())
        for numerics in numerics_modes:
            ops.warmup(timer.buf, timer.layer.l1, timer.layer.l2, tokens_list, args.fast_math, numerics)
        for n in tokens_list:
            inputs = timer.inputs(n)
            t_base = timer.median(functools.partial(baseline, inputs["hidden_states"], inputs["topk_idx"].int(),
                                                    inputs["topk_weights"])) if baseline is not None else None
            for numerics in numerics_modes:
                p = timer.point(inputs, numerics, t_base)
                results["points"].append(p)
                if progress is not None:
                    progress.update()
                say(report.row(p), flush=True)
        timer.close()
    if progress is not None:
        progress.close()
    results["ceilings"] = dict(hbm_bytes_per_s=ceilings.hbm_bytes_per_s, fp8_flops_per_s=ceilings.fp8_flops_per_s,
                               fp8_gemm_clock=gemm_clock, fp8_sustained_flops_per_s=sustained_rate,
                               fp8_sustained_clock=sustained_clock,
                               peer_bytes_per_s=None if num_ranks == 1 else ceilings.peer_bytes_per_s)
    if rank == 0:
        stem = f"bench_{time.strftime('%Y%m%d-%H%M%S')}_r{num_ranks}"
        json_path, png_path, note = report.write_results(results, Path(args.results), stem)
        say(f"results: {json_path}" + (f", {png_path}" if png_path else f" ({note})"))
    return 0


def _with_peer_bandwidth(ceilings, buf, measure, say):
    import dataclasses

    try:
        return dataclasses.replace(ceilings, peer_bytes_per_s=measure(buf))
    except (AttributeError, RuntimeError, TypeError) as exc:
        say(f"peer bandwidth not measured ({exc}); the NVLink floor term is left out")
        return ceilings


def point_generator(rank: int, num_tokens: int, device: str):
    """The generator of one point's inputs (hidden states and routing), seeded by the rank and the
    token count alone: a point draws the same routing whatever else `--tokens` lists, so that its
    time compares across runs (at decode the distinct experts a draw names set the weight bytes)."""
    import torch

    return torch.Generator(device=device).manual_seed((1000 + rank) * 1_000_003 + num_tokens)


class _Timer:
    """One config's layer, buffer and timed calls on this rank."""

    def __init__(self, args, ceilings, group, rank, num_ranks, name, hidden, inter, topk, num_experts,
                 local_experts, max_tokens, gen, clock):
        import torch

        import megamoe_plugin as mm
        from ..testing import random_layer, random_layer_of, with_shared_experts
        from ..timing import l2_flusher

        self.args, self.ceilings, self.group, self.rank, self.num_ranks = args, ceilings, group, rank, num_ranks
        self.name = f"{name}+s{args.shared_experts}" if args.shared_experts else name
        self.name += WEIGHT_NAME_SUFFIX[args.weights]
        self.hidden, self.inter, self.topk = hidden, inter, topk
        self.num_experts, self.local_experts, self.gen, self.clock = num_experts, local_experts, gen, clock
        self.layer = random_layer_of(args.weights)(local_experts, hidden, inter, "cuda", gen)
        self.buf = mm.get_symm_buffer(group, num_experts, max_tokens, topk, hidden, inter,
                                      num_shared_experts=args.shared_experts)
        if args.shared_experts:  # replicated: every rank draws the same ones
            shared = random_layer(args.shared_experts, hidden, inter, "cuda",
                                  torch.Generator(device="cuda").manual_seed(999)).checkpoint
            self.layer = with_shared_experts(self.layer, shared)
        self.flush = l2_flusher()

    def inputs(self, n: int) -> Dict:
        from ..testing import random_inputs

        return random_inputs(n, self.hidden, self.num_experts, self.topk, "uniform", "cuda",
                             point_generator(self.rank, n, "cuda"))

    def _before_call(self) -> None:
        self.flush()
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(self.group)

    def median(self, fn) -> float:
        from ..timing import median_call_seconds

        return median_call_seconds(fn, self.args.iters, self._before_call)

    def _slowest(self, t: float) -> float:
        if self.group is None:
            return t
        import torch.distributed as dist

        per_rank = [None] * self.num_ranks
        dist.all_gather_object(per_rank, t, self.group)
        return max(per_rank)  # the slowest rank bounds the step

    def point(self, inputs: Dict, numerics: Numerics, t_base: Optional[float]) -> Dict:
        import torch

        import megamoe_plugin as mm
        from . import report
        from .floors import WEIGHT_BYTES_PER_ELEMENT, rank_floor

        n = inputs["x"].shape[0]
        y = torch.empty(n, self.hidden, dtype=torch.bfloat16, device="cuda")
        kernel = functools.partial(mm.fp8_mega_moe, y, self.layer.l1, self.layer.l2, self.buf,
                                   fast_math=self.args.fast_math, numerics=numerics)

        def stage():
            mm.stage_inputs(self.buf, inputs["hidden_states"], inputs["topk_idx"], inputs["topk_weights"])

        def from_bf16():
            stage()
            kernel()

        stage()
        # The slots as the kernel sees them (shared experts' included): what the floor counts.
        kernel_idx = self.buf.topk_idx[:n].cpu()
        with self.clock:  # the clock and its limits while the kernel's timed calls run
            t = self.median(kernel)
        t = self._slowest(t)
        t_e2e = self._slowest(self.median(from_bf16))
        all_idx = [kernel_idx]
        if self.group is not None:
            import torch.distributed as dist

            all_idx = [None] * self.num_ranks
            dist.all_gather_object(all_idx, kernel_idx, self.group)
        floor, flops, nvlink_bytes = rank_floor(all_idx, self.rank, self.num_ranks, self.hidden, self.inter,
                                                self.ceilings, self.buf.shape.num_local_experts,
                                                WEIGHT_BYTES_PER_ELEMENT[self.args.weights])
        return report.point(self.name, numerics, n, t, flops, floor, t_e2e, t_base,
                            nvlink_bytes if self.num_ranks > 1 else None, self.clock.summary())

    def close(self) -> None:
        import torch

        del self.layer, self.buf
        torch.cuda.empty_cache()
