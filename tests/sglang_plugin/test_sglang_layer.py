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

from conftest import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK, not_0_5_17
from contract_oracle import FP8
from fp8_experts import (Block, Experts, SharedMLP, built_experts, expected, fp8_config, load_model, routing,
                         shared_expected, sm90_reference)

pytestmark = not_0_5_17

@pytest.fixture
def selected_on_sm90(registered, monkeypatch):
    """Published server arguments selecting the backend, SGLang's SM90 reading, the token
    cap, one EP rank, and the reference executor."""
    import argparse

    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.server_args import ServerArgs

    from conftest import FIXTURE_MODEL

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", str(FIXTURE_MODEL),
                                                       "--moe-runner-backend", "megamoe_sm90"]))
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    one_rank = type("Parallel", (), {"moe_ep_group": type("G", (), {"device_group": None})()})()
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: one_rank)
    with sm90_reference(monkeypatch):
        yield


def assert_forward_matches(experts, ckpt, seed: int, routed_scaling_factor: float):
    """Five tokens through SGLang's routed forward of the built layer, against the contract on the
    checkpoint weights `ckpt` (w13, its scales, w2, its scales)."""
    import sglang.srt.layers.moe.mega_moe as mega_moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(5)]).int()
    weights = torch.rand(5, TOPK, generator=g)
    y = mega_moe.run_mega_routed_experts(experts, x, ids, weights, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                         top_k=TOPK, num_tokens=5, routed_scaling_factor=routed_scaling_factor)
    assert y.shape == (5, HIDDEN) and y.dtype == torch.bfloat16
    want = expected(x.float(), ids, routed_scaling_factor * weights, *ckpt)
    rel = ((y.float() - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel


def test_weights_are_transformed_in_place_and_the_forward_matches_the_contract(selected_on_sm90):
    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    import megamoe_plugin as mm

    experts = Experts(fp8_config())
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
    # SGLang's weight-update requests load through each parameter's weight_loader: refused by name,
    # since a checkpoint tensor written over the kernel layout would be read wrong.
    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError
    for param in params:
        with pytest.raises(MegaMoEUnsupportedError, match="updating a MoE layer's expert weights in place"):
            param.weight_loader(param, param.data.clone(), "experts.w13_weight", shard_id="w1", expert_id=0)
    # update_weights_from_tensor's "direct" format copies into the parameters without their loaders:
    # refused by name too; other parameters still load that way.
    from sglang.srt.model_executor.model_runner_components import weight_updater
    with pytest.raises(MegaMoEUnsupportedError, match="updating a MoE layer's expert weights in place"):
        weight_updater._model_load_weights_direct(experts, [("w2_weight", experts.w2_weight.data.clone())])
    plain = torch.nn.Linear(2, 2, bias=False)
    weight_updater._model_load_weights_direct(plain, [("weight", torch.ones(2, 2))])
    assert torch.equal(plain.weight.data, torch.ones(2, 2))

    assert_forward_matches(experts, ckpt, seed=1, routed_scaling_factor=2.0)

    # Zero local tokens still take part (every EP rank joins every step).
    empty = mega_moe.run_mega_routed_experts(experts, torch.zeros(0, HIDDEN).bfloat16(), None, None,
                                             hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, top_k=TOPK,
                                             num_tokens=0)
    assert empty.shape == (0, HIDDEN)


@pytest.mark.parametrize("overrides, message", [
    (dict(weight_block_size=None), "per-tensor scales"),
    (dict(weight_block_size=[64, 64]), "weight_block_size=[64, 64]"),
    (dict(is_checkpoint_fp8_serialized=False), "online FP8 quantization"),
])
def test_non_block_fp8_is_refused_at_weight_build(selected_on_sm90, overrides, message):
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    experts = Experts(fp8_config())
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

    experts = Experts(fp8_config())
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
        sm90.build_sm90_mega_moe_experts_weights(Experts(fp8_config()))


def test_the_first_forward_warms_up_every_loaded_layer_in_one_step(selected_on_sm90, monkeypatch):
    """Executor "kernel" with recording stand-ins for the op and the warm-up: the weight build
    registers each layer, so the first forward on the shared buffer builds the params of all of
    them in one warm-up (one start-up report, not one per layer), and every layer's forward
    hands the op its own weights."""
    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90
    from kernel_stand_ins import record_kernel_calls

    from megamoe_plugin import serving

    layers = [Experts(fp8_config(), seed=seed) for seed in (3, 4, 5)]
    ckpts = [[p.data.clone() for p in (e.w13_weight, e.w13_weight_scale_inv, e.w2_weight, e.w2_weight_scale_inv)]
             for e in layers]
    for experts in layers:
        sm90.build_sm90_mega_moe_experts_weights(experts)
    calls = record_kernel_calls(monkeypatch)
    serving.set_executor("kernel")  # sm90_reference restores the executor it found

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(5)]).int()
    weights = torch.rand(5, TOPK, generator=g)
    for _ in range(2):
        for experts, ckpt in zip(layers, ckpts):
            y = mega_moe.run_mega_routed_experts(experts, x, ids, weights, hidden_size=HIDDEN,
                                                 intermediate_size=INTERMEDIATE, top_k=TOPK, num_tokens=5)
            want = expected(x.float(), ids, weights, *ckpt)
            assert ((y.float() - want).norm() / want.norm()).item() < 2e-2

    def pointers(l1, l2):
        return tuple(t.data_ptr() for t in (*l1, *l2))

    assert len(calls["warmup"]) == 1
    buf, counts, _, warmed, others = calls["warmup"][0]
    assert counts[0] == 1 and counts[-1] == buf.num_max_tokens_per_rank
    assert pointers(*warmed) == pointers(layers[0].mega_l1_weights, layers[0].mega_l2_weights)
    assert sorted(pointers(*w) for w in others) == sorted(pointers(e.mega_l1_weights, e.mega_l2_weights)
                                                           for e in layers[1:])
    assert [c["n"] for c in calls["op"]] == [5] * 6 and len({id(c["buf"]) for c in calls["op"]}) == 1


@pytest.mark.parametrize("num_shared", [1, 2])
def test_the_blocks_shared_experts_run_inside_the_call(selected_on_sm90, num_shared, caplog):
    """After the load, each block's shared MLP is S = n_shared experts of the call (appended to its
    kernel-layout experts, its own storage released), the buffer has S shared slots, and the block's
    forward (SGLang's real routed path under the plugin's hooks) returns routed * routed_scaling_factor
    + shared without running the MLP."""
    import sglang.srt.layers.moe.mega_moe as mega_moe

    from megamoe_plugin import serving
    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    x, ids, weights = routing(7)
    layers = [built_experts(seed) for seed in (3, 4)]
    blocks = [Block(experts, SharedMLP(num_shared, seed=10 + i), ids, weights) for i, (experts, _) in enumerate(layers)]
    with caplog.at_level("INFO", logger="megamoe_plugin.sglang"):
        load_model(blocks)
    assert f"2 MoE layers run their shared experts (SharedMLP) inside the kernel's call as {num_shared} more" in caplog.text
    for block, (experts, ckpt) in zip(blocks, layers):
        assert experts.w13_weight.shape[0] == experts.w2_weight_scale_inv.shape[0] == NUM_EXPERTS + num_shared
        assert experts.mega_l1_weights[0].data_ptr() == experts.w13_weight.data_ptr()  # no second copy
        assert all(p.numel() == 0 for p in block.shared_experts.parameters())
        with pytest.raises(MegaMoEUnsupportedError, match="in place"):  # nor the released MLP
            block.shared_experts.down_proj.weight.weight_loader(block.shared_experts.down_proj.weight, x)
        # the warm-up knows the new weights only (no reference to the old storage is kept)
        registered = [w for layers_of_key in serving._layer_weights.values() for e, w in layers_of_key.items()
                      if e is experts]
        assert len(registered) == 1 and registered[0][0][0].data_ptr() == experts.w13_weight.data_ptr()

        y = mega_moe.forward_mega_moe(block, x)
        want = expected(x.float(), ids, 2.5 * weights, *ckpt) + shared_expected(x.float(), *block.shared_checkpoint)
        rel = ((y.float() - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel
        assert block.shared_forwards == 0
    buf = mega_moe._get_mega_moe_symm_buffer(None, NUM_EXPERTS, 64, TOPK, HIDDEN, INTERMEDIATE, mma_type="fp8xfp4")
    assert buf.shape.num_shared_experts == num_shared
    assert mega_moe.forward_mega_moe(blocks[0], x[:0]).shape == (0, HIDDEN)


@pytest.mark.parametrize("change, reason", [
    (dict(tp_size=2), "its BlockFP8Linear is sharded over 2 tensor-parallel ranks"),
    (dict(swiglu_limit=7.0), "their SwiGLU is clamped"),
])
def test_a_model_whose_shared_experts_the_call_cannot_take_keeps_them_beside_it(selected_on_sm90, change, reason,
                                                                              caplog):
    """All or nothing: one block the kernel cannot take keeps every block's shared experts beside
    the call (one log line naming why), and the forward adds the MLP's output to the routed one."""
    import sglang.srt.layers.moe.mega_moe as mega_moe

    x, ids, weights = routing(5)
    (good, good_ckpt), (bad, _) = built_experts(3), built_experts(4)
    blocks = [Block(good, SharedMLP(1, seed=5), ids, weights), Block(bad, SharedMLP(1, seed=6, **change), ids, weights)]
    with caplog.at_level("WARNING", logger="megamoe_plugin.sglang"):
        load_model(blocks)
    assert f"2 MoE layers' shared experts (SharedMLP) run beside the kernel, not in its call: {reason}" in caplog.text
    assert good.w13_weight.shape[0] == NUM_EXPERTS and blocks[0].shared_experts.gate_up_proj.weight.numel() > 0
    y = mega_moe.forward_mega_moe(blocks[0], x)
    want = expected(x.float(), ids, 2.5 * weights, *good_ckpt) + shared_expected(x.float(), *blocks[0].shared_checkpoint)
    assert ((y.float() - want).norm() / want.norm()).item() < 2e-2
    assert blocks[0].shared_forwards == 1


def test_two_models_of_one_routed_shape_must_agree(selected_on_sm90):
    """Layers of one routed shape share a buffer, which has S shared slots or none: a second model
    (e.g. a draft model) that would need the other kind is refused at its load, by name."""
    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    x, ids, weights = routing(3)
    load_model([Block(built_experts(3)[0], SharedMLP(2, seed=5), ids, weights)])
    load_model([Block(built_experts(4)[0], SharedMLP(2, seed=6), ids, weights)])  # the same choice: fine
    with pytest.raises(MegaMoEUnsupportedError, match="this model runs 0 shared experts in the kernel's call and a "
                                                      "model loaded earlier .* runs 2"):
        load_model([Block(built_experts(5)[0], SharedMLP(2, seed=7, tp_size=2), ids, weights)])


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_mxfp4_experts_take_the_kernel_layout_and_the_forward_matches_the_contract(selected_on_sm90, monkeypatch,
                                                                                   numerics):
    """DeepSeek-V4's MXFP4 experts as SGLang's FP8 method hands them to the mega-MoE build (int8 codes,
    float32 E8M0 values): the kernel's MXFP4 layout in fast numerics (read at 4 bits), their exact FP8
    blocks in exact numerics; the forward against the contract on the dequantized MXFP4 weights."""
    import sglang.srt.layers.moe.mega_moe as mega_moe

    import megamoe_plugin as mm
    from megamoe_plugin.mxfp4 import scale_bits_of_float, to_fp8_blocks
    from megamoe_plugin.weights import weight_format

    monkeypatch.setenv("MEGAMOE_NUMERICS", numerics)
    experts = Experts(fp8_config(), mxfp4=True)
    ckpt = [p.data.clone() for p in (experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight,
                                     experts.w2_weight_scale_inv)]
    mega_moe.build_mega_moe_experts_weights(experts)
    pairs = [(ckpt[0].view(torch.uint8), scale_bits_of_float(ckpt[1])),
             (ckpt[2].view(torch.uint8), scale_bits_of_float(ckpt[3]))]
    if numerics == "exact":
        pairs = [to_fp8_blocks(*pair) for pair in pairs]
    for got, want in zip((*experts.mega_l1_weights, *experts.mega_l2_weights),
                         (t for pair in mm.transform_weights(*pairs) for t in pair)):
        assert torch.equal(got.view(torch.uint8) if got.dtype == FP8 else got,
                           want.view(torch.uint8) if want.dtype == FP8 else want)
    assert weight_format(experts.mega_l1_weights[0]) == ("mxfp4" if numerics == "fast" else "fp8")
    assert experts.mega_l1_weights[0].data_ptr() == experts.w13_weight.data_ptr()
    assert mega_moe.is_mega_moe_experts_ready(experts)

    assert_forward_matches(experts, ckpt, seed=2, routed_scaling_factor=1.5)


def test_mxfp4_scales_that_are_not_e8m0_values_are_refused_by_name(selected_on_sm90):
    import sglang.srt.layers.moe.mega_moe as mega_moe

    experts = Experts(fp8_config(), mxfp4=True)
    experts.w2_weight_scale_inv.data[0, 0, 0] = 3.0
    with pytest.raises(ValueError, match=r"w2_weight_scale_inv must hold E8M0 values .* e\.g\. \[3\.0\]"):
        mega_moe.build_mega_moe_experts_weights(experts)


@pytest.mark.parametrize("flag", ["_mega_moe_w4a4", "_mega_moe_nvfp4"])
def test_fp4_activations_and_nvfp4_experts_are_refused_at_weight_build(selected_on_sm90, flag):
    import sglang.srt.layers.moe.mega_moe as mega_moe

    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    experts = Experts(fp8_config(), mxfp4=True)
    setattr(experts, flag, True)
    with pytest.raises(MegaMoEUnsupportedError, match="FP4 activations .* or NVFP4 experts.*drop --enable-w4a4"):
        mega_moe.build_mega_moe_experts_weights(experts)
    assert not getattr(experts, "_mega_moe_weights_built", False)
