"""`python -m megamoe_plugin.bench.startup` on a machine without a GPU: the cold start compiles the
deployment's variants into the empty folder (one small variant, really compiled: nvcc is on CI's
machine), the warm start compiles nothing, and a folder that is not empty is refused."""
import shutil
import subprocess
import sys

import pytest

from test_prebuilt import HAVE_NVCC, TINY_ARGS


def startup(*args):
    return subprocess.run([sys.executable, "-m", "megamoe_plugin.bench.startup", *TINY_ARGS, "--batch-sizes", "1",
                           "--numerics", "fast", "--gpu", "NVIDIA H100 80GB HBM3", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(not HAVE_NVCC or shutil.which("nvidia-smi") is not None,
                    reason="needs nvcc, and a machine without a GPU (the load step would run)")
def test_cold_then_warm_start(tmp_path):
    cache = tmp_path / "cache"
    proc = startup("--cache-dir", str(cache))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model: H 384, I 256, 4 experts, top-2, EP 1") and "NVIDIA H100 80GB HBM3" in lines[0]
    assert lines[1].startswith("cold start (jit --build, nvcc): ") and "1 of 1 variants built" in lines[1]
    assert lines[2].startswith("warm start (jit --build, all cached): ")
    assert lines[3] == "load: no GPU here"
    assert len([entry for entry in cache.iterdir() if entry.is_dir()]) == 1


def test_a_cache_folder_with_entries_is_refused(tmp_path):
    (tmp_path / "something").mkdir()
    proc = startup("--cache-dir", str(tmp_path))
    assert proc.returncode == 2 and "is not empty" in proc.stderr
