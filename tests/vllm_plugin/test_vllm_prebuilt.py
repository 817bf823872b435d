"""Where nvcc is missing (a serving container), model load refuses a MoE layer whose kernel
variants the cache lacks, and names the --build command; with them pre-built it loads."""
import shlex

import pytest

pytest.importorskip("vllm")

from conftest import build_moe  # noqa: E402
from test_vllm_refusals import FakeProbe, _refused, kernel_executor  # noqa: E402,F401

from megamoe_plugin.variants import deployment_variants  # noqa: E402
from megamoe_plugin.model_config import MoEShape  # noqa: E402
from megamoe_plugin.vllm_plugin import refusals  # noqa: E402


def test_missing_prebuilt_variants_are_refused_at_load(vllm_config, dist_env, kernel_executor, jit_cache, fake_build,
                                                       monkeypatch, request):
    monkeypatch.delenv("MEGAMOE_NUMERICS", raising=False)
    monkeypatch.setattr(refusals, "_layer_variants", {})
    with refusals.override_probe(FakeProbe(name="NVIDIA H100 80GB HBM3")):
        runtime = build_moe(vllm_config).routed_experts.quant_method.runtime  # nvcc is here: no check
        shape = MoEShape(runtime.hidden, runtime.intermediate, runtime.num_experts, runtime.topk)
        needed = deployment_variants(shape, 1, range(runtime.max_tokens + 1), "NVIDIA H100 80GB HBM3", ("fast",))
        assert len(needed) > 1
        request.getfixturevalue("no_nvcc")
        for variant in needed[1:]:
            fake_build(variant)
        message = _refused(lambda: build_moe(vllm_config), f"1 of the {len(needed)} kernel variants",
                           needed[0].name(), str(jit_cache), "nvcc not found")
        command = message[message.index("python -m megamoe_plugin.jit --build"):]
        argv = shlex.split(command)
        assert argv[argv.index("--batch-sizes") + 1] == f"0-{runtime.max_tokens}"
        assert argv[argv.index("--gpu") + 1] == "NVIDIA H100 80GB HBM3"
        assert argv[argv.index("--hidden") + 1] == str(shape.hidden)
        fake_build(needed[0])
        build_moe(vllm_config)  # every variant pre-built: accepted
