"""A stand-in for SGLang's FusedMoE with 128x128 block-FP8 experts (or MXFP4 ones, as SGLang stages
DeepSeek-V4's), the MoE it must compute (torch, from the contract: docs/design.md section 2), and the
SM90 setting of the layer tests, shared by the layer tests of every sglang line."""
import contextlib

import torch
import torch.nn.functional as F

from conftest import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK
from contract_oracle import dequant_blocks, quant_blocks, quant_dequant_rows

CAP = 64  # SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK in the layer tests


def _mxfp4(w):
    """MXFP4 as SGLang's Fp8MoEMethod stages FP4 experts: int8 codes [N, K/2], float32 scales [N, K/32]."""
    from megamoe_plugin.mxfp4 import quantize_mxfp4, scale_to_float

    codes, scales = quantize_mxfp4(w)
    return codes.view(torch.int8), scale_to_float(scales)


def dequant(w, s):
    """One expert's staged weight as float32: FP8 with 128x128 block scales, or MXFP4 (int8 codes)."""
    if w.dtype == torch.int8:
        from megamoe_plugin.mxfp4 import dequantize_mxfp4, scale_bits_of_float

        return dequantize_mxfp4(w.view(torch.uint8), scale_bits_of_float(s))
    return dequant_blocks(w, s)


class Experts(torch.nn.Module):
    """The FusedMoE attributes SGLang's mega-MoE path and the plugin read, with the
    checkpoint-layout parameters SGLang's Fp8MoEMethod creates for 128x128 blocks (or, with
    mxfp4=True, for FP4 experts: _mxfp4)."""

    def __init__(self, quant_config, seed=0, mxfp4=False):
        super().__init__()
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

        g = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k, self.hidden_size = NUM_EXPERTS, TOPK, HIDDEN
        self.intermediate_size_per_partition, self.moe_ep_size, self.moe_tp_size = INTERMEDIATE, 1, 1
        self.moe_runner_config = MoeRunnerConfig(activation="silu", is_gated=True)
        self._mega_moe_nvfp4 = self._mega_moe_w4a4 = False  # FP8 experts (FusedMoE sets these at load)
        self.quant_method = type("Fp8MoEMethod", (), {"quant_config": quant_config})()
        quant = _mxfp4 if mxfp4 else quant_blocks
        w13, s13, w2, s2 = [], [], [], []
        for _ in range(NUM_EXPERTS):
            q, s = quant(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g) * 0.06)
            w13.append(q), s13.append(s)
            q, s = quant(torch.randn(HIDDEN, INTERMEDIATE, generator=g) * 0.06)
            w2.append(q), s2.append(s)
        for name, t in (("w13_weight", w13), ("w13_weight_scale_inv", s13), ("w2_weight", w2),
                        ("w2_weight_scale_inv", s2)):
            self.register_parameter(name, torch.nn.Parameter(torch.stack(t), requires_grad=False))


def expected(x, ids, weights, w13, s13, w2, s2):
    """Each token through its slots' experts (ids [n, slots] into the weights' experts)."""
    xq = quant_dequant_rows(x)
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = xq[t:t + 1] @ dequant(w13[e], s13[e]).T
            act = F.silu(h[:, :INTERMEDIATE]) * h[:, INTERMEDIATE:]
            act = quant_dequant_rows(act.bfloat16().float())
            out[t] += float(weights[t, j]) * (act @ dequant(w2[e], s2[e]).T)[0]
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
    from megamoe_plugin.sglang_plugin import shared_experts

    monkeypatch.setattr(mega_moe, "_device_sm", 90)
    monkeypatch.setattr(sm90, "_device_sm", 90)
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK", str(CAP))
    previous = serving.set_executor("reference")
    try:
        yield
    finally:
        serving.set_executor(previous)
        serving.clear_buffers()
        shared_experts.forget_models()


class BlockFP8Linear(torch.nn.Module):
    """The attributes the plugin reads off SGLang's block-FP8 linear layer (its Fp8LinearMethod keeps
    the checkpoint layout on SM90): weight [rows, cols] FP8, weight_scale_inv [rows/128, cols/128]."""

    def __init__(self, rows, cols, generator, tp_size=1):
        super().__init__()
        q, s = quant_blocks(torch.randn(rows, cols, generator=generator) * 0.06)
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
        self.tp_size, self.bias = tp_size, None


class SharedMLP(torch.nn.Module):
    """DeepseekV2MLP's attributes: the block's shared experts as one MLP of intermediate n_shared * I."""

    def __init__(self, num_shared, seed=0, tp_size=1, swiglu_limit=None):
        super().__init__()
        from sglang.srt.layers.activation import SiluAndMul

        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = BlockFP8Linear(2 * num_shared * INTERMEDIATE, HIDDEN, g, tp_size)
        self.down_proj = BlockFP8Linear(HIDDEN, num_shared * INTERMEDIATE, g, tp_size)
        # SGLang's class (its forward never runs here); its __init__ reads the published server context
        self.act_fn, self.swiglu_limit = SiluAndMul.__new__(SiluAndMul), swiglu_limit
        torch.nn.Module.__init__(self.act_fn)

    def checkpoint(self):
        return [p.data.clone() for p in (self.gate_up_proj.weight, self.gate_up_proj.weight_scale_inv,
                                         self.down_proj.weight, self.down_proj.weight_scale_inv)]


def shared_expected(x, gate_up, gate_up_scale, down, down_scale):
    """The shared MLP as the contract computes a shared expert: quantized rows in, the SwiGLU output
    requantized in groups of 128 channels (the same groups whole or split into experts of I)."""
    h = quant_dequant_rows(x) @ dequant_blocks(gate_up, gate_up_scale).T
    half = h.shape[1] // 2
    act = quant_dequant_rows((F.silu(h[:, :half]) * h[:, half:]).bfloat16().float())
    return act @ dequant_blocks(down, down_scale).T


class Block(torch.nn.Module):
    """The DeepSeek-V2 MoE block attributes SGLang's mega-MoE forward and the plugin read; its router
    gives fixed top-k ids and weights, and it counts its own shared-expert forwards."""

    def __init__(self, experts, shared, ids, weights, routed_scaling_factor=2.5):
        super().__init__()
        self.experts, self.shared_experts = experts, shared
        self.layer_id, self.is_hash, self.num_fused_shared_experts = 0, False, 0
        self.mega_shared_l1_weights = self.mega_shared_l2_weights = None
        self.routed_scaling_factor, self.routed_scaling_factor_fused_in_topk = routed_scaling_factor, False
        self.config = type("Cfg", (), dict(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                          num_experts_per_tok=TOPK, swiglu_limit=None))()
        self.gate = lambda hidden_states, forward_batch=None: None
        self.topk = lambda hidden_states, logits, **kwargs: type("TopK", (), dict(
            topk_ids=ids[:hidden_states.shape[0]], topk_weights=weights[:hidden_states.shape[0]]))()
        self.shared_forwards = 0
        self.shared_checkpoint = shared.checkpoint()

    def _forward_shared_experts(self, hidden_states):
        self.shared_forwards += 1
        return shared_expected(hidden_states.float(), *self.shared_checkpoint).bfloat16()


def routing(n, seed=1):
    """n random BF16 tokens, their top-k ids and weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(n)]).int()
    return x, ids, torch.rand(n, TOPK, generator=g)


def load_model(blocks):
    """The plugin's ModelRunner.load_model hook over a model of these blocks (SGLang's own load,
    which built the experts' weights through the weight-build hook, stands in as done)."""
    from megamoe_plugin.sglang_plugin import layer

    runner = type("ModelRunner", (), {"model": torch.nn.ModuleList(blocks)})()
    assert layer.load_model(lambda r: "loaded", runner) == "loaded"


def built_experts(seed):
    """Experts whose weights the weight-build hook put in the kernel layout, and their checkpoint."""
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    experts = Experts(fp8_config(), seed=seed)
    ckpt = [p.data.clone() for p in (experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight,
                                     experts.w2_weight_scale_inv)]
    sm90.build_sm90_mega_moe_experts_weights(experts)
    return experts, ckpt
