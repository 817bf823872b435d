"""A DeepSeek-family layer's shared experts in the kernel's call, inside real vLLM on a CPU.

vLLM's own shared-expert MLP class (DeepseekV2MLP: FP8 gate_up_proj / SiLU-and-mul / down_proj, of
intermediate n_shared * I) is built, loaded through its linear layers' weight loaders and processed
as the model loader does (shared experts before the routed ones); the plugin's method then takes it
into the kernel's weights (megamoe_plugin.vllm_plugin.shared_experts) and detaches it from vLLM's
runner. The layer's output, from the float32 reference executor on what the kernel would read, is
checked against a torch oracle of routed * routed_scaling_factor + shared written here from the
contract. Forms the kernel cannot take stay with vLLM, with a log line naming why.

vLLM's CPU platform has no block-FP8 linear kernel for most CPUs (its own need AMX); the linear
layers are built with vLLM's Triton block-FP8 kernel object, whose load-time processing keeps the
checkpoint layout as on a GPU; their forward never runs here.
"""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from conftest import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK, build_moe  # noqa: E402
from contract_oracle import dequant_blocks, quant_blocks, quant_dequant_rows  # noqa: E402
from kernel_stand_ins import record_kernel_calls  # noqa: E402
from test_vllm_layer import (FakeSM90, _assert_close, _forward, _inputs, load_checkpoint, make_checkpoint,  # noqa: E402
                             torch_moe)

ROUTED_SCALING_FACTOR = 2.5


def use_triton_block_fp8_linears(monkeypatch):
    """From now on (until `monkeypatch` undoes it), vLLM's block-FP8 linear layers get the Triton kernel
    object (see the module docstring). dp_ep_worker.py calls it too."""
    import vllm.model_executor.kernels.linear as linear_kernels
    from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel

    choose = linear_kernels.choose_scaled_mm_linear_kernel

    def triton_for_blocks(config, possible_kernels, *args, **kwargs):
        if possible_kernels is linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS:
            return TritonFp8BlockScaledMMKernel
        return choose(config, possible_kernels, *args, **kwargs)

    monkeypatch.setattr(linear_kernels, "choose_scaled_mm_linear_kernel", triton_for_blocks)


@pytest.fixture
def block_fp8_linears(monkeypatch):
    """use_triton_block_fp8_linears for one test."""
    use_triton_block_fp8_linears(monkeypatch)


@pytest.fixture
def warnings_logged(monkeypatch):
    """The warnings the shared-experts glue logs (once per process, each time here)."""
    from megamoe_plugin.vllm_plugin import shared_experts

    lines = []
    monkeypatch.setattr(shared_experts, "warn_once", lambda message, *args: lines.append(message % args))
    return lines


@pytest.fixture
def info_logged(monkeypatch):
    """The info lines the shared-experts glue logs (once per process, each time here)."""
    from megamoe_plugin.vllm_plugin import shared_experts

    lines = []
    monkeypatch.setattr(shared_experts, "info_once", lambda message, *args: lines.append(message % args))
    return lines


def _shared_mlp(cfg, num_shared, seed):
    """vLLM's DeepSeek shared-expert MLP of intermediate num_shared * I, loaded from a checkpoint and
    processed; returns (mlp, its checkpoint {gate_proj, up_proj, down_proj: (q, s)})."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP

    inter = num_shared * INTERMEDIATE
    with set_current_vllm_config(cfg):
        mlp = DeepseekV2MLP(HIDDEN, inter, "silu", quant_config=cfg.quant_config, reduce_results=False,
                            prefix=f"model.layers.{seed}.mlp.shared_experts")
    g = torch.Generator().manual_seed(seed)
    ckpt = {name: quant_blocks(torch.randn(*shape, generator=g) * 0.06)
            for name, shape in (("gate_proj", (inter, HIDDEN)), ("up_proj", (inter, HIDDEN)),
                                ("down_proj", (HIDDEN, inter)))}
    for shard, name in enumerate(("gate_proj", "up_proj")):
        for param, tensor in zip((mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale_inv), ckpt[name]):
            param.weight_loader(param, tensor, shard)
    for param, tensor in zip((mlp.down_proj.weight, mlp.down_proj.weight_scale_inv), ckpt["down_proj"]):
        param.weight_loader(param, tensor)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.quant_method.process_weights_after_loading(linear)
    return mlp, ckpt


def torch_shared(x, ckpt):
    """The shared MLP from the contract: FP8 activations, SwiGLU, requantized, down projection."""
    a = quant_dequant_rows(x)
    act = F.silu(a @ dequant_blocks(*ckpt["gate_proj"]).T) * (a @ dequant_blocks(*ckpt["up_proj"]).T)
    return quant_dequant_rows(act) @ dequant_blocks(*ckpt["down_proj"]).T


def _layer_with_shared(cfg, num_shared, seed, **kwargs):
    mlp, shared_ckpt = _shared_mlp(cfg, num_shared, seed)
    runner = build_moe(cfg, shared_experts=mlp, routed_scaling_factor=ROUTED_SCALING_FACTOR,
                       apply_routed_scale_to_output=True, **kwargs)
    experts, named = make_checkpoint(seed=seed)
    load_checkpoint(runner, experts, named)
    runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)
    return runner, mlp, experts, shared_ckpt


@pytest.mark.parametrize("num_shared", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_shared_experts_run_in_the_kernels_call(vllm_config, dist_env, reference_executor, block_fp8_linears,
                                                info_logged, num_shared, n):
    runner, mlp, routed_ckpt, shared_ckpt = _layer_with_shared(vllm_config, num_shared, seed=20 + num_shared)
    assert info_logged == [f"megamoe_sm90: MoE layers' shared experts (DeepseekV2MLP of intermediate "
                           f"{num_shared * INTERMEDIATE}) run inside the kernel's call as {num_shared} more expert(s) "
                           "per rank"]
    method = runner.routed_experts.quant_method
    assert runner.shared_experts is None  # vLLM has nothing left to run beside the kernel
    assert all(p.numel() == 0 for p in mlp.parameters())  # the kernel's copy is the only one
    rt = method.runtime
    assert (rt.num_shared_experts, rt.shared_scale) == (num_shared, pytest.approx(1 / ROUTED_SCALING_FACTOR))
    # The kernel reads E + S experts; the parameters (EPLB's view) are its routed ones, same storage.
    ex = runner.routed_experts
    assert rt.l1[0].shape[0] == NUM_EXPERTS + num_shared and ex.w13_weight.shape[0] == NUM_EXPERTS
    assert ex.w13_weight.data_ptr() == rt.l1[0].data_ptr() and ex.w2_weight.data_ptr() == rt.l2[0].data_ptr()

    x, logits = _inputs(n, seed=5)
    y = _forward(vllm_config, runner, x, logits)
    want = ROUTED_SCALING_FACTOR * torch_moe(x, logits, routed_ckpt, TOPK).float() + torch_shared(x, shared_ckpt)
    _assert_close(y, want.to(torch.bfloat16))
    # and it is the shared experts that make the difference
    assert not torch.allclose(y.float(), ROUTED_SCALING_FACTOR * torch_moe(x, logits, routed_ckpt, TOPK).float(),
                              rtol=0.05, atol=0.05)


def test_the_kernel_executor_gets_the_shared_experts(vllm_config, dist_env, block_fp8_linears, monkeypatch):
    """The kernel path: one buffer made with the shared experts, the op given E + S experts and the
    tokens staged with the shared routing weight."""
    import megamoe_plugin as mm
    from megamoe_plugin.vllm_plugin import executor, refusals

    calls = record_kernel_calls(monkeypatch)
    staged = []
    stage = mm.stage_inputs
    monkeypatch.setattr(mm, "stage_inputs", lambda *a, **k: staged.append(k.get("shared_scale")) or stage(*a, **k))
    previous = executor.set_executor("kernel")
    executor.clear_buffers()
    try:
        with refusals.override_probe(FakeSM90()):
            runner, _, routed_ckpt, shared_ckpt = _layer_with_shared(vllm_config, 2, seed=30)
            x, logits = _inputs(6, seed=6)
            y = _forward(vllm_config, runner, x, logits)
    finally:
        executor.set_executor(previous)
        executor.clear_buffers()
    want = ROUTED_SCALING_FACTOR * torch_moe(x, logits, routed_ckpt, TOPK).float() + torch_shared(x, shared_ckpt)
    _assert_close(y, want.to(torch.bfloat16))
    (op,) = calls["op"]
    assert op["buf"].num_shared_experts == 2 and op["buf"].num_experts == NUM_EXPERTS
    assert op["l1"][0].shape[0] == NUM_EXPERTS + 2 and op["l2"][1].shape[0] == NUM_EXPERTS + 2
    assert staged == [pytest.approx(1 / ROUTED_SCALING_FACTOR)]


@pytest.mark.parametrize("form, kwargs, reason", [
    ("gated", dict(shared_expert_gate=torch.nn.Linear(HIDDEN, 1, bias=False)), "gated"),
    ("clamped", dict(swiglu_limit=7.0), "swiglu_limit"),
])
def test_forms_the_kernel_cannot_take_stay_with_vllm(vllm_config, dist_env, reference_executor, block_fp8_linears,
                                                      warnings_logged, info_logged, form, kwargs, reason):
    runner, mlp, _, _ = _layer_with_shared(vllm_config, 1, seed=40 + len(form), **kwargs)
    assert runner.shared_experts is not None and runner.shared_experts._layer is mlp
    assert mlp.gate_up_proj.weight.numel() > 0
    rt = runner.routed_experts.quant_method.runtime
    assert rt.num_shared_experts == 0 and rt.l1[0].shape[0] == NUM_EXPERTS
    assert any("run beside the kernel" in line and reason in line for line in warnings_logged)
    assert info_logged == []


def test_an_unlisted_linear_kernel_keeps_the_shared_experts_with_vllm(vllm_config, dist_env, reference_executor,
                                                                       block_fp8_linears, warnings_logged):
    """A linear backend that may have repacked the weights (not in CHECKPOINT_LAYOUT_LINEAR_KERNELS):
    the shapes alone cannot tell (a square gate_up, H = 2 I, looks the same transposed)."""
    from megamoe_plugin.vllm_plugin import shared_experts

    mlp, _ = _shared_mlp(vllm_config, 1, seed=50)

    class Repacking:
        pass

    mlp.gate_up_proj.quant_method.fp8_linear = Repacking()
    runner = build_moe(vllm_config, shared_experts=mlp)
    taken = shared_experts.take_from_runner(runner, None, None, 1, NUM_EXPERTS, 64, TOPK, HIDDEN, INTERMEDIATE)
    assert taken is None and runner.shared_experts is not None
    assert any("linear kernel Repacking" in line for line in warnings_logged)


def test_shared_experts_beside_mxfp4_routed_experts_stay_with_vllm(vllm_config, dist_env, reference_executor,
                                                                   block_fp8_linears, warnings_logged):
    """Routed experts read at 4 bits (MXFP4) and FP8 shared experts: one call reads one weight format,
    so the runner keeps its shared experts and says why."""
    from megamoe_plugin.vllm_plugin import shared_experts

    mlp, _ = _shared_mlp(vllm_config, 1, seed=51)
    runner = build_moe(vllm_config, shared_experts=mlp)
    taken = shared_experts.take_from_runner(runner, None, None, 1, NUM_EXPERTS, 64, TOPK, HIDDEN, INTERMEDIATE,
                                            routed_format="mxfp4")
    assert taken is None and runner.shared_experts is not None
    assert any("routed experts are MXFP4" in line for line in warnings_logged)
