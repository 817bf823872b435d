"""Compiling a deployment's variants ahead of time (`python -m megamoe_plugin.jit --build`),
with progress; which variants, megamoe_plugin.variants.deployment_variants says."""
from __future__ import annotations

import threading
from typing import List, Tuple

from ..progress import progress_bar
from ..kernel_variant import KernelVariant
from . import compile_variants

def build_variants(variants: List[KernelVariant]) -> List[Tuple[KernelVariant, Exception]]:
    """Compiles (one nvcc per CPU) whichever of `variants` the cache lacks, or holds only in a
    build that fails verification (replaced), with a progress bar; returns the failures."""
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
