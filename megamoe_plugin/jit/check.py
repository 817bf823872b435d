"""This kernel's compile checks (`python -m megamoe_plugin.jit --check`): the resource rows ptxas
reports (registers, spills, stack, shared memory, serialized WGMMAs) and the variants the heuristics
pick for the reference configs.

A spill fails the check where it lies inside a WGMMA main loop (megamoe_plugin.jit.spill_sites), where
it would cost on every k-block, or where nvdisasm cannot tell. Outside the main loops it costs once per
tile or per call and is shown, not failed: at BLOCK_M 64 with fast_math the math warps sit at a
384-thread CTA's 168 registers, and ptxas spills a few bytes (8 to 160 by shape, ranks and depth, so
by GPU, whose table or heuristic picks the depth) of the tile bounds, an L1 tile's act-row offset
reloaded in its epilogue and, at R >= 2, the cross-rank barrier's per-peer slots.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import threading
from typing import List, Union

from ..buffer import BufferShape
from ..kernel_variant import KERNEL_NAME, WINDOW_KERNEL_NAME, KernelVariant
from . import CompiledKernel, compile_variants
from .spill_sites import cubin_spill_sites

WGMMA_SERIALIZED = re.compile(r"\((C\d+)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized")


@dataclasses.dataclass
class ResourceUsage:
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int
    # ptxas serialized the WGMMAs, the whole kernel's (its "Potential Performance Loss" notes, any
    # code: C7518 for a path that leaves a main loop with a batch in flight, csrc/megamoe/mma.cuh;
    # C7511 for too few registers to keep WGMMAs in flight): the tensor pipe then
    # runs one WGMMA at a time, a silent slowdown. The note's code, "" when none.
    wgmma_serialized: str = ""


def parse_ptxas(log: str, entry: str = KERNEL_NAME) -> ResourceUsage:
    """Reads one entry kernel's lines of `ptxas -v` output (`entry`: KERNEL_NAME, or a windowed
    variant's WINDOW_KERNEL_NAME). A serialization note counts for the entry it names, and for
    KERNEL_NAME where it names none."""
    start = log.find(f"entry function '{entry}'")
    if start < 0:
        start = log.find(entry) if entry in log else 0
    end = log.find("Compiling entry function", start + 1)
    section = log[start:] if end < 0 else log[start:end]
    def grab(pattern, default=0):
        m = re.search(pattern, section)
        return int(m.group(1)) if m else default
    notes = [line for line in log.splitlines() if WGMMA_SERIALIZED.search(line)
             and (f"'{entry}'" in line or (entry == KERNEL_NAME and f"'{WINDOW_KERNEL_NAME}'" not in line))]
    return ResourceUsage(
        registers=grab(r"Used (\d+) registers", -1),
        spill_stores=grab(r"(\d+) bytes spill stores"),
        spill_loads=grab(r"(\d+) bytes spill loads"),
        stack_frame=grab(r"(\d+) bytes stack frame"),
        static_smem=grab(r"(\d+) bytes smem"),
        wgmma_serialized=",".join(dict.fromkeys(WGMMA_SERIALIZED.search(line).group(1) for line in notes)),
    )


def _spills_outside_main_loops(compiled: CompiledKernel) -> bool:
    """Whether nvdisasm finds every spill of the fused kernel outside its WGMMA main loops (False
    where it cannot read the cubin). The window kernel's spills are shown, not judged (below)."""
    sites = cubin_spill_sites(compiled.cubin)
    return sites is not None and not any(s.in_main_loop for s in sites if s.function == KERNEL_NAME)


def check_variants(variants: List[KernelVariant]) -> int:
    """Compiles `variants`, printing each one's resource row with a count as it finishes (a
    full check compiles for minutes); returns the number of failures."""
    total = len(variants)
    count = f"[{{:{len(str(total))}d}}/{total}]"
    print(f"{' ' * len(count.format(0))} {'variant':58s} {'regs':>5s} {'spill':>6s} {'stack':>6s} {'smem':>7s}  status")
    failures, done, lock = 0, 0, threading.Lock()

    def report(variant: KernelVariant, compiled: Union[CompiledKernel, RuntimeError]) -> None:
        nonlocal failures, done
        if isinstance(compiled, RuntimeError):
            ok, row = False, f"{variant.name():58s} compile error\n{compiled}"
        else:
            usage = parse_ptxas(compiled.ptxas_log)
            spills = usage.spill_stores + usage.spill_loads
            # A timeline build's clock registers may spill a few bytes (12-20 at BLOCK_M 64, outside
            # the main loop): acceptable in that debugging build, shown, not failed.
            spills_fail = spills > 0 and not variant.timeline and not _spills_outside_main_loops(compiled)
            ok = not spills_fail and usage.registers > 0 and not usage.wgmma_serialized
            status = ("SPILLS" if spills_fail else f"WGMMA SERIALIZED (ptxas {usage.wgmma_serialized})" if usage.wgmma_serialized
                      else "no ptxas report" if usage.registers <= 0
                      else "ok (timeline build spills)" if spills and variant.timeline
                      else "ok (spills outside the main loops)" if spills
                      else "ok")
            if variant.windowed:
                # The window kernel runs only the calls whose rows overflow the pools; its spills (its
                # loop over windows in exact BLOCK_M 64 without fast_math, its one window per launch at
                # BLOCK_M 128) cost there alone: shown, not failed. It must compile and report like the
                # fused kernel.
                window = parse_ptxas(compiled.ptxas_log, WINDOW_KERNEL_NAME)
                ok = ok and window.registers > 0
                window_spills = window.spill_stores + window.spill_loads
                status += (f"; window kernel {window.registers} regs, {window_spills} B spills"
                           + (f", WGMMA serialized (ptxas {window.wgmma_serialized})" if window.wgmma_serialized else ""))
            row = (f"{variant.name():58s} {usage.registers:5d} {spills:6d} {usage.stack_frame:6d} "
                   f"{compiled.smem_bytes:7d}  {status}")
        with lock:  # rows come from the compile threads
            done += 1
            failures += not ok
            print(f"{count.format(done)} {row}", flush=True)

    compile_variants(variants, on_done=report)
    return failures


def reference_variants() -> List[KernelVariant]:
    """Every variant the heuristics pick for docs/design.md section 8's reference configs, in both
    numerics modes, and each tier a mode implements that they pick for none of its token counts,
    once per reference shape on one rank (MEGAMOE_BLOCK_M, tuned tables)."""
    from ..configs import REFERENCE_SHAPES, REFERENCE_TOKENS_PER_RANK
    from ..heuristics import NUMERICS_MODES, default_config, default_num_stages, implemented_block_m, runnable_block_m

    variants = []
    for shape, numerics in itertools.product(REFERENCE_SHAPES.values(), NUMERICS_MODES):
        hidden, inter, topk, num_local_experts = (shape.hidden, shape.intermediate_size, shape.num_topk,
                                                  shape.num_local_experts)
        for num_ranks in (1, 2):
            num_experts = num_local_experts * num_ranks
            # As a buffer for the largest reference token count with the default pools has them.
            windowed = BufferShape(num_ranks, num_experts, max(REFERENCE_TOKENS_PER_RANK), topk, hidden,
                                   inter).windowed
            for tokens in REFERENCE_TOKENS_PER_RANK:
                cfg = default_config(num_ranks, num_experts, topk, hidden, inter, tokens, 132, numerics)
                for fast_math in (True, False):  # as variants.variant_for picks without a table
                    block_m = runnable_block_m(cfg.block_m, fast_math)
                    stages = cfg.num_stages if block_m == cfg.block_m else default_num_stages(
                        block_m, num_local_experts, hidden, inter, numerics=numerics)
                    v = KernelVariant(hidden, inter, topk, num_experts, num_ranks, block_m, stages, fast_math,
                                      numerics, windowed=windowed)
                    if v not in variants:
                        variants.append(v)
        picked = {v.block_m for v in variants if (v.hidden, v.intermediate_size, v.num_topk, v.num_experts,
                                                    v.num_ranks, v.numerics)
                  == (hidden, inter, topk, num_local_experts, 1, numerics)}
        for block_m in sorted(set(implemented_block_m(numerics)) - picked):
            stages = default_num_stages(block_m, num_local_experts, hidden, inter, numerics=numerics)
            variants.append(KernelVariant(hidden, inter, topk, num_local_experts, 1, block_m, stages, True, numerics))
    return variants
