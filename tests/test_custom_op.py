"""torch.ops.megamoe.fp8_mega_moe (megamoe_plugin/custom_op.py) on CPU: registered on
import, mutating y, resolving the buffer key, traceable by torch.compile in one graph.
The kernel itself needs an SM90 GPU: its stand-in here computes the float32 reference
from the staged buffer, so compiled and eager results can be compared."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megamoe_plugin as mm
import megamoe_plugin.ops as ops
from megamoe_plugin.custom_op import fp8_mega_moe as op_call
from megamoe_plugin.testing import random_layer, random_routing

E, N, K, H, I = 4, 16, 2, 256, 128


@pytest.fixture(scope="module")
def layer():
    return random_layer(E, H, I, "cpu", torch.Generator().manual_seed(0))


@pytest.fixture
def buf():
    return mm.get_symm_buffer(None, E, N, K, H, I, device="cpu")


@pytest.fixture
def reference_kernel(monkeypatch):
    """ops.fp8_mega_moe replaced by the reference on the staged buffer; records its calls."""
    calls = []

    def kernel(y, l1, l2, buf, activation_clamp=None, fast_math=True, cumulative_local_expert_recv_stats=None,
               config_num_tokens=None, numerics=None):
        calls.append(dict(y=y, l1=l1, l2=l2, buf=buf, clamp=activation_clamp, fast_math=fast_math,
                          stats=cumulative_local_expert_recv_stats, config=config_num_tokens, numerics=numerics))
        n = y.shape[0]
        (w13, s13), (w2, s2) = mm.untransform_weights(tuple(l1), tuple(l2))
        ranks = [dict(x=buf.x[:n], x_sf=buf.x_sf[:n], topk_idx=buf.topk_idx[:n], topk_weights=buf.topk_weights[:n])]
        (ref,) = mm.reference.mega_moe(ranks, [dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)], E,
                                       activation_clamp=activation_clamp)
        y.copy_(ref)
        return y

    monkeypatch.setattr(ops, "fp8_mega_moe", kernel)
    return calls


def _inputs(n, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    idx = random_routing(n, E, K, "uniform", "cpu", gen)
    weights = torch.rand(n, K, generator=gen)
    return hidden, idx, weights


class MoE(torch.nn.Module):
    """What a model's MoE layer does per forward: stage (unless the caller did), then the op."""

    def __init__(self, layer, buf, stage):
        super().__init__()
        self.l1, self.l2, self.buf, self.stage = layer.l1, layer.l2, buf, stage

    def forward(self, hidden, idx, weights):
        n = mm.stage_inputs(self.buf, hidden, idx, weights) if self.stage else hidden.shape[0]
        y = torch.empty(n, H, dtype=torch.bfloat16)
        return op_call(y, self.l1, self.l2, self.buf, activation_clamp=7.0, config_num_tokens=n)


def test_registered_on_import_with_y_and_stats_mutated():
    schema = torch.ops.megamoe.fp8_mega_moe.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["y", "cumulative_local_expert_recv_stats"]
    assert len(schema.returns) == 0


def test_eager_call_reaches_the_kernel_with_the_buffer_and_weights(layer, buf, reference_kernel):
    hidden, idx, weights = _inputs(5, seed=1)
    n = mm.stage_inputs(buf, hidden, idx, weights)
    y = torch.zeros(n, H, dtype=torch.bfloat16)
    stats = torch.zeros(E, dtype=torch.int32)
    assert op_call(y, layer.l1, layer.l2, buf, activation_clamp=3.0, fast_math=False,
                   cumulative_local_expert_recv_stats=stats, config_num_tokens=8, numerics="exact") is y
    (call,) = reference_kernel
    assert call["buf"] is buf and call["y"].data_ptr() == y.data_ptr() and call["stats"].data_ptr() == stats.data_ptr()
    assert [t.data_ptr() for t in (*call["l1"], *call["l2"])] == [t.data_ptr() for t in (*layer.l1, *layer.l2)]
    assert (call["clamp"], call["fast_math"], call["config"], call["numerics"]) == (3.0, False, 8, "exact")
    assert y.abs().sum() > 0  # the kernel's writes are y's


def test_without_an_sm90_gpu_the_op_raises_the_kernel_error(layer, buf):
    with pytest.raises(RuntimeError):
        op_call(torch.zeros(1, H, dtype=torch.bfloat16), layer.l1, layer.l2, buf)


def test_bad_buffer_arguments_are_named(layer, buf):
    y = torch.zeros(1, H, dtype=torch.bfloat16)
    weights = (*layer.l1, *layer.l2)
    with pytest.raises(ValueError, match="buffer_key=-1 names no live SymmBuffer"):
        torch.ops.megamoe.fp8_mega_moe(y, *weights, buf.storage, -1, None, True, None, None, None)
    other = mm.get_symm_buffer(None, E, 2 * N, K, H, I, device="cpu")
    with pytest.raises(ValueError, match=f"buffer_storage has shape .* buffer_key={buf.key} has"):
        torch.ops.megamoe.fp8_mega_moe(y, *weights, other.storage, buf.key, None, True, None, None, None)
    with pytest.raises(TypeError, match="buf must be a SymmBuffer"):
        op_call(y, layer.l1, layer.l2, object())
    other.close()
    with pytest.raises(ValueError, match="buf was closed"):
        op_call(y, layer.l1, layer.l2, other)


def test_fake_implementation_runs_no_kernel(layer, buf, reference_kernel):
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (torch.zeros(3, H, dtype=torch.bfloat16), *layer.l1, *layer.l2,
                                                buf.storage)]
        torch.ops.megamoe.fp8_mega_moe(*fake, buf.key, None, True, None, 3, None)
    assert reference_kernel == []


# aot_eager stages outside the graph: AOTAutograd refuses graph inputs that are views of one
# storage with different dtypes and are mutated, which staging into buf.x / topk_idx is.
@pytest.mark.parametrize("backend, stage", [("eager", True), ("aot_eager", False)])
def test_compiled_layer_is_one_graph_and_matches_eager(layer, buf, reference_kernel, backend, stage):
    torch._dynamo.reset()
    module = MoE(layer, buf, stage)
    hidden, idx, weights = _inputs(6, seed=2)
    mm.stage_inputs(buf, hidden, idx, weights)
    expected = module(hidden, idx, weights).clone()
    # fullgraph=True: a graph break would raise instead of splitting the layer.
    got = torch.compile(module, fullgraph=True, backend=backend)(hidden, idx, weights)
    assert torch.equal(got, expected)
    assert len(reference_kernel) == 2 and reference_kernel[1]["buf"] is buf
    explanation = torch._dynamo.explain(module)(hidden, idx, weights)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_opcheck(layer, buf, reference_kernel):
    hidden, idx, weights = _inputs(4, seed=3)
    n = mm.stage_inputs(buf, hidden, idx, weights)
    args = (torch.zeros(n, H, dtype=torch.bfloat16), *layer.l1, *layer.l2, buf.storage, buf.key, None, True,
            torch.zeros(E, dtype=torch.int32), n, None)
    # test_schema (that only y and the stats are written) compares every argument before and
    # after the call, which torch cannot do for FP8 tensors on CPU; the declaration itself is
    # test_registered_on_import_with_y_and_stats_mutated's.
    torch.library.opcheck(torch.ops.megamoe.fp8_mega_moe.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
