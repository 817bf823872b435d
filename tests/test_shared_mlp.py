"""megamoe_plugin.shared_mlp: what both plugins check about a framework's shared-expert MLP
(gate_up_proj / SiluAndMul / down_proj of 128x128-block FP8 linears) before the kernel runs it as
S experts, and what they do with it, on plain stand-in modules."""
import pytest
import torch

from contract_oracle import quant_blocks
from megamoe_plugin import shared_mlp
from megamoe_plugin.weights import split_mlp

HIDDEN, INTER = 256, 128


class Linear(torch.nn.Module):
    def __init__(self, rows, cols, gen, tp_size=1, bias=False):
        super().__init__()
        q, s = quant_blocks(torch.randn(rows, cols, generator=gen))
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
        self.tp_size = tp_size
        self.bias = torch.nn.Parameter(torch.zeros(rows), requires_grad=False) if bias else None


class SiluAndMul(torch.nn.Module):
    pass


class MLP(torch.nn.Module):
    def __init__(self, num_shared=2, inter=INTER, act=SiluAndMul, **linear):
        super().__init__()
        g = torch.Generator().manual_seed(num_shared)
        self.gate_up_proj = Linear(2 * num_shared * inter, HIDDEN, g, **linear)
        self.down_proj = Linear(HIDDEN, num_shared * inter, g, **linear)
        self.act_fn = act()


@pytest.mark.parametrize("change, problem", [
    (None, None),
    (lambda w, s: (w.float(), s), "not contiguous [256, 384] float8_e4m3fn"),
    (lambda w, s: (w, s[:1]), "[2, 3] float32 block scales"),
    (lambda w, s: (w.t().contiguous().t(), s), "not contiguous"),
    (lambda w, s: (None, s), "not contiguous"),
])
def test_block_fp8_matrix_problem(change, problem):
    w, s = quant_blocks(torch.randn(256, 384))
    if change is not None:
        w, s = change(w, s)
    found = shared_mlp.block_fp8_matrix_problem(w, s, 256, 384)
    assert found is None if problem is None else problem in found


@pytest.mark.parametrize("mlp, reason", [
    (lambda: MLP(act=torch.nn.GELU), "MLP is not a gate_up_proj / SiluAndMul / down_proj MLP"),
    (lambda: MLP(bias=True), "its Linear has a bias"),
    (lambda: MLP(tp_size=2), "its Linear is sharded over 2 tensor-parallel ranks"),
    (lambda: MLP(num_shared=3), "their intermediate size 384 is no multiple of the routed experts' 256"),
])
def test_what_the_kernel_cannot_take_is_named(mlp, reason):
    assert shared_mlp.problem(mlp(), HIDDEN, 2 * INTER) == reason


def test_a_taken_mlp_becomes_its_experts_and_gives_its_storage_back():
    mlp = MLP(num_shared=2)
    assert shared_mlp.problem(mlp, HIDDEN, INTER) is None
    assert shared_mlp.problem(mlp, HIDDEN, INTER, lambda linear: f"{type(linear).__name__} repacks") == \
        "Linear repacks"  # the framework's own reason
    mlp.gate_up_proj.weight_scale_inv.data = mlp.gate_up_proj.weight_scale_inv.data.t().contiguous()
    assert "[4, 2] float32 block scales" in shared_mlp.problem(mlp, HIDDEN, INTER)
    mlp = MLP(num_shared=2)
    assert shared_mlp.num_experts(mlp, INTER) == 2
    experts = shared_mlp.as_experts(mlp, INTER)
    want = split_mlp(mlp.gate_up_proj.weight.data, mlp.gate_up_proj.weight_scale_inv.data, mlp.down_proj.weight.data,
                     mlp.down_proj.weight_scale_inv.data, INTER)
    assert all(torch.equal(experts[k].view(torch.uint8) if experts[k].element_size() == 1 else experts[k],
                           want[k].view(torch.uint8) if want[k].element_size() == 1 else want[k]) for k in want)
    shared_mlp.release(mlp)
    assert all(p.numel() == 0 for p in mlp.parameters())
    assert experts["w13"].shape == (2, 2 * INTER, HIDDEN)  # the experts are copies
