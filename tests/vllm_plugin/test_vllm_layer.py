"""A megamoe_sm90 MoE layer inside real vLLM on a CPU: construction, checkpoint loading,
process_weights_after_loading (kernel layout, no second copy), and the forward pass.

The forward runs the float32 reference in place of the GPU kernel, selected explicitly
(executor "reference"), and is checked against a direct torch computation of the MoE
written here from the contract (docs/design.md section 2), sharing no code with the plugin.
The kernel executor's glue (buffer per shape, staging, warm-up, the op call with the
kernel-layout parameters) runs with the GPU op replaced by a recording stand-in.
"""
import gc

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from conftest import (HIDDEN, INTERMEDIATE, MAX_BATCHED_TOKENS, NUM_EXPERTS, TOPK, build_moe,  # noqa: E402
                      torch_softmax_topk)
from contract_oracle import FP8, dequant_blocks, quant_blocks, quant_dequant_rows  # noqa: E402
from kernel_stand_ins import record_kernel_calls  # noqa: E402



# ----------------------------------------------------------------------------- helpers


def make_checkpoint(num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTERMEDIATE, seed=0):
    """Per-expert checkpoint tensors as a FP8 block-quantized HF checkpoint names them."""
    g = torch.Generator().manual_seed(seed)
    experts, named = [], []
    for e in range(num_experts):
        entry = {}
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            q, s = quant_blocks(torch.randn(*shape, generator=g) * 0.06)
            entry[name] = (q, s)
            named.append((f"{e}.{name}.weight", q))
            named.append((f"{e}.{name}.weight_scale_inv", s))
        experts.append(entry)
    return experts, named


def torch_moe(x, router_logits, experts, top_k, activation_clamp=None):
    """The MoE of docs/design.md section 2 with softmax top-k routing (renormalized), in torch."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    a = quant_dequant_rows(x)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = experts[int(ids[t, k])]
            gate = a[t] @ dequant_blocks(*e["gate_proj"]).T
            up = a[t] @ dequant_blocks(*e["up_proj"]).T
            if activation_clamp is not None:
                gate = gate.clamp(max=activation_clamp)
                up = up.clamp(-activation_clamp, activation_clamp)
            act = F.silu(gate) * up * weights[t, k]
            act = quant_dequant_rows(act.unsqueeze(0))[0]
            o = act @ dequant_blocks(*e["down_proj"]).T
            out[t] += o.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def _assert_close(y, ref):
    y64, r64 = y.double(), ref.double()
    diff = 1 - 2 * (y64 * r64).sum() / (y64 * y64 + r64 * r64).sum()
    assert float(diff) < 1e-5, float(diff)
    rel = (y64 - r64).norm(dim=1) / r64.norm(dim=1).clamp_min(1e-6)
    assert float(rel.max()) < 1e-2, float(rel.max())


def load_checkpoint(runner, experts, named):
    """Load per-expert checkpoint tensors the way the model's load_weights does: through the
    runner's name mapping (vLLM 0.33) or the layer's weight_loader with (shard, expert)
    ids (the API both versions share). Returns the parameter names written."""
    if hasattr(runner, "load_weights"):
        return {n.split(".")[-1] for n in runner.load_weights(named)}
    ex = runner.routed_experts
    loaded = set()
    for e, entry in enumerate(experts):
        for name, shard in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            param_base = "w13" if shard in ("w1", "w3") else "w2"
            for suffix, tensor in (("weight", entry[name][0]), ("weight_scale_inv", entry[name][1])):
                param_name = f"{param_base}_{suffix}"
                ex.weight_loader(getattr(ex, param_name), tensor, f"{ex.layer_name}.{param_name}", shard, e)
                loaded.add(param_name)
    return loaded


def _loaded_layer(cfg, seed=0, **kwargs):
    runner = build_moe(cfg, **kwargs)
    experts, named = make_checkpoint(seed=seed)
    loaded = load_checkpoint(runner, experts, named)
    experts_module = runner.routed_experts
    experts_module.quant_method.process_weights_after_loading(experts_module)
    return runner, experts, loaded


def _forward(cfg, runner, x, logits):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(cfg), set_forward_context(None, cfg):
        return runner.forward(x, logits)


def _inputs(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, HIDDEN, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).to(torch.bfloat16)
    return x, torch.randn(n, NUM_EXPERTS, generator=g)


# ----------------------------------------------------------------------------- construction and loading


def test_layer_construction_uses_plugin_method(vllm_config, dist_env, reference_executor):
    from megamoe_plugin.vllm_plugin.moe_method import MegaMoEFp8MoEMethod

    runner = build_moe(vllm_config)
    experts = runner.routed_experts
    assert isinstance(experts.quant_method, MegaMoEFp8MoEMethod)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in experts.named_parameters()}
    assert shapes == {
        "w13_weight": ((NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN), FP8),
        "w2_weight": ((NUM_EXPERTS, HIDDEN, INTERMEDIATE), FP8),
        "w13_weight_scale_inv": ((NUM_EXPERTS, 2 * INTERMEDIATE // 128, HIDDEN // 128), torch.float32),
        "w2_weight_scale_inv": ((NUM_EXPERTS, HIDDEN // 128, INTERMEDIATE // 128), torch.float32),
    }
    assert experts.quant_method.supports_eplb
    assert experts.quant_method.runtime.max_tokens >= MAX_BATCHED_TOKENS


def test_weight_loading_fills_checkpoint_layout(vllm_config, dist_env, reference_executor):
    runner = build_moe(vllm_config)
    ckpt, named = make_checkpoint(seed=3)
    loaded = load_checkpoint(runner, ckpt, named)
    assert loaded == {"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"}
    ex = runner.routed_experts
    for e in (0, NUM_EXPERTS - 1):
        gate, up, down = ckpt[e]["gate_proj"], ckpt[e]["up_proj"], ckpt[e]["down_proj"]
        assert torch.equal(ex.w13_weight.data[e, :INTERMEDIATE].view(torch.uint8), gate[0].view(torch.uint8))
        assert torch.equal(ex.w13_weight.data[e, INTERMEDIATE:].view(torch.uint8), up[0].view(torch.uint8))
        assert torch.equal(ex.w2_weight.data[e].view(torch.uint8), down[0].view(torch.uint8))
        assert torch.equal(ex.w13_weight_scale_inv.data[e], torch.cat([gate[1], up[1]]))
        assert torch.equal(ex.w2_weight_scale_inv.data[e], down[1])


def _tensors_held_by(*roots, depth=4):
    """Tensors reachable from the plugin's objects through attributes and containers
    (modules are not entered: the layer's own parameters are accounted for separately)."""
    found, seen, frontier = [], set(), list(roots)
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                found.append(obj)
            elif isinstance(obj, torch.nn.Module):
                continue
            elif isinstance(obj, dict):
                nxt.extend(obj.values())
            elif isinstance(obj, (list, tuple, set)):
                nxt.extend(obj)
            elif hasattr(obj, "__dict__"):
                nxt.extend(vars(obj).values())
        frontier = nxt
    return found


def test_process_weights_kernel_layout_no_second_copy(vllm_config, dist_env, reference_executor):
    import megamoe_plugin as mm

    runner = build_moe(vllm_config)
    ckpt, named = make_checkpoint(seed=4)
    load_checkpoint(runner, ckpt, named)
    del named, ckpt
    gc.collect()
    ex = runner.routed_experts
    params = {n: p for n, p in ex.named_parameters()}
    checkpoint = {n: p.data.clone() for n, p in params.items()}
    from torch.multiprocessing.reductions import StorageWeakRef

    old_storage = {n: StorageWeakRef(p.untyped_storage()) for n, p in params.items()}
    ex.quant_method.process_weights_after_loading(ex)
    gc.collect()

    # Same Parameter objects (weight loaders and EPLB keep their handles), kernel layout inside.
    assert {n: p for n, p in ex.named_parameters()} == params
    (w13_t, s13_t), (w2_t, s2_t) = mm.transform_weights(
        (checkpoint["w13_weight"], checkpoint["w13_weight_scale_inv"]),
        (checkpoint["w2_weight"], checkpoint["w2_weight_scale_inv"]))
    assert torch.equal(params["w13_weight"].view(torch.uint8), w13_t.view(torch.uint8))
    assert torch.equal(params["w13_weight_scale_inv"], s13_t)
    assert torch.equal(params["w2_weight"].view(torch.uint8), w2_t.view(torch.uint8))
    assert torch.equal(params["w2_weight_scale_inv"], s2_t)
    assert params["w13_weight_scale_inv"].dim() == 4  # [E, I/128, 2, H/128]

    # No second copy: each checkpoint-layout storage is either released or is the very
    # storage the parameter now holds (a permutation that happens to be the identity,
    # e.g. w2, or the w13 scales when I == 128) ...
    for name in params:
        ref = old_storage[name]
        assert ref.expired() or ref.cdata == params[name].untyped_storage()._cdata, name
    assert old_storage["w13_weight"].expired()  # the gate/up interleave is a real permutation
    # ... and the plugin's objects hold no tensor besides the parameters.
    method = ex.quant_method
    param_storages = {p.untyped_storage().data_ptr() for p in params.values()}
    held = _tensors_held_by(method, method.experts, method.runtime, method.moe_kernel, method.moe_quant_config)
    assert {t.untyped_storage().data_ptr() for t in held} <= param_storages

    # The modular kernel reads the parameters themselves (scales through its quant config).
    qc = ex.quant_method.moe_quant_config
    assert qc.w1_scale is params["w13_weight_scale_inv"] and qc.w2_scale is params["w2_weight_scale_inv"]
    assert ex.quant_method.moe_kernel.output_is_reduced()

    # EPLB moves experts through per-expert views of these same tensors.
    views = ex.get_expert_weights()
    assert len(views) == 4 and all(v.shape[0] == NUM_EXPERTS for v in views)
    assert {v.data_ptr() for v in views} == {p.data_ptr() for p in params.values()}

    # A second call (e.g. a reload hook) does not transform twice.
    ex.quant_method.process_weights_after_loading(ex)
    assert torch.equal(params["w13_weight"].view(torch.uint8), mm.transform_weights(
        (checkpoint["w13_weight"], checkpoint["w13_weight_scale_inv"]),
        (checkpoint["w2_weight"], checkpoint["w2_weight_scale_inv"]))[0][0].view(torch.uint8))


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("n", [1, 7, MAX_BATCHED_TOKENS])
def test_forward_reference_matches_torch(vllm_config, dist_env, reference_executor, n):
    runner, ckpt, _ = _loaded_layer(vllm_config, seed=5)
    x, logits = _inputs(n, seed=n)
    y = _forward(vllm_config, runner, x, logits)
    assert y.shape == (n, HIDDEN) and y.dtype == torch.bfloat16
    _assert_close(y, torch_moe(x, logits, ckpt, TOPK))


def test_forward_with_activation_clamp(vllm_config, dist_env, reference_executor):
    runner, ckpt, _ = _loaded_layer(vllm_config, seed=6, swiglu_limit=0.05)
    assert runner.routed_experts.quant_method.runtime.activation_clamp == pytest.approx(0.05)
    x, logits = _inputs(9, seed=2)
    y = _forward(vllm_config, runner, x, logits)
    _assert_close(y, torch_moe(x, logits, ckpt, TOPK, activation_clamp=0.05))
    assert not torch.equal(y, torch_moe(x, logits, ckpt, TOPK))  # the clamp is active at this scale


class _SharedExpert(torch.nn.Module):
    """A shared expert stand-in: a bf16 projection, counting the batches it sees."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter((torch.randn(HIDDEN, HIDDEN, generator=g) * 0.02).to(torch.bfloat16),
                                         requires_grad=False)
        self.batches = []

    def forward(self, x):
        self.batches.append(x.shape[0])
        return x @ self.weight.T


@pytest.mark.parametrize("n", [0, 3, 64])
def test_the_method_runs_the_shared_experts_itself(vllm_config, dist_env, reference_executor, n):
    """vLLM lets the method run the shared experts (they would otherwise go to an auxiliary stream
    launched before the persistent kernel at small batches); the layer's output is routed + shared, the
    shared experts run once per call."""
    from megamoe_plugin.vllm_plugin import compat

    order = compat.shared_experts_in_method_order()
    if order is None:
        pytest.skip(f"vLLM {compat.vllm_version()} has no order in which the MoE method runs the shared experts")
    shared = _SharedExpert(seed=3)
    runner, ckpt, _ = _loaded_layer(vllm_config, seed=9, shared_experts=shared)
    assert runner.routed_experts.quant_method.mk_can_overlap_shared_experts
    x, logits = _inputs(n, seed=4)
    assert runner._shared_experts._determine_shared_experts_order(x) == order
    y = _forward(vllm_config, runner, x, logits)
    assert shared.batches == [n]
    want = (torch_moe(x, logits, ckpt, TOPK).float() + shared(x).float()).to(torch.bfloat16)
    if n:
        _assert_close(y, want)
    assert y.shape == (n, HIDDEN)


def test_shared_experts_launch_after_the_kernel_on_a_side_stream_the_layer_joins(monkeypatch):
    """The stream protocol of serving.SharedExpertsAfterKernel, on recording stand-ins for CUDA streams and
    events: the side stream starts where the layer's stream stood before the kernel, the shared experts
    are launched after the kernel, the layer's stream waits for them; one side stream per layer stream."""
    import contextlib

    from megamoe_plugin.serving import SharedExpertsAfterKernel

    log, made = [], []

    class Stream:
        def __init__(self, name=None):
            self.name = name or f"side{len(made)}"
            made.append(self.name)

        def wait_event(self, event):
            log.append(("wait", self.name, event.name))

    class Event:
        def __init__(self):
            self.name = f"event{len(made)}"
            made.append(self.name)

        def record(self, stream):
            log.append(("record", self.name, stream.name))

    current = [Stream("layer")]

    @contextlib.contextmanager
    def on_stream(stream):
        before, current[0] = current[0], stream
        yield
        current[0] = before

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    runner = SharedExpertsAfterKernel()
    for call in range(2):
        log.clear()
        out = runner.run(lambda: log.append(("kernel", current[0].name)) or "y",
                         lambda: log.append(("shared", current[0].name)) or "s", on_cuda=True)
        assert out == ("y", "s") and current[0].name == "layer"
        assert log == [("record", "event2", "layer"), ("kernel", "layer"), ("wait", "side1", "event2"),
                       ("shared", "side1"), ("record", "event3", "side1"), ("wait", "layer", "event3")], (call, log)
    assert made == ["layer", "side1", "event2", "event3"]  # made once
    log.clear()
    assert runner.run(lambda: log.append("kernel") or "y", lambda: log.append("shared") or "s",
                      on_cuda=False) == ("y", "s")
    assert log == ["shared", "kernel"]  # no streams on the CPU


def test_layers_of_one_shape_share_one_buffer(vllm_config, dist_env, reference_executor):
    from megamoe_plugin.vllm_plugin import executor

    a, ckpt_a, _ = _loaded_layer(vllm_config, seed=7)
    b, ckpt_b, _ = _loaded_layer(vllm_config, seed=8)
    x, logits = _inputs(5)
    ya, yb = _forward(vllm_config, a, x, logits), _forward(vllm_config, b, x, logits)
    assert executor.num_buffers() == 1
    _assert_close(ya, torch_moe(x, logits, ckpt_a, TOPK))
    _assert_close(yb, torch_moe(x, logits, ckpt_b, TOPK))


def _apply_zero_then_tokens(runner, ckpt):
    """The experts' apply on an empty step, then on a step with tokens: the empty step
    returns an empty bf16 output and leaves the layer computing the oracle's values."""
    ex = runner.routed_experts
    empty = ex.quant_method.apply(ex, torch.zeros(0, HIDDEN, dtype=torch.bfloat16), torch.zeros(0, TOPK),
                                  torch.zeros(0, TOPK, dtype=torch.int32))
    assert empty.shape == (0, HIDDEN) and empty.dtype == torch.bfloat16
    x, logits = _inputs(4, seed=7)
    weights, ids = torch_softmax_topk(x, logits, TOPK, renormalize=True)
    _assert_close(ex.quant_method.apply(ex, x, weights, ids), torch_moe(x, logits, ckpt, TOPK))


def test_reference_executor_zero_tokens(vllm_config, dist_env, reference_executor):
    runner, ckpt, _ = _loaded_layer(vllm_config, seed=9)
    _apply_zero_then_tokens(runner, ckpt)


# ----------------------------------------------------------------------------- kernel executor glue


class FakeSM90:
    def device_capability(self):
        return (9, 0)

    def device_name(self):
        return "NVIDIA H200"

    def ep_topology(self):  # pragma: no cover - one rank: never asked
        raise AssertionError("no topology probe for one EP rank")


@pytest.fixture
def kernel_executor_with_fake_op(monkeypatch):
    """Executor 'kernel' on CPU: fake SM90 probe, recording stand-ins for warmup and the op
    (the stand-in op computes the reference from the staged buffer and the weights it is given)."""
    from megamoe_plugin.vllm_plugin import executor, refusals

    calls = record_kernel_calls(monkeypatch)
    previous = executor.set_executor("kernel")
    executor.clear_buffers()
    with refusals.override_probe(FakeSM90()):
        yield calls
    executor.set_executor(previous)
    executor.clear_buffers()


def test_kernel_executor_glue(vllm_config, dist_env, kernel_executor_with_fake_op):
    calls = kernel_executor_with_fake_op
    a, ckpt_a, _ = _loaded_layer(vllm_config, seed=10)
    b, ckpt_b, _ = _loaded_layer(vllm_config, seed=11)
    x, logits = _inputs(6, seed=4)
    ya = _forward(vllm_config, a, x, logits)
    yb = _forward(vllm_config, b, x, logits)
    _assert_close(ya, torch_moe(x, logits, ckpt_a, TOPK))
    _assert_close(yb, torch_moe(x, logits, ckpt_b, TOPK))

    # One buffer for the shape, sized for max_num_batched_tokens, warmed up once, before the
    # first call, for both layers' weights (b's params are built before its first call).
    assert len({id(c["buf"]) for c in calls["op"]}) == 1
    buf = calls["op"][0]["buf"]
    assert (buf.num_experts, buf.num_topk, buf.hidden, buf.intermediate_size) == (NUM_EXPERTS, TOPK, HIDDEN,
                                                                                 INTERMEDIATE)
    assert buf.num_max_tokens_per_rank >= MAX_BATCHED_TOKENS
    assert len(calls["warmup"]) == 1
    warm_buf, counts, _, warm_weights, other_layers = calls["warmup"][0]
    assert warm_buf is buf
    assert counts[0] == 1 and counts[-1] == buf.num_max_tokens_per_rank and counts == sorted(set(counts))

    def pointers(l1, l2):
        return tuple(t.data_ptr() for t in (*l1, *l2))

    first_layer = pointers(calls["op"][0]["l1"], calls["op"][0]["l2"])
    eb = b.routed_experts
    second_layer = pointers((eb.w13_weight, eb.w13_weight_scale_inv), (eb.w2_weight, eb.w2_weight_scale_inv))
    assert pointers(*warm_weights) == first_layer
    assert [pointers(*w) for w in other_layers] == [second_layer]

    # The op reads the layer's parameters' storage (kernel layout: EPLB's in-place expert moves act
    # on what it reads), the staged tokens, and the rank-equal token count for the config lookup.
    ex = a.routed_experts
    first = calls["op"][0]
    for got, param in zip((*first["l1"], *first["l2"]),
                          (ex.w13_weight, ex.w13_weight_scale_inv, ex.w2_weight, ex.w2_weight_scale_inv)):
        assert got.data_ptr() == param.data_ptr() and got.shape == param.shape
    assert first["n"] == 6 and first["config"] == 6 and first["clamp"] is None
    assert first["numerics"] is None  # MEGAMOE_NUMERICS, else "fast"


def test_batch_invariant_vllm_runs_exact_numerics(vllm_config, dist_env, kernel_executor_with_fake_op, monkeypatch):
    """VLLM_BATCH_INVARIANT=1: vLLM accepts only experts that declare batch invariance, and
    ours keep that promise by running (and warming up) numerics="exact"."""
    from megamoe_plugin.vllm_plugin.moe_method import MegaMoEExperts

    assert MegaMoEExperts._supports_batch_invariance() is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    calls = kernel_executor_with_fake_op
    layer, ckpt, _ = _loaded_layer(vllm_config, seed=13)
    x, logits = _inputs(5, seed=6)
    _assert_close(_forward(vllm_config, layer, x, logits), torch_moe(x, logits, ckpt, TOPK))
    assert [c["numerics"] for c in calls["op"]] == ["exact"]
    assert [w[2] for w in calls["warmup"]] == ["exact"]


def test_kernel_executor_zero_tokens_still_calls_op(vllm_config, dist_env, kernel_executor_with_fake_op):
    calls = kernel_executor_with_fake_op
    runner, ckpt, _ = _loaded_layer(vllm_config, seed=12)
    _apply_zero_then_tokens(runner, ckpt)
    assert [c["n"] for c in calls["op"]] == [0, 4]  # every rank takes part in every step, empty ones too


def test_executor_selection(monkeypatch):
    from megamoe_plugin.vllm_plugin import executor

    previous = executor.set_executor(None)
    try:
        monkeypatch.delenv("MEGAMOE_EXECUTOR", raising=False)
        assert executor.get_executor() == "kernel"  # the default: never the reference implicitly
        monkeypatch.setenv("MEGAMOE_EXECUTOR", "reference")
        assert executor.get_executor() == "reference"
        monkeypatch.setenv("MEGAMOE_EXECUTOR", "cpu")
        with pytest.raises(ValueError, match="MEGAMOE_EXECUTOR='cpu' is not one of"):
            executor.get_executor()
        with pytest.raises(ValueError):
            executor.set_executor("gpu")
    finally:
        executor.set_executor(previous)


def test_rank_equal_token_count_uses_dp_metadata(monkeypatch):
    import types

    import vllm.forward_context as fc

    from megamoe_plugin.vllm_plugin import executor

    ctx = types.SimpleNamespace(dp_metadata=types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([3, 17, 5]),
                                                                   local_sizes=None))
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)
    assert executor.rank_equal_num_tokens(3) == 17
    ctx.dp_metadata.local_sizes = [4, 9]
    assert executor.rank_equal_num_tokens(4) == 9
    ctx.dp_metadata = None
    assert executor.rank_equal_num_tokens(3) == 3
