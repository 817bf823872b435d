"""DeepSeek-V4 checkpoints on megamoe_sm90 in real vLLM on a CPU: the plugin's `deepseek_v4_fp8`
config hands a MoE layer whose routed experts are MXFP4 (expert_dtype "fp4") a method that loads
them in vLLM's MXFP4 layout and keeps them at 4 bits in the kernel's layout (fast numerics), or
re-encodes them exactly as the FP8 blocks the kernel reads (exact numerics). The forward runs the
float32 reference executor, checked against a torch MoE over the weights as vLLM's own MXFP4
dequantization gives them."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from conftest import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK, build_moe  # noqa: E402
from contract_oracle import quant_dequant_rows  # noqa: E402


def _v4_config_class():
    import vllm.model_executor.layers.quantization as quant_mod

    if "deepseek_v4_fp8" not in quant_mod.QUANTIZATION_METHODS:
        pytest.skip("this vLLM has no DeepSeek-V4")
    return quant_mod.get_quantization_config("deepseek_v4_fp8")


def _v4_quant_config():
    return _v4_config_class().from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128], "fmt": "e4m3"})


def _mxfp4_checkpoint(seed):
    """Per-expert MXFP4 tensors as a DeepSeek-V4 checkpoint names them (codes and E8M0 scale bits)."""
    g = torch.Generator().manual_seed(seed)
    experts, named = [], []
    for e in range(NUM_EXPERTS):
        entry = {}
        for name, (rows, cols) in (("gate_proj", (INTERMEDIATE, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN)),
                                   ("down_proj", (HIDDEN, INTERMEDIATE))):
            codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.int32).to(torch.uint8)
            bits = torch.randint(118, 124, (rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
            entry[name] = (codes, bits)
            named += [(f"{e}.{name}.weight", codes), (f"{e}.{name}.weight_scale", bits)]
        experts.append(entry)
    return experts, named


def _vllm_dequant(codes, bits):
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _dequant_mxfp4_ue8m0_gran32

    return _dequant_mxfp4_ue8m0_gran32(codes, bits.view(torch.float8_e8m0fnu)).float()


def _torch_moe(x, logits, experts):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, TOPK, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    a = quant_dequant_rows(x)
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for k in range(TOPK):
            e = experts[int(ids[t, k])]
            gate, up = a[t] @ _vllm_dequant(*e["gate_proj"]).T, a[t] @ _vllm_dequant(*e["up_proj"]).T
            act = quant_dequant_rows((F.silu(gate) * up * weights[t, k]).unsqueeze(0))[0]
            out[t] += (act @ _vllm_dequant(*e["down_proj"]).T).to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def test_v4_lookup_is_the_plugins_config_over_vllms(registered):
    cls = _v4_config_class()
    assert getattr(cls, "_megamoe", False) and cls.__mro__[1].__name__ == "DeepseekV4FP8Config"
    assert cls.get_name() == "deepseek_v4_fp8"


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_mxfp4_experts_load_and_run(vllm_config, dist_env, reference_executor, monkeypatch, numerics):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from megamoe_plugin.vllm_plugin.moe_method import MegaMoEMxfp4MoEMethod
    from megamoe_plugin.weights import kernel_layout_shapes

    monkeypatch.setenv("MEGAMOE_NUMERICS", numerics)

    runner = build_moe(vllm_config, quant_config=_v4_quant_config())
    ex = runner.routed_experts
    assert isinstance(ex.quant_method, MegaMoEMxfp4MoEMethod)
    assert ex.w13_weight.dtype == torch.uint8 and ex.w13_weight.shape == (NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN // 2)
    experts, named = _mxfp4_checkpoint(seed=3)
    loaded = {n.split(".")[-1] for n in runner.load_weights(named)}
    assert loaded == {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"}
    ex.quant_method.process_weights_after_loading(ex)
    if numerics == "fast":  # at 4 bits, in the kernel's tiles
        want_shape = kernel_layout_shapes("mxfp4", NUM_EXPERTS, HIDDEN, INTERMEDIATE)["w13"][0]
        assert ex.w13_weight.dtype == torch.uint8 and tuple(ex.w13_weight.shape) == want_shape
        assert ex.w13_weight_scale.dim() == 5 and not hasattr(ex, "w13_weight_scale_inv")
    else:  # the exact FP8 blocks
        assert ex.w13_weight.dtype == torch.float8_e4m3fn and not hasattr(ex, "w13_weight_scale")
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, HIDDEN, generator=g) * torch.exp(torch.randn(5, 1, generator=g))).to(torch.bfloat16)
    logits = torch.randn(5, NUM_EXPERTS, generator=g)
    with set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        y = runner.forward(x, logits)
    want = _torch_moe(x, logits, experts)
    y64, w64 = y.double(), want.double()
    assert float(1 - 2 * (y64 * w64).sum() / (y64 * y64 + w64 * w64).sum()) < 1e-5
    rel = (y64 - w64).norm(dim=1) / w64.norm(dim=1).clamp_min(1e-6)
    assert float(rel.max()) < 1e-2


def test_non_mxfp4_fp4_experts_are_refused(vllm_config, dist_env, reference_executor, monkeypatch):
    from megamoe_plugin.vllm_plugin.refusals import MegaMoEUnsupportedError

    config = _v4_quant_config()
    monkeypatch.setattr(type(config), "moe_quant_algo", property(lambda self: "NVFP4"))
    with pytest.raises(MegaMoEUnsupportedError, match="routed experts are NVFP4"):
        build_moe(vllm_config, quant_config=config)


def test_other_backends_keep_vllms_v4_moe_method(vllm_config, monkeypatch):
    """With another moe_backend the config is vLLM's (its MXFP4 method stubbed: it builds no kernels on
    a CPU)."""
    import sys
    import types

    from vllm.config import set_current_vllm_config

    from megamoe_plugin.vllm_plugin.compat import routed_experts_class

    config = _v4_quant_config()
    base_module = sys.modules[type(config).__mro__[1].__module__]
    monkeypatch.setattr(base_module, "Mxfp4MoEMethod", lambda moe_config, activation_key=None: "vllm mxfp4")
    layer = object.__new__(routed_experts_class())
    object.__setattr__(layer, "moe_config", types.SimpleNamespace(moe_backend="triton"))
    with set_current_vllm_config(vllm_config):
        assert config.get_quant_method(layer, "model.layers.0.mlp.experts") == "vllm mxfp4"
