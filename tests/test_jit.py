"""The kernel compiles for sm_90a with nvcc (no GPU needed) for every variant the
heuristics pick for the reference configs, with zero register spills and no stack."""
import shutil

import pytest

from megamoe_plugin import jit

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None and not __import__("os").path.exists(
    "/usr/local/cuda/bin/nvcc"), reason="nvcc not installed: the compile check runs where the CUDA toolkit is")


def test_reference_variants_compile_without_spills(tmp_path_factory, monkeypatch, capsys):
    variants = jit.reference_variants()
    assert variants, "the heuristics picked no variant"
    failures = jit.check_variants(variants)
    out = capsys.readouterr().out
    print(out)
    assert failures == 0, out


def test_cache_key_changes_with_variant():
    nvcc = jit.find_nvcc()
    a = jit.KernelVariant(4096, 2048, 6, 32, 1, 64, 5, True)
    b = jit.KernelVariant(4096, 2048, 6, 32, 1, 64, 5, False)
    assert jit.cache_key(a, nvcc) != jit.cache_key(b, nvcc)
    assert jit.cache_key(a, nvcc) == jit.cache_key(a, nvcc)
