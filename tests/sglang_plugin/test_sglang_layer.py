"""A megamoe_sm90 MoE layer on SGLang's real SM90 mega-MoE path, on a CPU.

What CPU allows: SGLang's FusedMoE needs its distributed state and CUDA to be constructed,
so the layer here is a module with the FusedMoE attributes the path reads and SGLang's own
Fp8Config; everything else is SGLang's code with the plugin's hooks: the weight build
(`build_sm90_mega_moe_experts_weights`) and the forward (`run_mega_routed_experts`, which
asks for the buffer and calls `run_sm90_mega_routed`). The float32 reference stands in for
the kernel (executor "reference"); the output is checked against a torch computation of
the MoE written here from the contract (docs/design.md section 2).
"""
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK
from contract_oracle import FP8, dequant_blocks, quant_blocks, quant_dequant_rows  # noqa: E402

CAP = 64  # SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK


class Experts(torch.nn.Module):
    """The FusedMoE attributes SGLang's mega-MoE path and the plugin read, with the
    checkpoint-layout parameters SGLang's Fp8MoEMethod creates for 128x128 blocks."""

    def __init__(self, quant_config, seed=0):
        super().__init__()
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

        g = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k, self.hidden_size = NUM_EXPERTS, TOPK, HIDDEN
        self.intermediate_size_per_partition, self.moe_ep_size, self.moe_tp_size = INTERMEDIATE, 1, 1
        self.moe_runner_config = MoeRunnerConfig(activation="silu", is_gated=True)
        self._mega_moe_nvfp4 = self._mega_moe_w4a4 = False  # FP8 experts (FusedMoE sets these at load)
        self.quant_method = type("Fp8MoEMethod", (), {"quant_config": quant_config})()
        w13, s13, w2, s2 = [], [], [], []
        for _ in range(NUM_EXPERTS):
            q, s = quant_blocks(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g) * 0.06)
            w13.append(q), s13.append(s)
            q, s = quant_blocks(torch.randn(HIDDEN, INTERMEDIATE, generator=g) * 0.06)
            w2.append(q), s2.append(s)
        for name, t in (("w13_weight", w13), ("w13_weight_scale_inv", s13), ("w2_weight", w2),
                        ("w2_weight_scale_inv", s2)):
            self.register_parameter(name, torch.nn.Parameter(torch.stack(t), requires_grad=False))


def _expected(x, ids, weights, w13, s13, w2, s2):
    xq = quant_dequant_rows(x)
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for j in range(TOPK):
            e = int(ids[t, j])
            h = xq[t:t + 1] @ dequant_blocks(w13[e], s13[e]).T
            act = F.silu(h[:, :INTERMEDIATE]) * h[:, INTERMEDIATE:]
            act = quant_dequant_rows(act.bfloat16().float())
            out[t] += float(weights[t, j]) * (act @ dequant_blocks(w2[e], s2[e]).T)[0]
    return out


@pytest.fixture
def selected_on_sm90(registered, monkeypatch):
    """Published server arguments selecting the backend, SGLang's SM90 reading, the token
    cap, one EP rank, and the reference executor."""
    import argparse

    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.server_args import ServerArgs

    from conftest import FIXTURE_MODEL
    from megamoe_plugin import serving

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", str(FIXTURE_MODEL),
                                                       "--moe-runner-backend", "megamoe_sm90"]))
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    one_rank = type("Parallel", (), {"moe_ep_group": type("G", (), {"device_group": None})()})()
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: one_rank)
    monkeypatch.setattr(mega_moe, "_device_sm", 90)
    monkeypatch.setattr(sm90, "_device_sm", 90)
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK", str(CAP))
    previous = serving.set_executor("reference")
    yield
    serving.set_executor(previous)
    serving.clear_buffers()


def _fp8_config(**overrides):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    kwargs = dict(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    kwargs.update(overrides)
    return Fp8Config(**kwargs)


def test_weights_are_transformed_in_place_and_the_forward_matches_the_contract(selected_on_sm90):
    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    import megamoe_plugin as mm

    experts = Experts(_fp8_config())
    ckpt = [p.data.clone() for p in (experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight,
                                     experts.w2_weight_scale_inv)]
    params = [experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight, experts.w2_weight_scale_inv]
    sm90.build_sm90_mega_moe_experts_weights(experts)

    (k13, ks13), (k2, ks2) = mm.transform_weights((ckpt[0], ckpt[1]), (ckpt[2], ckpt[3]))
    for param, want in zip(params, (k13, ks13, k2, ks2)):
        assert torch.equal(param.data.view(torch.uint8) if param.dtype == FP8 else param.data,
                           want.view(torch.uint8) if want.dtype == FP8 else want)
    assert experts.mega_l1_weights[0].data_ptr() == experts.w13_weight.data_ptr()  # no second copy
    assert experts.mega_l2_weights[1].data_ptr() == experts.w2_weight_scale_inv.data_ptr()
    assert mega_moe.is_mega_moe_experts_ready(experts)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(5)]).int()
    weights = torch.rand(5, TOPK, generator=g)
    y = mega_moe.run_mega_routed_experts(experts, x, ids, weights, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                         top_k=TOPK, num_tokens=5, routed_scaling_factor=2.0)
    assert y.shape == (5, HIDDEN) and y.dtype == torch.bfloat16
    want = _expected(x.float(), ids, 2.0 * weights, *ckpt)
    rel = ((y.float() - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel

    # Zero local tokens still take part (every EP rank joins every step).
    empty = mega_moe.run_mega_routed_experts(experts, x[:0], None, None, hidden_size=HIDDEN,
                                             intermediate_size=INTERMEDIATE, top_k=TOPK, num_tokens=0)
    assert empty.shape == (0, HIDDEN)


@pytest.mark.parametrize("overrides, message", [
    (dict(weight_block_size=None), "per-tensor scales"),
    (dict(weight_block_size=[64, 64]), "weight_block_size=[64, 64]"),
    (dict(is_checkpoint_fp8_serialized=False), "online FP8 quantization"),
])
def test_non_block_fp8_is_refused_at_weight_build(selected_on_sm90, overrides, message):
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    experts = Experts(_fp8_config())
    experts.quant_method.quant_config = type("Cfg", (), dict(
        dict(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128]),
        **overrides))()
    with pytest.raises(MegaMoEUnsupportedError, match=re.escape(message)) as info:
        sm90.build_sm90_mega_moe_experts_weights(experts)
    assert str(info.value).startswith("--moe-runner-backend megamoe_sm90: ")
    assert not getattr(experts, "_mega_moe_weights_built", False)


@pytest.mark.parametrize("attr, value, message", [
    ("hidden_size", 320, "hidden size 320 is not a multiple of 128"),
    ("top_k", 0, "top-k 0 is outside"),
    ("moe_tp_size", 2, "the MoE layer is tensor-parallel"),
    ("moe_ep_size", 3, "the EP group has 3 ranks"),
])
def test_shapes_out_of_limits_are_refused(selected_on_sm90, attr, value, message):
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    experts = Experts(_fp8_config())
    setattr(experts, attr, value)
    with pytest.raises(MegaMoEUnsupportedError, match=re.escape(message)):
        sm90.build_sm90_mega_moe_experts_weights(experts)


def test_the_kernel_executor_refuses_a_device_that_is_not_sm90(selected_on_sm90, monkeypatch):
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    from megamoe_plugin import serving
    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    serving.set_executor("kernel")
    with pytest.raises(MegaMoEUnsupportedError, match=r"SM90 GPUs .* only, this process has no CUDA device"):
        monkeypatch.setattr(sm90, "_device_sm", 0)
        sm90.build_sm90_mega_moe_experts_weights(Experts(_fp8_config()))
