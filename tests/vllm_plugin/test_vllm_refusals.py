"""Every deployment megamoe_sm90 refuses is refused at model load (layer construction),
with a message that names what to change. Hardware facts come from a fake probe, so
the SM90 and EP-topology refusals run on a CPU machine."""
import types

import pytest

pytest.importorskip("vllm")

from conftest import build_moe, make_vllm_config  # noqa: E402

from megamoe_plugin.vllm_plugin import executor, refusals  # noqa: E402
from megamoe_plugin.vllm_plugin.refusals import EPTopology, MegaMoEUnsupportedError  # noqa: E402


class FakeProbe(refusals.HardwareProbe):
    def __init__(self, capability=(9, 0), name="NVIDIA H200", topology=None):
        self.capability, self.name, self.topology = capability, name, topology

    def device_capability(self):
        return self.capability

    def device_name(self):
        return self.name

    def ep_topology(self):
        return self.topology


@pytest.fixture
def kernel_executor():
    previous = executor.set_executor("kernel")
    yield
    executor.set_executor(previous)


class _Records(list):
    """Log records of the plugin's logger (vLLM's loggers do not propagate to caplog)."""

    def __enter__(self):
        import logging

        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.append(record.getMessage())
        logging.getLogger("vllm.megamoe_sm90").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        import logging

        logging.getLogger("vllm.megamoe_sm90").removeHandler(self.handler)

    @property
    def text(self):
        return "\n".join(self)


def _refused(fn, *needles):
    with pytest.raises(MegaMoEUnsupportedError) as info:
        fn()
    message = str(info.value)
    assert message.startswith("--moe-backend megamoe_sm90: ") and "To fix: " in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ----------------------------------------------------------------------------- at layer construction


@pytest.mark.parametrize("capability, found", [((8, 0), "NVIDIA A100 (sm_80)"), ((10, 0), "NVIDIA A100 (sm_100)"),
                                               (None, "no CUDA device")])
def test_not_sm90(vllm_config, dist_env, kernel_executor, capability, found):
    with refusals.override_probe(FakeProbe(capability=capability, name="NVIDIA A100")):
        _refused(lambda: build_moe(vllm_config), "SM90", found, "run on Hopper GPUs", "--moe-backend")


def test_sm90_passes_device_check(vllm_config, dist_env, kernel_executor):
    with refusals.override_probe(FakeProbe()):
        layer = build_moe(vllm_config)
    assert type(layer.routed_experts.quant_method).__name__ == "MegaMoEFp8MoEMethod"


def _fp8_config(**kwargs):
    from megamoe_plugin.vllm_plugin.quant_config import MegaMoEFp8Config

    kwargs.setdefault("activation_scheme", "dynamic")
    kwargs.setdefault("is_checkpoint_fp8_serialized", True)
    return MegaMoEFp8Config(**kwargs)


def test_block_size_other_than_128(vllm_config, dist_env, reference_executor):
    _refused(lambda: build_moe(vllm_config, quant_config=_fp8_config(weight_block_size=[64, 64])),
             "weight_block_size=[64, 64]", "128x128", "weight_block_size [128, 128]")


def test_per_tensor_fp8(vllm_config, dist_env, reference_executor):
    _refused(lambda: build_moe(vllm_config, quant_config=_fp8_config(weight_block_size=None)),
             "per-tensor", "weight_block_size = [128, 128]")


def test_moe_layer_excluded_from_quantization(vllm_config, dist_env, reference_executor):
    qc = _fp8_config(weight_block_size=[128, 128], ignored_layers=["model.layers.99.mlp.experts"])
    _refused(lambda: build_moe(vllm_config, quant_config=qc, prefix="model.layers.99.mlp.experts"),
             "excluded from FP8 quantization", "experts are all FP8")


def test_non_silu_activation(vllm_config, dist_env, reference_executor):
    _refused(lambda: build_moe(vllm_config, activation="gelu"), "'gelu'", "SiLU-gated", "SwiGLU MoE model")


def test_expert_bias(vllm_config, dist_env, reference_executor):
    _refused(lambda: build_moe(vllm_config, has_bias=True), "biases", "pick another --moe-backend")


def test_router_weight_on_input(vllm_config, dist_env, reference_executor):
    _refused(lambda: build_moe(vllm_config, top_k=1, apply_router_weight_on_input=True),
             "router weights to the MoE input")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(hidden=192), "hidden size 192 is not a multiple of 128"),
    (dict(intermediate=192), "MoE intermediate size 192 is not a multiple of 128"),
    (dict(num_experts=32, top_k=17), "top-k 17 is outside [1, 16]"),
])
def test_shapes_outside_kernel_limits(vllm_config, dist_env, reference_executor, kwargs, needle):
    _refused(lambda: build_moe(vllm_config, **kwargs), needle, "hidden % 128 == 0")


def test_lora(dist_env, reference_executor):
    cfg = make_vllm_config(enable_lora=True)
    _refused(lambda: build_moe(cfg), "LoRA", "remove --enable-lora")


def test_non_bf16_activations(dist_env, reference_executor):
    cfg = make_vllm_config(dtype="float16")
    _refused(lambda: build_moe(cfg, params_dtype=None), "torch.float16", "--dtype bfloat16")


# ----------------------------------------------------------------------------- checks needing >1 rank (unit level)


def _moe_config(**par):
    import torch

    parallel = dict(use_ep=True, ep_size=8, tp_size=1, dp_size=8, pcp_size=1)
    parallel.update(par)
    return types.SimpleNamespace(activation="silu", is_act_and_mul=True, swiglu_alpha=None, swiglu_beta=None,
                                 has_bias=False, in_dtype=torch.bfloat16, is_lora_enabled=False,
                                 moe_parallel_config=types.SimpleNamespace(**parallel), num_experts=256,
                                 hidden_dim=7168, intermediate_size_per_partition=2048, experts_per_token=8)


_LAYER = types.SimpleNamespace(apply_router_weight_on_input=False,
                               expert_map_manager=types.SimpleNamespace(placement_strategy="linear"))


def test_deepseek_v3_ep8_is_accepted():
    refusals.check_layer(_moe_config(), _LAYER, executor="kernel")


def test_tensor_parallel_moe_without_ep():
    _refused(lambda: refusals.check_layer(_moe_config(use_ep=False, ep_size=1, tp_size=8, dp_size=1), _LAYER,
                                          executor="kernel"), "tensor-parallel", "--enable-expert-parallel")


def test_tp_only_ep_is_accepted_with_a_warning():
    refusals._logged.clear()
    with _Records() as logs:
        refusals.check_layer(_moe_config(tp_size=8, dp_size=1), _LAYER, executor="kernel")
    assert "dispatched 8 times" in logs.text and "--data-parallel-size" in logs.text


@pytest.mark.parametrize("par, extra, needle", [
    (dict(ep_size=16, dp_size=16), {}, "the EP group has 16 ranks"),
    (dict(ep_size=3, dp_size=3), {}, "the EP group has 3 ranks"),
    (dict(ep_size=2, dp_size=2), dict(num_experts=2048), "1024 experts per EP rank exceed"),
    (dict(ep_size=8, dp_size=8), dict(num_experts=260), "260 experts do not divide over 8 EP ranks"),
])
def test_ep_shape_limits(par, extra, needle):
    cfg = _moe_config(**par)
    for key, value in extra.items():
        setattr(cfg, key, value)
    _refused(lambda: refusals.check_layer(cfg, _LAYER, executor="kernel"), needle)


def test_non_linear_expert_placement():
    layer = types.SimpleNamespace(apply_router_weight_on_input=False,
                                  expert_map_manager=types.SimpleNamespace(placement_strategy="round_robin"))
    _refused(lambda: refusals.check_layer(_moe_config(), layer, executor="kernel"),
             "--expert-placement-strategy linear")


def test_reference_executor_needs_one_rank():
    _refused(lambda: refusals.check_layer(_moe_config(), _LAYER, executor="reference"), "unset MEGAMOE_EXECUTOR")


def test_dual_batch_overlap():
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(enable_dbo=True))
    _refused(lambda: refusals.check_vllm_features(cfg), "remove --enable-dbo")


def test_online_fp8_of_bf16_checkpoint():
    qc = types.SimpleNamespace(store_dtype=None, is_checkpoint_fp8_serialized=False, weight_block_size=None)
    _refused(lambda: refusals.check_quantization(qc), "online FP8", "weight_block_size: [128, 128]")


# ----------------------------------------------------------------------------- EP topology


def _topology(**kwargs):
    base = dict(world_size=4, same_node=(True,) * 4, devices=tuple(f"cuda:{i}" for i in range(4)))
    base.update(kwargs)
    return EPTopology(**base)


def test_ep_group_across_nodes():
    with refusals.override_probe(FakeProbe(topology=_topology(same_node=(True, True, False, False)))):
        _refused(lambda: refusals.check_ep_topology("group"), "spans more than one node", "ranks [2, 3]",
                 "keep the EP group", "on one node")


def test_ep_gpus_without_peer_access():
    with refusals.override_probe(FakeProbe(topology=_topology(no_peer_access=((0, 3),)))):
        _refused(lambda: refusals.check_ep_topology("group"), "no peer access", "cuda:0 <-> cuda:3",
                 "nvidia-smi topo -m")


def test_ep_topology_ok_and_cached():
    calls = []

    class Counting(FakeProbe):
        def ep_topology(self):
            calls.append(1)
            return _topology()

    with refusals.override_probe(Counting()):
        refusals.check_ep_topology("g")
        refusals.check_ep_topology("g")  # the collective probe runs once per EP group
    assert calls == [1]


def test_unverified_peer_access_only_warns():
    with refusals.override_probe(FakeProbe(topology=_topology(unverified=((1, 2),)))), _Records() as logs:
        refusals.check_ep_topology("group")
    assert "could not verify peer access" in logs.text


# ----------------------------------------------------------------------------- vLLM versions


def test_vllm_without_the_moe_kernel_attribute(vllm_config, dist_env, reference_executor, monkeypatch):
    """A vLLM whose FusedMoEMethodBase keeps the modular kernel under another name would
    all-gather the DP ranks' tokens and sum the output over the EP ranks: refused at load."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    base_init = FusedMoEMethodBase.__init__

    def renamed(self, moe):
        base_init(self, moe)
        self.modular_kernel = vars(self).pop("moe_kernel")

    monkeypatch.setattr(FusedMoEMethodBase, "__init__", renamed)
    _refused(lambda: build_moe(vllm_config), "does not take a MoE method's modular kernel from `moe_kernel`",
             "sum its already combined output over the EP ranks", "use vLLM 0.24 to 0.33")


def test_vllm_that_does_not_see_the_moe_kernel(vllm_config, dist_env, reference_executor, monkeypatch):
    """The attribute is there but vLLM's own-kernel gate reads something else: refused when
    the kernel is built, at load."""
    from test_vllm_layer import load_checkpoint, make_checkpoint
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    runner = build_moe(vllm_config)
    load_checkpoint(runner, *make_checkpoint(seed=14))
    ex = runner.routed_experts
    monkeypatch.setattr(FusedMoEMethodBase, "supports_internal_mk",
                        property(lambda self: getattr(self, "modular_kernel", None) is not None))
    _refused(lambda: ex.quant_method.process_weights_after_loading(ex), "from `moe_kernel`")
    monkeypatch.undo()
    ex.quant_method.process_weights_after_loading(ex)  # vLLM as it is: accepted
    assert ex.quant_method.supports_internal_mk
