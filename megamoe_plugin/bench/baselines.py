"""The MoE a user would run instead of megamoe, timed beside it: vLLM's Triton fused MoE
(`fused_experts` with 128x128 block-FP8 weights) where vllm is importable, else an
unfused torch path over the same checkpoint-layout weights:

    per-token-group FP8 quant of the BF16 input
    per expert: L1 GEMM (FP8, block scales), SwiGLU times the routing weight, FP8 requant
                per 128 columns, L2 GEMM, BF16
    combine: the float32 sum of each token's slots

Its GEMMs are torch._scaled_mm with 1x128 activation and 128x128 weight block scales
where this torch and GPU run them (checked against the dequantized product at set-up),
else BF16 matmuls of the weights dequantized once. Every baseline takes (hidden_states
bf16 [n, H], topk_ids int32 [n, K], topk_weights float32 [n, K]) and returns bf16 [n, H]: the ids
as vLLM's router gives them, so the caller casts its routing once, outside the timed call.

A shared-expert model's shared experts, the way vLLM runs them beside its MoE: one MLP of
intermediate size S*I for the model's S shared experts of I (merge_shared_experts), through
vLLM's block-FP8 linear layers (shared_expert_mlp). It takes bf16 [n, H] and returns bf16 [n, H].
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..fp8 import dequantize_per_token_group, dequantize_weight_blocks, quantize_per_token_group, requantize_groups

BLOCK = 128
BASELINES = ("auto", "vllm", "torch", "none")

# gemm(a fp8 [M, K], a_sf f32 [M, K/128], expert index, which of "w13" / "w2") -> float32 [M, N]
Gemm = Callable[[torch.Tensor, torch.Tensor, int, str], torch.Tensor]


class UnfusedTorchMoE:
    """The unfused torch path of the module docstring, for one GPU's (or CPU's) experts."""

    def __init__(self, checkpoint: Dict[str, torch.Tensor], use_scaled_mm: Optional[bool] = None):
        """use_scaled_mm: None tries torch._scaled_mm's block scales and falls back to
        dequantized BF16 matmuls (`self.gemm_name` says which, and why)."""
        self.checkpoint = checkpoint
        self.num_experts = checkpoint["w13"].shape[0]
        self._dequantized: Dict[str, torch.Tensor] = {}
        self.scale_layout, problem = (None, "not tried") if use_scaled_mm is False else find_scale_layout(checkpoint)
        if use_scaled_mm and self.scale_layout is None:
            raise RuntimeError(f"torch._scaled_mm with block scales does not run here: {problem}")
        if self.scale_layout is not None:
            self.gemm: Gemm = self._scaled_mm_gemm
            self.gemm_name = "torch._scaled_mm, block scales"
        else:
            self.gemm = self._dequantized_gemm
            self.gemm_name = "BF16 matmuls of dequantized weights" + (
                "" if use_scaled_mm is False else f" (torch._scaled_mm: {problem})")

    def _scaled_mm_gemm(self, a, a_sf, expert, name):
        w, w_sf = self.checkpoint[name][expert], self.checkpoint[f"{name}_scale"][expert]
        return _block_scaled_mm(a, a_sf, w, w_sf, self.scale_layout).float()

    def _dequantized_gemm(self, a, a_sf, expert, name):
        if name not in self._dequantized:  # once: every call reads the same weights
            w, w_sf = self.checkpoint[name], self.checkpoint[f"{name}_scale"]
            self._dequantized[name] = torch.stack([dequantize_weight_blocks(w[e], w_sf[e]).to(torch.bfloat16)
                                                   for e in range(self.num_experts)])
        a = dequantize_per_token_group(a, a_sf).to(torch.bfloat16)
        return (a @ self._dequantized[name][expert].T).float()

    def __call__(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> torch.Tensor:
        num_tokens, topk = topk_ids.shape
        x, x_sf = quantize_per_token_group(hidden_states)
        y = torch.zeros(num_tokens, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
        slots = topk_ids.reshape(-1)
        by_expert = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots + 1, minlength=self.num_experts + 1).tolist()  # slot -1 first
        weights = topk_weights.reshape(-1)
        for expert, entries in enumerate(torch.split(by_expert, counts)[1:]):
            if entries.numel() == 0:
                continue
            tokens = entries // topk
            gate, up = self.gemm(x[tokens], x_sf[tokens], expert, "w13").chunk(2, dim=1)
            act, act_sf = requantize_groups(F.silu(gate) * up * weights[entries].unsqueeze(1), BLOCK)
            y.index_add_(0, tokens, self.gemm(act, act_sf, expert, "w2").to(torch.bfloat16).float())
        return y.to(torch.bfloat16)


# How the scales are laid out for torch._scaled_mm: (a's [M, K/128] scales column-major,
# w's [K/128, N/128] scales contiguous). torch's blockwise kernels want particular strides and
# their documentation does not say which, so set-up tries each and keeps the first that is right.
SCALE_LAYOUTS = ((True, False), (True, True), (False, False), (False, True))


def _block_scaled_mm(a, a_sf, w, w_sf, layout: Tuple[bool, bool]) -> torch.Tensor:
    """a [M, K] @ w[N, K].T with a's 1x128 and w's 128x128 block scales, in one GEMM."""
    a_col_major, b_contiguous = layout
    scale_a = a_sf.t().contiguous().t() if a_col_major else a_sf.contiguous()
    scale_b = w_sf.t().contiguous() if b_contiguous else w_sf.t()
    return torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def find_scale_layout(checkpoint: Dict[str, torch.Tensor]) -> Tuple[Optional[Tuple[bool, bool]], str]:
    """(the first SCALE_LAYOUTS entry with which _block_scaled_mm runs here and agrees with the
    dequantized product on the first expert's L1 weights at two row counts, ""), or (None,
    what went wrong)."""
    w, w_sf = checkpoint["w13"][0], checkpoint["w13_scale"][0]
    if not w.is_cuda:
        return None, "needs a CUDA device"
    gen = torch.Generator(device=w.device).manual_seed(0)
    wanted = dequantize_weight_blocks(w, w_sf)
    samples = [quantize_per_token_group(torch.randn(rows, w.shape[1], device=w.device, generator=gen))
               for rows in (1, 130)]
    problem = ""
    for layout in SCALE_LAYOUTS:
        try:
            errors = []
            for a, a_sf in samples:
                expected = dequantize_per_token_group(a, a_sf) @ wanted.T
                got = _block_scaled_mm(a, a_sf, w, w_sf, layout).float()
                errors.append(((got - expected).norm() / expected.norm()).item())
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            problem = (str(exc).splitlines() or [type(exc).__name__])[0]
            continue
        if max(errors) < 1e-2:
            return layout, ""
        problem = f"relative error {max(errors):.1e} against the dequantized product"
    return None, problem


def _vllm_moe_as_baseline(moe: Callable) -> Callable:
    """A vLLM MoE call taking (hidden_states, topk_weights=, topk_ids=) as the baselines are called:
    (hidden_states, topk_ids, topk_weights). Ids of another dtype are refused rather than cast, since
    a cast would be timed with the baseline."""
    def run(hidden_states, topk_ids, topk_weights):
        if topk_ids.dtype != torch.int32:
            raise TypeError(f"topk_ids must be int32, as vLLM's router gives them; got {topk_ids.dtype}")
        return moe(hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)

    return run


def vllm_triton_moe(checkpoint: Dict[str, torch.Tensor]) -> Callable:
    """vLLM's fused_experts(hidden, topk_weights, topk_ids) with these checkpoint weights."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    quant = fp8_w8a8_moe_quant_config(w1_scale=checkpoint["w13_scale"], w2_scale=checkpoint["w2_scale"],
                                      block_shape=[BLOCK, BLOCK])
    return _vllm_moe_as_baseline(
        functools.partial(fused_experts, w1=checkpoint["w13"], w2=checkpoint["w2"], quant_config=quant))


def vllm_marlin_mxfp4_moe(checkpoint: Dict[str, torch.Tensor]) -> Callable:
    """vLLM's Marlin MoE (MXFP4 weights, BF16 activations: the path vLLM takes for MXFP4 experts on
    Hopper) with these checkpoint weights (uint8 codes, E8M0 scales; w13 = gate rows, then up rows),
    repacked for it once here."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_moe_mxfp4_layer_for_marlin
    from vllm.scalar_type import scalar_types

    w13, w2, w13_scale, w2_scale, _, _ = prepare_moe_mxfp4_layer_for_marlin(
        SimpleNamespace(params_dtype=torch.bfloat16), checkpoint["w13"], checkpoint["w2"], checkpoint["w13_scale"],
        checkpoint["w2_scale"], None, None)
    return _vllm_moe_as_baseline(
        functools.partial(fused_marlin_moe, w1=w13, w2=w2, bias1=None, bias2=None, w1_scale=w13_scale,
                          w2_scale=w2_scale, quant_type_id=scalar_types.float4_e2m1f.id,
                          global_num_experts=w13.shape[0]))


def make_baseline(which: str, checkpoint: Dict[str, torch.Tensor]) -> Tuple[Optional[Callable], str]:
    """(the baseline to time, its name) for --baseline `which` (BASELINES); (None, "none")
    for none. "auto" is vLLM's Triton MoE where vllm is importable, else the torch path."""
    if which not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {which!r}")
    if which == "none":
        return None, "none"
    if which == "vllm" or (which == "auto" and importlib.util.find_spec("vllm") is not None):
        return vllm_triton_moe(checkpoint), "vLLM Triton fused MoE"
    torch_moe = UnfusedTorchMoE(checkpoint)
    return torch_moe, f"unfused torch ({torch_moe.gemm_name})"


# mlp(hidden_states bf16 [n, H]) -> bf16 [n, H]: a shared-expert MLP (shared_expert_mlp)
SharedMLP = Callable[[torch.Tensor], torch.Tensor]


def merge_shared_experts(shared: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """S shared experts of intermediate size I (checkpoint layout: w13 [S, 2I, H], w13_scale
    [S, 2I/128, H/128], w2 [S, H, I], w2_scale [S, H/128, I/128]) as the one MLP of intermediate
    size S*I that vLLM runs for them (DeepSeek's n_shared_experts are one MLP of n_shared_experts * I),
    in the same layout with one expert: its gate rows are every expert's gate rows in expert order,
    then every expert's up rows (vLLM's merged gate_up projection), its down columns every expert's
    in the same order. The FP8 codes and 128x128 block scales are the experts' own (a block never
    spans two experts, I being a multiple of 128), so the dequantized weights are the same, and as
    SwiGLU is per channel the MLP computes the sum of the S experts' outputs."""
    inter = shared["w2"].shape[2]

    def gate_rows_then_up_rows(w: torch.Tensor, rows_per_half: int) -> torch.Tensor:
        return torch.cat([w[:, :rows_per_half].flatten(0, 1), w[:, rows_per_half:].flatten(0, 1)]).unsqueeze(0)

    def columns_side_by_side(w: torch.Tensor) -> torch.Tensor:
        return w.transpose(0, 1).flatten(1).unsqueeze(0)

    return dict(w13=gate_rows_then_up_rows(shared["w13"], inter),
                w13_scale=gate_rows_then_up_rows(shared["w13_scale"], inter // BLOCK),
                w2=columns_side_by_side(shared["w2"]), w2_scale=columns_side_by_side(shared["w2_scale"]))


def shared_expert_mlp(mlp: Dict[str, torch.Tensor]) -> Tuple[SharedMLP, str]:
    """(the MLP of `mlp`'s one expert (merge_shared_experts' layout), what runs it): vLLM's
    shared-expert MLP, its gate_up and down projections block-FP8 linear layers as vLLM's
    Fp8LinearMethod runs a 128x128 block-FP8 checkpoint (the GEMM kernel vLLM's own selection picks
    on this GPU, the per-token-group FP8 input quant inside it) and SiluAndMul between them, with
    vLLM's custom ops on (its CUDA kernels, as vLLM runs without torch.compile). Where this vLLM
    has no such API (another version), TorchSharedMLP instead, and the name says why."""
    if importlib.util.find_spec("vllm") is None:
        why = "vllm is not installed"
    else:
        try:
            return _vllm_shared_mlp(mlp)
        except (ImportError, AttributeError, TypeError, ValueError, RuntimeError, AssertionError) as exc:
            # vLLM's linear-kernel API is internal and moves between versions.
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            why = f"vLLM's block-FP8 linear layers do not run here: {first_line}"
    torch_mlp = TorchSharedMLP(mlp)
    return torch_mlp, f"torch ({torch_mlp.gemm_name}); {why}"


def _vllm_shared_mlp(mlp: Dict[str, torch.Tensor]) -> Tuple[SharedMLP, str]:
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, create_fp8_quant_key

    activation_key = create_fp8_quant_key(static=False, group_shape=GroupShape(1, BLOCK))
    weight_key = create_fp8_quant_key(static=True, group_shape=GroupShape(BLOCK, BLOCK))

    def block_fp8_linear(weight: torch.Tensor, weight_scale: torch.Tensor, logical_widths):
        """A linear layer's parameters as Fp8LinearMethod.create_weights registers them for a
        block-FP8 checkpoint, prepared and applied by the kernel that vLLM selects."""
        kernel = init_fp8_linear_kernel(activation_quant_key=activation_key, weight_quant_key=weight_key,
                                        input_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                                        weight_shape=tuple(weight.shape), module_name="shared_experts")
        layer = torch.nn.Module()
        # Copies: preparing the weights for the kernel may rewrite them in place, and ours must stay as
        # the other paths and the reference read them.
        layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(weight_scale.clone(), requires_grad=False)
        layer.input_scale = None
        layer.weight_block_size = [BLOCK, BLOCK]
        layer.logical_widths = list(logical_widths)
        kernel.process_weights_after_loading(layer)
        return functools.partial(kernel.apply_weights, layer), type(kernel).__name__

    intermediate = mlp["w2"].shape[2]  # S*I
    # The ops pick their implementation when they are made: vLLM's CUDA kernels with custom_ops "all".
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
        gate_up, kernel_name = block_fp8_linear(mlp["w13"][0], mlp["w13_scale"][0], [intermediate, intermediate])
        down, _ = block_fp8_linear(mlp["w2"][0], mlp["w2_scale"][0], [mlp["w2"].shape[1]])
        silu_and_mul = SiluAndMul()

    def run(hidden_states):
        return down(silu_and_mul(gate_up(hidden_states)))

    return run, f"vLLM block-FP8 linear layers ({kernel_name}) and SiluAndMul"


class TorchSharedMLP:
    """vLLM's shared-expert MLP step by step in torch over one expert's checkpoint-layout weights
    (merge_shared_experts): per-token-group FP8 quant of the input, gate_up GEMM to BF16,
    SiLU(gate) * up in BF16, per-token-group FP8 quant, down GEMM to BF16. The GEMMs are
    UnfusedTorchMoE's (`gemm_name` says which)."""

    def __init__(self, mlp: Dict[str, torch.Tensor]):
        self._gemms = UnfusedTorchMoE(mlp)
        self.gemm_name = self._gemms.gemm_name

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x, x_sf = quantize_per_token_group(hidden_states)
        gate, up = self._gemms.gemm(x, x_sf, 0, "w13").to(torch.bfloat16).chunk(2, dim=1)
        act, act_sf = quantize_per_token_group((F.silu(gate.float()) * up.float()).to(torch.bfloat16))
        return self._gemms.gemm(act, act_sf, 0, "w2").to(torch.bfloat16)
