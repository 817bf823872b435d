"""What a deployment needs compiled, and compiling it ahead of time (`python -m
megamoe_plugin.jit --build`): the variants are chosen by the runtime's own selection
(ops.variant_for, as a call's select_variant does), so a pre-built cache holds exactly
what the calls will load."""
from __future__ import annotations

import threading
from typing import Iterable, List, Sequence, Tuple

from ..heuristics import NUMERICS_MODES
from ..model_config import MoEShape
from ..progress import progress_bar
from . import KernelVariant, compile_variants

# The grid size given to the selection: it sets only the launch's CTA count, which is no
# template argument, so any value selects the same variants.
_ANY_GRID_SIZE = 132


def deployment_variants(shape: MoEShape, ep_size: int, batch_sizes: Iterable[int], gpu: str,
                        numerics: Sequence[str] = NUMERICS_MODES, fast_math: bool = True) -> List[KernelVariant]:
    """Every variant the calls of `shape` on `ep_size` ranks select on `gpu` at each batch
    size (tokens per rank), in each numerics mode; MEGAMOE_BLOCK_M and MEGAMOE_NUM_STAGES
    apply as at run time. Raises ValueError for a shape the kernel does not take."""
    from ..buffer import BufferShape
    from ..ops import _forced_block_m, _forced_num_stages, variant_for

    counts = sorted(set(int(n) for n in batch_sizes))
    buffer_shape = BufferShape(ep_size, shape.num_experts, max(counts[-1], 1), shape.num_topk, shape.hidden,
                               shape.intermediate_size)
    forced = (_forced_block_m(), _forced_num_stages())
    return list(dict.fromkeys(variant_for(buffer_shape, gpu, _ANY_GRID_SIZE, n, fast_math, mode, *forced)
                              for mode in numerics for n in counts))


def build_variants(variants: List[KernelVariant]) -> List[Tuple[KernelVariant, Exception]]:
    """Compiles (one nvcc per CPU) whichever of `variants` the cache lacks, with a progress
    bar; returns the failures."""
    progress = progress_bar(len(variants), "megamoe: building kernels", "variant")
    failures, lock = [], threading.Lock()

    def done(variant: KernelVariant, result) -> None:
        with lock:
            if isinstance(result, Exception):
                failures.append((variant, result))
            progress.set_postfix_str(variant.name())
            progress.update()

    compile_variants(variants, on_done=done)
    progress.close()
    return failures
