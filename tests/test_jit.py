"""The kernel compiles for sm_90a with nvcc (no GPU needed) for every variant the
heuristics pick for the reference configs, with zero register spills."""
import os
import shutil
import subprocess
import sys

import pytest

from megamoe_plugin import jit

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                                reason="nvcc not installed: the compile check runs where the CUDA toolkit is")


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


def test_concurrent_compiles_of_one_variant_agree(tmp_path):
    """Several ranks compiling the same variant at once (a cold cache at start-up) all get
    the one cached cubin, and no temporary build folder is left behind."""
    script = ("from megamoe_plugin import jit; "
              "print(jit.compile_variant(jit.KernelVariant(384, 256, 2, 4, 1, 64, 2, True)).cubin)")
    env = dict(os.environ, MEGAMOE_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    assert os.path.getsize(paths.pop()) > 0
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".build_")]
