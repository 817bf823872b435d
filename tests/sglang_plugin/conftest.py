"""Fixtures for the SGLang plugin tests (CPU machine, real sglang package).

sglang pins another torch than vllm, so these tests run in their own environment (README:
the second test command); in an environment without sglang every test here is skipped,
with that reason. The folder is not named `sglang`: tests/ is on sys.path (tests/conftest.py),
so a tests/sglang folder is a namespace package `sglang` that find_spec finds where the real one
is missing (CI's main environment collected these tests and failed them that way).
"""
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_REASON = ("sglang is not installed: the SGLang plugin tests run in their own environment "
               "(README, 'SGLang tests')")

# The plugin has other hook points on sglang 0.5.17 (registration.SIGNATURES_0_5_17): those
# tests run where sglang 0.5.17 is installed (README, "SGLang tests"), the others elsewhere.
SGLANG_VERSION = importlib.metadata.version("sglang") if HAVE_SGLANG else None
ON_0_5_17 = SGLANG_VERSION == "0.5.17"
_INSTALLED = f"sglang {SGLANG_VERSION} is installed" if HAVE_SGLANG else "sglang is not installed"
only_0_5_17 = pytest.mark.skipif(not ON_0_5_17, reason=f"needs sglang 0.5.17 (its own hook points); {_INSTALLED}")
not_0_5_17 = pytest.mark.skipif(ON_0_5_17, reason=f"needs sglang >= 0.5.23 (its hook points); {_INSTALLED}")

# The vLLM tests' fixture model (config only): a Qwen3-MoE with 128x128 block-FP8 experts.
FIXTURE_MODEL = Path(__file__).resolve().parents[1] / "vllm_plugin" / "fixtures" / "tiny_fp8_moe"
# A DeepSeek-V3 of the same expert shapes (config only): sglang 0.5.17's mega-MoE models.
DEEPSEEK_FIXTURE_MODEL = Path(__file__).resolve().parent / "fixtures" / "tiny_fp8_deepseek_v3"
NUM_EXPERTS, TOPK, HIDDEN, INTERMEDIATE = 8, 2, 256, 128


def pytest_collection_modifyitems(config, items):
    if HAVE_SGLANG:
        return
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def registered():
    from megamoe_plugin.sglang_plugin import refusals, register, registration

    register()
    assert refusals.incompatibility() is None, refusals.incompatibility()
    return registration
