"""The kernel compiles for sm_90a with nvcc (no GPU needed) for every variant the
heuristics pick for the reference configs, with zero register spills."""
import os
import shutil
import subprocess
import sys

import pytest

from megamoe_plugin import jit, kernel_variant
from megamoe_plugin.jit import check as jit_check

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                                reason="nvcc not installed: the compile check runs where the CUDA toolkit is")


def test_reference_variants_compile_without_spills(tmp_path, monkeypatch, capsys):
    # A temporary cache: every variant is compiled afresh, and the user's own cache
    # (~/.cache/megamoe_plugin, or their MEGAMOE_CACHE_DIR) is neither filled nor read.
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    variants = jit_check.reference_variants()
    assert variants, "the heuristics picked no variant"
    failures = jit_check.check_variants(variants)
    out = capsys.readouterr().out
    print(out)
    assert failures == 0, out


def test_reference_variants_cover_every_tier_of_each_reference_shape():
    """MEGAMOE_BLOCK_M can force any implemented tier on a reference shape (measuring
    tiers): the compile check covers each, not only the tiers the heuristics pick."""
    from megamoe_plugin.configs import REFERENCE_SHAPES
    from megamoe_plugin.heuristics import NUMERICS_MODES, implemented_block_m

    variants = jit_check.reference_variants()
    for shape in REFERENCE_SHAPES.values():
        for numerics in NUMERICS_MODES:
            tiers = {v.block_m for v in variants
                     if (v.hidden, v.intermediate_size, v.num_topk, v.num_experts, v.num_ranks, v.numerics)
                     == (shape.hidden, shape.intermediate_size, shape.num_topk, shape.num_local_experts, 1, numerics)}
            assert tiers == set(implemented_block_m(numerics)), (shape, numerics)


def test_cache_key_changes_with_variant():
    a = kernel_variant.KernelVariant(4096, 2048, 6, 32, 1, 64, 5, True)
    b = kernel_variant.KernelVariant(4096, 2048, 6, 32, 1, 64, 5, False)
    assert jit.cache_key(a) != jit.cache_key(b)
    assert jit.cache_key(a) == jit.cache_key(a)


def test_concurrent_compiles_of_one_variant_agree(tmp_path):
    """Several ranks compiling the same variant at once (a cold cache at start-up) all get
    the one cached cubin, and no temporary build folder is left behind."""
    script = ("from megamoe_plugin import jit, kernel_variant; "
              "print(jit.compile_variant(kernel_variant.KernelVariant(384, 256, 2, 4, 1, 64, 2, True)).cubin)")
    env = dict(os.environ, MEGAMOE_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    assert os.path.getsize(paths.pop()) > 0
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".build_")]


def test_compile_variants_keeps_order_runs_at_once_and_returns_errors(monkeypatch):
    """compile_variants overlaps the compiles (start-up with several tiers), keeps the
    order of its input and hands back a failed compile's error in its place."""
    import threading
    import time

    variants = [kernel_variant.KernelVariant(384, 256, 2, 4, 1, bm, 2, True) for bm in (8, 16, 32, 64)]
    running, peak, lock = [0], [0], threading.Lock()

    def fake_compile(variant, verbose=False):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        if variant.block_m == 16:
            raise RuntimeError("nvcc failed")
        return variant.block_m

    monkeypatch.setattr(jit, "compile_variant", fake_compile)
    monkeypatch.setattr(jit.os, "cpu_count", lambda: 4)
    done = []
    results = jit.compile_variants(variants, on_done=lambda v, result: done.append((v, result)))
    assert [r if not isinstance(r, RuntimeError) else "error" for r in results] == [8, "error", 32, 64]
    assert sorted(v.block_m for v, _ in done) == [8, 16, 32, 64]
    assert all(result is results[variants.index(v)] for v, result in done)
    assert peak[0] > 1


@pytest.mark.parametrize("code, reason", [
    ("C7518", "program dependence on compiler-inserted WG.DP in divergent path"),
    ("C7511", "insufficient register resources for the wgmma pipeline"),  # results round 12
])
def test_parse_ptxas_flags_serialized_wgmma(code, reason):
    """ptxas serializing the WGMMAs (any of its codes) fails the compile check like a spill: it
    silently runs the tensor pipe one WGMMA at a time (csrc/megamoe/mma.cuh says what caused it once)."""
    clean = ("ptxas info    : Compiling entry function 'megamoe_fused_kernel' for 'sm_90a'\n"
             "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
             "ptxas info    : Used 168 registers, used 1 barriers\n")
    serialized = (f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                  f"due to {reason} in the function 'megamoe_fused_kernel'\n" + clean)
    assert not jit_check.parse_ptxas(clean).wgmma_serialized
    usage = jit_check.parse_ptxas(serialized)
    assert usage.wgmma_serialized == code
    assert usage.wgmma_serialized and usage.registers == 168 and usage.spill_stores == 0


def test_parse_ptxas_reads_each_entry_of_a_windowed_variant():
    """A windowed variant's cubin has two entries (the fused kernel, the window kernel): each one's
    usage and serialization notes are its own, so the window kernel's spills (which the compile
    check shows but does not fail) never pass for the fused kernel's."""
    log = (f"ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           f"to insufficient register resources for the function '{kernel_variant.WINDOW_KERNEL_NAME}'\n"
           f"ptxas info    : Compiling entry function '{kernel_variant.WINDOW_KERNEL_NAME}' for 'sm_90a'\n"
           "    392 bytes stack frame, 780 bytes spill stores, 788 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 3 barriers, 392 bytes cumulative stack size\n"
           f"ptxas info    : Compiling entry function '{kernel_variant.KERNEL_NAME}' for 'sm_90a'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 166 registers, used 3 barriers\n")
    fused, window = jit_check.parse_ptxas(log), jit_check.parse_ptxas(log, kernel_variant.WINDOW_KERNEL_NAME)
    assert (fused.registers, fused.spill_stores, fused.wgmma_serialized) == (166, 0, "")
    assert (window.registers, window.spill_stores, window.spill_loads, window.wgmma_serialized) == (168, 780, 788, "C7512")


def test_code_only_drops_comments_and_blanks_but_keeps_literals_and_lines():
    from megamoe_plugin.jit.cpp_text import code_only

    text = ('#include "megamoe/abi.h"  // the ABI\n'
            '\n'
            'int  a = 1;\t/* two\n'
            '   lines */ int b;\n'
            'const char* s = "// kept,   as /* is */ this";  char q = \'\\\'\';  // a \'quote\'\n'
            '#define TWO(x) \\\n'
            '    (x + x)  // continued \\\n'
            'still the comment\n')
    assert code_only(text) == ('#include "megamoe/abi.h"\n'
                               'int a = 1; int b;\n'
                               'const char* s = "// kept,   as /* is */ this"; char q = \'\\\'\';\n'
                               '#define TWO(x) \\\n'
                               '(x + x)')
    assert code_only("a / b") == "a / b" and code_only("x = 'a") == "x = 'a"


def test_the_cache_key_ignores_comments_and_whitespace_in_the_sources(tmp_path):
    source = jit.CSRC_DIR / "megamoe"
    copy = tmp_path / "megamoe"
    copy.mkdir()
    for path in source.glob("*"):
        (copy / path.name).write_text(path.read_text())
    assert jit.sources_digest(copy) == jit._sources_digest()
    smem = copy / "smem.cuh"
    smem.write_text("// a new comment\n" + smem.read_text().replace("\n", "  \n\n").replace("  int", "\tint"))
    assert jit.sources_digest(copy) == jit._sources_digest()
    smem.write_text(smem.read_text().replace("kSmemBytes", "kSmemBytez"))
    assert jit.sources_digest(copy) != jit._sources_digest()
