"""Build script: the Python package plus two torch-independent extensions.

The ABI extension (`megamoe_plugin._abi`) hands csrc/megamoe/abi.h's numbers to Python; it
needs a C++ compiler and pybind11 only, so it is always built. The runtime
(`megamoe_plugin._runtime`) is plain C++ built against pybind11 and the CUDA driver API
*headers* only; it loads libcuda at run time, so the same build works with any torch
version and on machines without a GPU. If no CUDA headers are found the package still
installs without it, and `fp8_mega_moe` raises a clear RuntimeError.
"""
import os
import shutil
import sys

from pybind11.setup_helpers import Pybind11Extension
from setuptools import find_packages, setup


def _cuda_include_dir():
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    candidates.append("/usr/local/cuda/include")
    for path in candidates:
        if os.path.isfile(os.path.join(path, "cuda.h")):
            return path
    return None


_CXX_FLAGS = ["-O2", "-fvisibility=hidden"]
# Both extensions compile the ABI header: a change to it rebuilds them (build_ext compares only the sources otherwise).
_ABI_HEADERS = ["csrc/megamoe/abi.h", "csrc/megamoe/params.h"]
ext_modules = [Pybind11Extension("megamoe_plugin._abi", ["csrc/abi/abi_module.cpp"], include_dirs=["csrc"], cxx_std=17,
                                 extra_compile_args=_CXX_FLAGS, depends=_ABI_HEADERS)]
cuda_include = _cuda_include_dir()
if cuda_include is not None:
    ext_modules.append(
        Pybind11Extension(
            "megamoe_plugin._runtime",
            ["csrc/runtime/runtime.cpp"],
            include_dirs=[cuda_include, "csrc"],
            cxx_std=17,
            extra_compile_args=_CXX_FLAGS,
            depends=_ABI_HEADERS,
            libraries=["dl"],
        )
    )
else:
    print("megamoe_plugin: no CUDA headers found; building without the GPU runtime", file=sys.stderr)

setup(
    name="megamoe_plugin",
    version="0.1.0",
    description="Fused expert-parallel FP8 MoE (MegaMoE) for NVIDIA Hopper, as a vLLM and SGLang plugin",
    license="Apache-2.0",
    license_files=["LICENSE"],
    # The kernel sources (JIT-compiled at run time) and the tuned config tables ship inside
    # the package, so a non-editable install (pip install --target, a wheel) finds them too;
    # megamoe_plugin/paths.py prefers these copies and falls back to the source tree.
    packages=find_packages(include=["megamoe_plugin", "megamoe_plugin.*"])
    + ["megamoe_plugin._csrc", "megamoe_plugin._configs"],
    package_dir={"megamoe_plugin._csrc": "csrc", "megamoe_plugin._configs": "configs"},
    package_data={"megamoe_plugin._csrc": ["megamoe/*"], "megamoe_plugin._configs": ["*.json"]},
    ext_modules=ext_modules,
    python_requires=">=3.10",  # sys.stdlib_module_names (tests/test_stdlib_only.py)
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # pytest-timeout: tools/gpu_check.sh bounds each GPU test with --timeout.
        # matplotlib: the benchmark's plot (tests/test_bench.py draws one from fake timings).
        "test": ["pytest>=7", "pytest-timeout>=2", "pybind11>=2.10", "setuptools>=64", "wheel", "matplotlib"],
        # megamoe-bench's plot, progress bar and SM clock sampling (timing.GpuClockSampler); all optional.
        "bench": ["matplotlib", "tqdm", "nvidia-ml-py"],
        "vllm": ["vllm>=0.24"],
        # Its own environment: sglang and vllm pin different torch versions (docs/sglang.md).
        # 0.5.17 or 0.5.23 and later 0.5.x (sglang_plugin/registration.py); pip picks the newest.
        "sglang": ["sglang>=0.5.17,<0.6,!=0.5.18,!=0.5.19,!=0.5.20,!=0.5.21,!=0.5.22"],
        "cutlass": ["nvidia-cutlass>=3.5"],
    },
    entry_points={
        "vllm.general_plugins": ["megamoe_sm90 = megamoe_plugin.vllm_plugin:register"],
        "sglang.srt.plugins": ["megamoe_sm90 = megamoe_plugin.sglang_plugin:register"],
        "console_scripts": ["megamoe-bench = megamoe_plugin.bench.cli:main"],
    },
    zip_safe=False,
)
