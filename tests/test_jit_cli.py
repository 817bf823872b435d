"""`python -m megamoe_plugin.jit --check` without nvcc: rows as variants finish, with a
count, and no runpy warning."""
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megamoe_plugin import jit, kernel_variant
from megamoe_plugin.jit import check as jit_check

PTXAS = "Compiling entry function '{name}' for 'sm_90a'\nptxas info    : Used 168 registers, 0 bytes stack frame, " \
        "{spill} bytes spill stores, 0 bytes spill loads"


def test_check_prints_each_row_as_its_variant_finishes(monkeypatch, capsys):
    variants = [kernel_variant.KernelVariant(384, 256, 2, 4, 1, bm, 2, True) for bm in (8, 16, 32)]
    others_reported = threading.Event()
    reported = []

    def fake_compile(variant, verbose=False):
        if variant.block_m == 8:  # first in the list, finishes after the others' rows are out
            assert others_reported.wait(timeout=30)
        if variant.block_m == 16:
            raise RuntimeError("nvcc failed")
        log = PTXAS.format(name=kernel_variant.KERNEL_NAME, spill=4 if variant.block_m == 8 else 0)
        return jit.CompiledKernel(variant, Path("unused.cubin"), log)

    real_compile_variants = jit.compile_variants

    def compile_variants(vs, verbose=False, on_done=None):
        def counted(variant, result):
            on_done(variant, result)  # prints the row
            reported.append(variant)
            if len(reported) == 2:
                others_reported.set()
        return real_compile_variants(vs, verbose, counted)

    monkeypatch.setattr(jit, "compile_variant", fake_compile)
    monkeypatch.setattr(jit_check, "compile_variants", compile_variants)
    monkeypatch.setattr(jit.os, "cpu_count", lambda: 4)
    failures = jit_check.check_variants(variants)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert failures == 2  # the compile error and the spilling variant
    assert [line[:5] for line in lines] == ["[1/3]", "[2/3]", "[3/3]"]
    assert variants[0].name() in lines[2] and lines[2].endswith("SPILLS")
    assert any(variants[2].name() in line and line.endswith("ok") for line in lines[:2])
    assert "compile error" in next(line for line in lines if variants[1].name() in line)


@pytest.mark.parametrize("sites, status", [
    (None, "SPILLS"),  # nvdisasm missing or unable to read the cubin: where they lie is unknown
    ([("megamoe_fused_kernel", False), ("megamoe_window_kernel", True)], "ok (spills outside the main loops)"),
    ([("megamoe_fused_kernel", False), ("megamoe_fused_kernel", True)], "SPILLS"),
])
def test_a_spill_fails_unless_every_fused_kernel_spill_lies_outside_the_main_loops(monkeypatch, capsys, sites, status):
    from megamoe_plugin.jit.spill_sites import SpillSite

    variant = kernel_variant.KernelVariant(384, 256, 2, 4, 1, 64, 2, True)
    log = PTXAS.format(name=kernel_variant.KERNEL_NAME, spill=8)
    monkeypatch.setattr(jit_check, "compile_variants", lambda vs, on_done: [
        on_done(v, jit.CompiledKernel(v, Path("k.cubin"), log)) for v in vs])
    monkeypatch.setattr(jit_check, "cubin_spill_sites", lambda cubin: None if sites is None else [
        SpillSite(function, line, "STL [R1], R2", inside) for line, (function, inside) in enumerate(sites)])
    failures = jit_check.check_variants([variant])
    row = next(line for line in capsys.readouterr().out.splitlines() if variant.name() in line)
    assert row.endswith(status) and failures == (status == "SPILLS")


def test_module_cli_runs_without_a_runpy_warning():
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "megamoe_plugin.jit", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "found in sys.modules" not in proc.stderr and "--check" in proc.stdout


@pytest.mark.parametrize("value", ["-3", "0", "x"])
def test_limit_is_a_positive_count(value, capsys):
    from megamoe_plugin.jit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--check", "--limit", value])
    assert info.value.code == 2
    assert "argument --limit: expected an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("value, needle", [
    ("-1", "argument --shared-experts: expected an integer >= 0, got '-1'"),
    ("9", "num_topk=8 routed plus num_shared_experts=9 shared slots per token is more than the kernel's 16"),
])
def test_build_refuses_shared_experts_the_kernel_cannot_take(value, needle, monkeypatch, capsys):
    from megamoe_plugin.jit.cli import main

    monkeypatch.setattr(jit, "find_toolchain", lambda: (object(), ""))
    with pytest.raises(SystemExit) as info:
        main(["--build", "--hidden", "7168", "--intermediate-size", "2048", "--num-experts", "256", "--topk", "8",
              "--shared-experts", value])
    assert info.value.code == 2 and needle in capsys.readouterr().err
