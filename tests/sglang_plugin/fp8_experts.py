"""A stand-in for SGLang's FusedMoE with 128x128 block-FP8 experts, the MoE it must compute
(torch, from the contract: docs/design.md section 2), and the SM90 setting of the layer tests,
shared by the layer tests of every sglang line."""
import contextlib

import torch
import torch.nn.functional as F

from conftest import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK
from contract_oracle import dequant_blocks, quant_blocks, quant_dequant_rows

CAP = 64  # SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK in the layer tests


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


def expected(x, ids, weights, w13, s13, w2, s2):
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


def fp8_config(**overrides):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    kwargs = dict(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    kwargs.update(overrides)
    return Fp8Config(**kwargs)


@contextlib.contextmanager
def sm90_reference(monkeypatch):
    """SGLang's SM90 reading in both mega-MoE modules, the token cap, and the reference executor."""
    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    from megamoe_plugin import serving

    monkeypatch.setattr(mega_moe, "_device_sm", 90)
    monkeypatch.setattr(sm90, "_device_sm", 90)
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK", str(CAP))
    previous = serving.set_executor("reference")
    try:
        yield
    finally:
        serving.set_executor(previous)
        serving.clear_buffers()
