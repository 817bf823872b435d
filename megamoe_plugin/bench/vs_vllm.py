"""One MoE layer through vLLM's own Triton FP8 MoE and through megamoe_sm90, on the same
BF16 hidden states, routing and block-FP8 weights: how far each is from the float32
reference of docs/design.md section 2 and from each other, and how long each takes beside
the floor. Needs an SM90 GPU and vllm (pip install 'megamoe_plugin[vllm,cutlass]').

Default shape: Qwen3-30B-A3B's MoE layer (H 2048, I 768, 128 experts, top-8) on one GPU.
Timed as vLLM runs decode: each path captured in a CUDA graph (megamoe: stage_inputs +
fp8_mega_moe; vLLM: fused_experts, which quantizes its input itself), L2 flushed before
every replay, median of --iters.

With --shared-experts S, a shared-expert model's layer: S shared experts of the routed H and I
(the same block-FP8 weights for every path) added to the routed output, timed three ways, each
one CUDA graph (the side stream forked from and joined to the captured stream inside it):
  vllm    vLLM's default: the shared experts as one MLP of intermediate size S*I (gate_up,
          SiluAndMul, down: vLLM's block-FP8 linear layers, bench/baselines.py
          shared_expert_mlp) launched first on an auxiliary stream, vLLM's Triton fused MoE
          on the main one, joined, added
  mm+aux  megamoe without shared experts, the same shared MLP launched after the kernel on a
          side stream, joined, added (serving.SharedExpertsAfterKernel: the plugin's glue where the
          kernel does not take them)
  fused   megamoe with the S shared experts in the call (num_shared_experts=S, shared_scale 1)
In a graph the two branches are independent nodes: the capture order is the launch order asked
for, which the graph need not keep. The floor counts the shared experts' weights and FLOPs (the
slots as the kernel sees them, as megamoe-bench does); errors are against the float32 reference
with the shared experts.

With --weights mxfp4, MXFP4 experts (E2M1 codes, an E8M0 scale per 32 inputs) timed three ways,
each one CUDA graph:
  mxfp4   megamoe reading them at 4 bits (fast numerics)
  fp8     megamoe on the same weights as block FP8 (mxfp4.to_fp8_blocks, rounded where a block
          cannot hold them exactly): twice the bytes
  marlin  vLLM's Marlin MoE on them (W4A16: the path vLLM takes for MXFP4 experts on Hopper),
          repacked for it once (bench/baselines.py vllm_marlin_mxfp4_moe)
The floor is MXFP4's (half a byte per weight, scales included).

    python -m megamoe_plugin.bench.vs_vllm [--tokens 1,8,64,256,512]
        [--hidden 2048 --intermediate-size 768 --num-experts 128 --topk 8] [--shared-experts S]
        [--weights mxfp4]

A shared-expert shape: DeepSeek-V3's layer as one rank of EP8 holds it, 32 of its 256 experts
and its one shared expert (all 256 would fit an 80 GB GPU too: 11 GB of FP8 weights, held three
times here, in checkpoint layout and in the kernel's without and with the shared expert):

    python -m megamoe_plugin.bench.vs_vllm --hidden 7168 --intermediate-size 2048 --num-experts 32
        --topk 8 --shared-experts 1
"""
import argparse
import importlib.util
import sys
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

import megamoe_plugin as mm
from megamoe_plugin.bench.baselines import (merge_shared_experts, shared_expert_mlp, vllm_marlin_mxfp4_moe,
                                            vllm_triton_moe)
from megamoe_plugin.bench.cli import require_sm90_gpu
from megamoe_plugin.bench.floors import (WEIGHT_BYTES_PER_ELEMENT, Ceilings, measure_fp8_rate, measure_hbm_bandwidth,
                                         rank_floor)
from megamoe_plugin.fp8 import quantize_per_token_group
from megamoe_plugin.reference import calc_diff, mega_moe, token_rel_errors
from megamoe_plugin.serving import SharedExpertsAfterKernel
from megamoe_plugin.testing import random_layer, random_mxfp4_layer, random_routing
from megamoe_plugin.timing import graphed, l2_flusher, median_call_seconds

PROG = "python -m megamoe_plugin.bench.vs_vllm"
# The layer variants timed with --shared-experts, in the table's order (see the module docstring).
SHARED_VARIANTS = ("fused", "mm+aux", "vllm")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,16,32,64,128,256,512",
                   help="comma-separated token counts (one GPU) (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size H (default: %(default)s)")
    p.add_argument("--intermediate-size", type=int, default=768,
                   help="expert intermediate size I (default: %(default)s)")
    p.add_argument("--num-experts", type=int, default=128, help="number of experts, all on this GPU "
                                                                "(default: %(default)s)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default: %(default)s)")
    p.add_argument("--shared-experts", type=int, default=0, metavar="S",
                   help="S shared experts of the routed H and I in the layer: times vLLM's default (the shared MLP "
                        "on its auxiliary stream), megamoe with it on a side stream, and megamoe with them in the "
                        "call (default: %(default)s, the routed layer alone)")
    p.add_argument("--weights", choices=("fp8", "mxfp4"), default="fp8",
                   help="the experts' format: fp8 (block FP8; vLLM's Triton fused MoE) or mxfp4 (read at 4 bits in "
                        "fast numerics; vLLM's Marlin MoE, and megamoe on the same weights as FP8 blocks, rounded "
                        "where a block cannot hold them exactly) (default: %(default)s)")
    p.add_argument("--iters", type=int, default=50, help="timed graph replays per point; the median is "
                                                         "reported (default: %(default)s)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options; exits through parser.error on a bad one."""
    p = parser()
    args = p.parse_args(argv)
    if args.shared_experts < 0:
        p.error(f"--shared-experts must be >= 0, got {args.shared_experts}")
    if args.shared_experts and args.weights == "mxfp4":
        p.error("--shared-experts times FP8 experts only (--weights fp8)")
    return args


def staged_floor(buf, n: int, ceilings: Ceilings, weights: str = "fp8") -> float:
    """The floor (bench/floors.py rank_floor) of the call staged in `buf`'s first n rows on one GPU,
    from the slots as the kernel sees them: a buffer's shared experts are local experts that every
    token's extra slots name, so their weight reads and FLOPs count as megamoe-bench counts them."""
    return rank_floor([buf.topk_idx[:n].cpu()], 0, 1, buf.hidden, buf.intermediate_size, ceilings,
                      buf.shape.num_local_experts, WEIGHT_BYTES_PER_ELEMENT[weights])[0]


def aux_stream_first(main_work: Callable[[], torch.Tensor], aux_work: Callable[[], torch.Tensor],
                     aux: torch.cuda.Stream) -> Tuple[torch.Tensor, torch.Tensor]:
    """(main_work(), aux_work()) in vLLM's order: aux_work launched first on `aux`, which starts
    where the current stream stands, then main_work on the current stream, which joins `aux` before
    this returns (the plugin's order, the other way round, is serving.SharedExpertsAfterKernel).
    Inside a CUDA-graph capture the fork and the join put `aux`'s work into the graph. aux_work's
    output lives in `aux`'s memory: it is safe to use on the current stream because `aux` next runs
    only after the next fork, after that use."""
    current = torch.cuda.current_stream()
    aux.wait_stream(current)
    with torch.cuda.stream(aux):
        aux_out = aux_work()
    main_out = main_work()
    current.wait_stream(aux)
    return main_out, aux_out


def shared_header() -> str:
    """The --shared-experts table's header (shared_row's columns)."""
    return (f"{'tokens':>6s} | {'fused_us':>8s} {'mm+aux_us':>9s} {'vllm_us':>8s} {'floor_us':>8s} "
            f"{'fused/floor':>11s} {'vllm/fused':>10s} {'mm+aux/fused':>12s} | "
            f"calc_diff and worst-token rel. error vs ref: {', '.join(SHARED_VARIANTS)}")


def accuracy(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> List[Tuple[float, float]]:
    """(calc_diff, worst-token relative error) of each (output, reference) pair."""
    return [(calc_diff(out, ref), token_rel_errors(out, ref).max().item()) for out, ref in pairs]


def accuracy_text(errors: Sequence[Tuple[float, float]]) -> str:
    """The table's accuracy column: calc_diff/worst-token per pair, comma-separated."""
    return ", ".join(f"{d:.1e}/{r:.1e}" for d, r in errors)


def shared_row(n: int, seconds: Dict[str, float], floor: float, errors: Sequence[Tuple[float, float]]) -> str:
    """One token count's line: each SHARED_VARIANTS' time (seconds[name]), the floor, the ratios,
    and (calc_diff, worst-token relative error) against the reference per variant in that order."""
    fused = seconds["fused"]
    return (f"{n:6d} | {fused * 1e6:8.1f} {seconds['mm+aux'] * 1e6:9.1f} {seconds['vllm'] * 1e6:8.1f} "
            f"{floor * 1e6:8.1f} {fused / floor:11.2f} {seconds['vllm'] / fused:10.2f} "
            f"{seconds['mm+aux'] / fused:12.2f} | " + accuracy_text(errors))


def main(argv: Optional[Sequence[str]] = None):
    args = parse_args(argv)
    require_sm90_gpu(PROG)
    if importlib.util.find_spec("vllm") is None:
        sys.exit(f"{PROG}: needs vllm (pip install 'megamoe_plugin[vllm,cutlass]'), which is not installed")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    h, inter, num_experts, topk = args.hidden, args.intermediate_size, args.num_experts, args.topk

    gen = torch.Generator(device="cuda").manual_seed(7)
    ceilings = Ceilings(measure_hbm_bandwidth(), measure_fp8_rate())
    flush = l2_flusher()
    buf = mm.get_symm_buffer(None, num_experts, max(tokens_list), topk, h, inter)
    print(f"{torch.cuda.get_device_name()}: copy {ceilings.hbm_bytes_per_s / 1e12:.2f} TB/s, FP8 GEMM "
          f"{ceilings.fp8_flops_per_s / 1e12:.0f} TFLOP/s; H {h} I {inter} E {num_experts} top-{topk}"
          + (f"; {args.shared_experts} shared expert(s)" if args.shared_experts else ""))
    if args.weights == "mxfp4":
        _compare_mxfp4(args, tokens_list, buf, ceilings, flush, gen)
        return
    layer = random_layer(num_experts, h, inter, "cuda", gen)
    triton_moe = vllm_triton_moe(layer.checkpoint)
    mm.ops.warmup(buf, layer.l1, layer.l2, tokens_list)
    if args.shared_experts:
        _compare_with_shared_experts(args, tokens_list, layer, triton_moe, buf, ceilings, flush, gen)
        return
    print(f"{'tokens':>6s} | {'megamoe_us':>10s} {'vllm_us':>8s} {'floor_us':>8s} {'mm/floor':>8s} {'vllm/mm':>7s} | "
          f"calc_diff and worst-token rel. error: megamoe-ref, vllm-ref, megamoe-vllm")
    for n in tokens_list:
        hidden, idx, weights = _inputs(n, h, num_experts, topk, gen)
        megamoe = _megamoe_call(buf, layer.l1, layer.l2, hidden, idx, weights)

        def vllm():
            return triton_moe(hidden, idx, weights)

        y = megamoe()
        y_vllm = vllm()
        ref = _reference(hidden, idx, weights, layer.checkpoint, num_experts)
        errors = accuracy(((y, ref), (y_vllm, ref), (y, y_vllm)))

        t_mm = median_call_seconds(graphed(megamoe), args.iters, flush)
        t_vllm = median_call_seconds(graphed(vllm), args.iters, flush)
        floor = staged_floor(buf, n, ceilings)
        print(f"{n:6d} | {t_mm * 1e6:10.1f} {t_vllm * 1e6:8.1f} {floor * 1e6:8.1f} {t_mm / floor:8.2f} "
              f"{t_vllm / t_mm:7.2f} | " + accuracy_text(errors), flush=True)


def _compare_mxfp4(args, tokens_list: List[int], buf, ceilings: Ceilings, flush, gen) -> None:
    """The --weights mxfp4 table: megamoe on MXFP4 experts (fast numerics), megamoe on the same
    weights as FP8 blocks (mxfp4.to_fp8_blocks), and vLLM's Marlin MoE on the MXFP4 weights."""
    from megamoe_plugin.mxfp4 import to_fp8_blocks

    h, inter, num_experts, topk = args.hidden, args.intermediate_size, args.num_experts, args.topk
    layer = random_mxfp4_layer(num_experts, h, inter, "cuda", gen)
    c = layer.checkpoint
    fp8_l1, fp8_l2 = mm.transform_weights(to_fp8_blocks(c["w13"], c["w13_scale"], exact=False),
                                          to_fp8_blocks(c["w2"], c["w2_scale"], exact=False))
    marlin = vllm_marlin_mxfp4_moe(c)
    mm.ops.warmup(buf, layer.l1, layer.l2, tokens_list, numerics="fast")
    mm.ops.warmup(buf, fp8_l1, fp8_l2, tokens_list, numerics="fast")
    print(f"{'tokens':>6s} | {'mxfp4_us':>8s} {'fp8_us':>8s} {'marlin_us':>9s} {'floor_us':>8s} {'mxfp4/floor':>11s} "
          f"{'fp8/mxfp4':>9s} {'marlin/mxfp4':>12s} | calc_diff and worst-token rel. error vs ref: mxfp4, fp8, marlin")
    for n in tokens_list:
        hidden, idx, weights = _inputs(n, h, num_experts, topk, gen)
        mxfp4 = _megamoe_call(buf, layer.l1, layer.l2, hidden, idx, weights, numerics="fast")
        fp8 = _megamoe_call(buf, fp8_l1, fp8_l2, hidden, idx, weights, numerics="fast")

        def vllm():
            return marlin(hidden, idx, weights)

        paths = {"mxfp4": mxfp4, "fp8": fp8, "marlin": vllm}
        outputs = {name: fn() for name, fn in paths.items()}
        ref = _reference(hidden, idx, weights, c, num_experts)
        errors = accuracy((out, ref) for out in outputs.values())
        t = {name: median_call_seconds(graphed(fn), args.iters, flush) for name, fn in paths.items()}
        floor = staged_floor(buf, n, ceilings, "mxfp4")
        print(f"{n:6d} | {t['mxfp4'] * 1e6:8.1f} {t['fp8'] * 1e6:8.1f} {t['marlin'] * 1e6:9.1f} {floor * 1e6:8.1f} "
              f"{t['mxfp4'] / floor:11.2f} {t['fp8'] / t['mxfp4']:9.2f} {t['marlin'] / t['mxfp4']:12.2f} | "
              + accuracy_text(errors), flush=True)


def _compare_with_shared_experts(args, tokens_list: List[int], layer, triton_moe, routed_buf, ceilings: Ceilings,
                                 flush, gen) -> None:
    """The --shared-experts table: SHARED_VARIANTS per token count (see the module docstring)."""
    h, inter, num_experts, topk, num_shared = (args.hidden, args.intermediate_size, args.num_experts, args.topk,
                                               args.shared_experts)
    shared = random_layer(num_shared, h, inter, "cuda", gen).checkpoint
    shared_mlp, mlp_name = shared_expert_mlp(merge_shared_experts(shared))
    c = layer.checkpoint
    fused_l1, fused_l2 = mm.transform_weights((c["w13"], c["w13_scale"]), (c["w2"], c["w2_scale"]), shared=shared)
    fused_buf = mm.get_symm_buffer(None, num_experts, max(tokens_list), topk, h, inter, num_shared_experts=num_shared)
    mm.ops.warmup(fused_buf, fused_l1, fused_l2, tokens_list)
    aux = torch.cuda.Stream()  # made before any capture, as vLLM's auxiliary stream is
    after_kernel = SharedExpertsAfterKernel()  # the plugin's own, as its glue runs unfolded shared experts
    print(f"shared experts of vllm and mm+aux: one MLP of intermediate size {num_shared * inter}, {mlp_name}")
    print(shared_header())
    for n in tokens_list:
        hidden, idx, weights = _inputs(n, h, num_experts, topk, gen)
        megamoe_routed = _megamoe_call(routed_buf, layer.l1, layer.l2, hidden, idx, weights)
        fused = _megamoe_call(fused_buf, fused_l1, fused_l2, hidden, idx, weights, shared_scale=1.0)

        def shared_part():
            return shared_mlp(hidden)

        def vllm():
            routed, shared_out = aux_stream_first(lambda: triton_moe(hidden, idx, weights), shared_part, aux)
            return routed + shared_out

        def mm_aux():
            routed, shared_out = after_kernel.run(megamoe_routed, shared_part, on_cuda=True)
            return routed + shared_out

        variants = {"fused": fused, "mm+aux": mm_aux, "vllm": vllm}
        outputs = {name: variants[name]() for name in SHARED_VARIANTS}
        floor = staged_floor(fused_buf, n, ceilings)  # fused() staged this n last
        ref = _reference(hidden, idx, weights, c, num_experts, shared)
        errors = accuracy((outputs[name], ref) for name in SHARED_VARIANTS)
        seconds = {name: median_call_seconds(graphed(variants[name]), args.iters, flush) for name in SHARED_VARIANTS}
        print(shared_row(n, seconds, floor, errors), flush=True)


def _megamoe_call(buf, l1, l2, hidden, idx, weights, numerics: Optional[str] = None,
                  shared_scale: Optional[float] = None) -> Callable[[], torch.Tensor]:
    """stage_inputs + fp8_mega_moe on these inputs into an output first filled with NaN, as one
    callable to capture: it returns the output. numerics None: fp8_mega_moe's default."""
    y = torch.full((hidden.shape[0], hidden.shape[1]), float("nan"), dtype=torch.bfloat16, device=hidden.device)
    stage_kwargs = {} if shared_scale is None else {"shared_scale": shared_scale}

    def run():
        mm.stage_inputs(buf, hidden, idx, weights, **stage_kwargs)
        mm.fp8_mega_moe(y, l1, l2, buf, numerics=numerics)
        return y

    return run


def _inputs(n: int, hidden_size: int, num_experts: int, topk: int, gen):
    """(BF16 hidden states [n, H], routing int32 [n, K], softmax routing weights [n, K]) on the GPU:
    the routing as vLLM's router gives it to either path, so neither times a cast."""
    hidden = torch.randn(n, hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    idx = random_routing(n, num_experts, topk, "uniform", "cuda", gen).int()
    weights = torch.softmax(torch.randn(n, topk, generator=gen, device="cuda"), dim=-1)
    return hidden, idx, weights


def _reference(hidden, idx, weights, checkpoint, num_experts: int, shared=None) -> torch.Tensor:
    """The float32 reference's output for these inputs (with the shared experts at scale 1, if any)."""
    x, x_sf = quantize_per_token_group(hidden)
    return mega_moe([dict(x=x, x_sf=x_sf, topk_idx=idx.long(), topk_weights=weights)], [checkpoint], num_experts,
                    shared=shared)[0]


if __name__ == "__main__":
    main()
