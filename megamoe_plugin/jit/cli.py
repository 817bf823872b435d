"""`python -m megamoe_plugin.jit`: --check (the reference variants' resources) and --build
(pre-build the cubins a deployment needs, for a machine without nvcc)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import List, Optional

from ..heuristics import NUMERICS_MODES, WEIGHT_FORMATS
from .command import DEFAULT_BATCH_SIZES, DEFAULT_GPU, PROG, parse_batch_sizes

def _at_least_one(text: str) -> int:
    """--limit's type: a count of variants, never a negative (which a slice would read from the end)."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    from ..model_config import add_shape_arguments

    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compile the kernel's variants ahead of time (nvcc, no GPU needed).",
        epilog=f"""examples:
  {PROG} --check                     resources of every reference variant
  {PROG} --build --model /models/DeepSeek-V3 --ep-size 8 --cache-dir ./megamoe-cache
  {PROG} --build --hidden 2048 --intermediate-size 768 --num-experts 128 --topk 8 --batch-sizes 1-512

--build compiles every variant that the runtime's selection (the GPU's tuned table, else
the heuristics; MEGAMOE_BLOCK_M / MEGAMOE_NUM_STAGES as set) picks for the shape on
--ep-size ranks at each batch size, in each numerics mode. A model's shared experts (its
config's n_shared_experts, or --shared-experts) run in the kernel's call as S more experts per
rank and S more slots per token where the framework hands them over (vLLM, DeepSeek-family
layers), beside it otherwise (SGLang; forms the kernel cannot take): both sets of variants are
built. Copy the folder to the serving
machine and point MEGAMOE_CACHE_DIR at it: the kernel then loads without nvcc. The folder is
code: the serving process refuses one that other users can write, and any cubin that its
build's manifest does not vouch for (--build replaces those).""")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="compile every reference variant (docs/design.md section 8) and print its registers, "
                           "spills, stack frame and shared memory; exit 1 on a spill or compile error")
    mode.add_argument("--build", action="store_true",
                      help="compile the variants a model's MoE shape needs into --cache-dir")
    p.add_argument("--limit", type=_at_least_one, help="--check: compile only the first N variants (N >= 1)")
    p.add_argument("--cache-dir", help="the cache folder to compile into (default: MEGAMOE_CACHE_DIR, else "
                                       "~/.cache/megamoe_plugin)")
    add_shape_arguments(p, required=True)
    b = p.add_argument_group("--build")
    b.add_argument("--ep-size", type=int, default=1,
                   help="expert-parallel ranks the model is served on (vLLM: data-parallel x tensor-parallel size) "
                        "(default: %(default)s)")
    b.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES,
                   help="tokens per rank per step to build for, comma-separated counts and ranges A-B; a server "
                        "meets every count up to its max-num-batched-tokens (default: %(default)s)")
    b.add_argument("--numerics", default=",".join(NUMERICS_MODES),
                   help="comma-separated numerics modes (docs/design.md section 2; vLLM runs exact under "
                        "VLLM_BATCH_INVARIANT=1) (default: %(default)s)")
    b.add_argument("--gpu", default=DEFAULT_GPU,
                   help="the serving GPU's name as torch.cuda.get_device_name() says it: its tuned table in "
                        "configs/ picks the variants (default: %(default)s)")
    b.add_argument("--no-fast-math", dest="fast_math", action="store_false",
                   help="build the variants of calls with fast_math=False (the op's IEEE SwiGLU option) instead "
                        "of the default fast_math=True, which vLLM runs")
    b.add_argument("--weights", choices=WEIGHT_FORMATS, default="fp8",
                   help="the experts' weight format: fp8 (128x128 blocks) or mxfp4 (read at 4 bits, fast numerics "
                        "only; DeepSeek-V4-Flash's routed experts) (default: %(default)s)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from . import cache, find_toolchain
    from .check import check_variants, reference_variants

    p = parser()
    args = p.parse_args(argv)
    prog = f"{PROG} {'--check' if args.check else '--build'}"
    if args.cache_dir:
        problem = cache.cache_dir_problem(Path(args.cache_dir))
        if problem:
            p.exit(1, f"{prog}: --cache-dir {args.cache_dir}: {problem}\n")
        os.environ["MEGAMOE_CACHE_DIR"] = args.cache_dir  # where jit.cache_dir() looks, in this process
    try:
        toolchain, why = find_toolchain()
    except ValueError as exc:  # a setting that cannot work, named
        p.exit(1, f"{prog}: {exc}\n")
    if args.check:  # without a toolchain, it reports the cubins of a pre-built cache
        variants = reference_variants()
        if args.limit is not None:
            variants = variants[: args.limit]
        failures = check_variants(variants)
        print(f"{len(variants) - failures} passed, {failures} failed")
        return 1 if failures else 0

    from ..model_config import shape_from_args
    from ..variants import build_variants_for
    from .build import build_variants

    shape = shape_from_args(args, p, required=True)
    if toolchain is None:
        p.exit(1, f"{prog}: {why.removeprefix('megamoe: ')}\n")
    numerics = tuple(args.numerics.split(","))
    unknown = [mode for mode in numerics if mode not in NUMERICS_MODES]
    if unknown:
        p.error(f"--numerics: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(NUMERICS_MODES)}")
    try:
        counts = parse_batch_sizes(args.batch_sizes)
        variants = build_variants_for(shape, args.ep_size, counts, args.gpu, numerics, args.fast_math, args.weights)
    except ValueError as exc:
        p.error(str(exc))
    print(f"{shape.describe()}, EP {args.ep_size}, {len(counts)} batch sizes, {', '.join(numerics)} numerics "
          f"on {args.gpu}: {len(variants)} variants", flush=True)
    failures = build_variants(variants)
    from . import cache_dir

    for variant, error in failures:
        print(f"{variant.name()}: {error}", file=sys.stderr)
    print(f"{len(variants) - len(failures)} of {len(variants)} variants built in {cache_dir()}; serve with "
          f"MEGAMOE_CACHE_DIR={shlex.quote(str(cache_dir()))}")
    return 1 if failures else 0
