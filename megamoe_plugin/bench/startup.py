"""`python -m megamoe_plugin.bench.startup`: what the kernel adds to a server's start-up, for one
model's MoE shape on this machine (docs/performance.md, "Start-up").

    python -m megamoe_plugin.bench.startup --model /models/DeepSeek-V3 --ep-size 8 --cache-dir ./startup-cache

Three starts, each timed from outside as a user meets it:
  cold  `python -m megamoe_plugin.jit --build` into the empty --cache-dir: nvcc compiles every variant
        the deployment needs, one process per CPU (a first server start compiles the same set the
        same way, in ops.warmup);
  warm  the same command again: every variant is cached, nothing compiles;
  load  on the GPU, a process that cannot compile (the CUTLASS headers hidden from it, as on a
        serving machine with a pre-built cache and no toolchain) loads every variant from the
        cache into the device (ops.load_kernels, what a server's warm-up does).
The shape and deployment options are jit --build's and go to it unchanged.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from ..heuristics import NUMERICS_MODES
from ..jit.command import DEFAULT_BATCH_SIZES, DEFAULT_GPU

# The load step's child: this module's load_step with the CUTLASS headers hidden, so that it finds no
# toolchain and only the cache's verified builds can load.
_LOAD_CHILD = ("import sys; sys.modules['cutlass_library'] = None; "
               "from megamoe_plugin.bench.startup import load_step; load_step(sys.argv[1:])")


def parser() -> argparse.ArgumentParser:
    from ..model_config import add_shape_arguments

    p = argparse.ArgumentParser(prog="python -m megamoe_plugin.bench.startup",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cache-dir", required=True, help="an empty or missing folder: the cold start compiles into it")
    add_shape_arguments(p, required=True)
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks (default: %(default)s)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="as jit --build's (default: %(default)s)")
    p.add_argument("--numerics", default=",".join(NUMERICS_MODES), help="as jit --build's (default: %(default)s)")
    p.add_argument("--gpu", default=None, help="whose table selects the variants (default: this machine's GPU, else "
                                               f"{DEFAULT_GPU!r})")
    return p


def _timed(cmd: List[str], env=None) -> tuple:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-4000:]}")
    return seconds, proc.stdout


def _variants(p: argparse.ArgumentParser, args):
    """The variants `jit --build` builds for these options."""
    from ..jit.command import parse_batch_sizes
    from ..model_config import shape_from_args
    from ..variants import build_variants_for

    return build_variants_for(shape_from_args(args, p, required=True), args.ep_size,
                              parse_batch_sizes(args.batch_sizes), args.gpu, tuple(args.numerics.split(",")))


def load_step(argv: List[str]) -> None:
    """The load step, in the child: ops.load_kernels of every variant of the options `argv` (--gpu
    given), timed; prints the count and the seconds."""
    import torch

    from .. import ops
    from ..jit import find_toolchain

    if find_toolchain()[0] is not None:
        raise SystemExit("the load step must run where nothing can compile")
    p = parser()
    args = p.parse_args(argv)
    variants = _variants(p, args)
    start = time.perf_counter()
    ops.load_kernels(variants)
    torch.cuda.synchronize()
    print(len(variants), time.perf_counter() - start)


def main(argv: Optional[List[str]] = None) -> int:
    import torch

    from ..model_config import shape_from_args

    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    shape = shape_from_args(args, p, required=True)
    cache = Path(args.cache_dir)
    if cache.exists() and any(cache.iterdir()):
        p.error(f"--cache-dir {cache} is not empty: the cold start needs an empty folder")
    on_gpu = torch.cuda.is_available()
    if args.gpu is None:  # every step selects the variants of the same GPU
        argv += ["--gpu", torch.cuda.get_device_name() if on_gpu else DEFAULT_GPU]
        args = p.parse_args(argv)
    build = [sys.executable, "-m", "megamoe_plugin.jit", "--build", *argv]  # its options are jit --build's
    print(f"{shape.describe()}, EP {args.ep_size}, batch sizes {args.batch_sizes}, {args.numerics} numerics, "
          f"variants of {args.gpu}; {os.cpu_count()} CPUs", flush=True)
    cold, out = _timed(build)
    print(f"cold start (jit --build, nvcc): {cold:.1f} s; {out.strip().splitlines()[-1]}", flush=True)
    warm, _ = _timed(build)
    print(f"warm start (jit --build, all cached): {warm:.1f} s", flush=True)
    if not on_gpu:
        print("load: no GPU here")
        return 0
    env = {k: v for k, v in os.environ.items() if k != "MEGAMOE_CUTLASS_INCLUDE"}
    env["MEGAMOE_CACHE_DIR"] = str(cache)
    process, out = _timed([sys.executable, "-c", _LOAD_CHILD, *argv], env)
    num_variants, load = out.split()[-2:]
    print(f"start from the pre-built cache without a toolchain: {num_variants} variants loaded in {float(load):.2f} s "
          f"({process:.1f} s with the process's start and imports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
