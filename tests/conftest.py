"""Fixtures of the kernel cache for tests in every folder (tests/vllm_plugin included): a
temporary cache, nvcc hidden, and cache entries laid out as a build leaves them."""
import os

import pytest


@pytest.fixture
def jit_cache(tmp_path, monkeypatch):
    """An empty MEGAMOE_CACHE_DIR, and the selection's environment switches unset."""
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("MEGAMOE_BLOCK_M", "MEGAMOE_NUM_STAGES", "MEGAMOE_CONFIGS_DIR"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def no_nvcc(tmp_path, monkeypatch):
    """A machine without the CUDA toolkit: PATH without nvcc, CUDA_HOME and MEGAMOE_NVCC
    unset, nothing in the standard place."""
    from megamoe_plugin import jit

    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if not os.path.exists(os.path.join(d, "nvcc"))]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("MEGAMOE_NVCC", raising=False)
    monkeypatch.setattr(jit, "STANDARD_CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(RuntimeError, match="nvcc not found"):
        jit.find_nvcc()
    return tmp_path / "no-cuda"


@pytest.fixture
def fake_build():
    """fake_build(variant, toolchain folder name): a cache entry as a build leaves it, with a
    stand-in cubin (what is under test is the lookup, which reads only that it exists)."""
    from megamoe_plugin import jit

    def make(variant, toolchain_name="nvcc12.8.93-cutlass4.2.0"):
        build = jit.entry_dir(variant) / toolchain_name
        build.mkdir(parents=True)
        (build / "kernel.cubin").write_bytes(b"\x7fELF" + toolchain_name.encode())
        return build

    return make
