"""testing.reference_slot_outputs and worst_slots: the exact reference's per-(token, slot) outputs, which
the kernel leaves in its combine buffer, so that a token that differs is traced to its slot."""
import torch

from megamoe_plugin.reference import mega_moe
from megamoe_plugin.testing import random_inputs, random_layer, reference_ranks, reference_slot_outputs, worst_slots

H = 256


def test_reference_slot_outputs_sum_to_the_output():
    """Each (token, slot)'s bf16 o, which summed in slot order is y; worst_slots names a wrong one."""
    gen = torch.Generator().manual_seed(10)
    layers = [random_layer(3, H, 256, "cpu", gen) for _ in range(2)]
    inputs = [random_inputs(n, H, 6, 4, "masked", "cpu", gen) for n in (9, 4)]
    ys = mega_moe(reference_ranks(inputs),
                  [layer.checkpoint for layer in layers], 6)
    for r, slots in enumerate(reference_slot_outputs(inputs, layers, 6)):
        assert slots.shape == (inputs[r]["x"].shape[0], 4, H)
        empty = inputs[r]["topk_idx"] < 0
        assert (slots[empty] == 0).all() and bool((slots[~empty].abs().sum(-1) > 0).all())
        total = torch.zeros(slots.shape[0], H)
        for k in range(4):
            total += slots[:, k].float()
        assert torch.equal(total.to(torch.bfloat16), ys[r])
        # worst_slots names the one slot a stand-in kernel got wrong.
        wrong = slots.clone()
        token, slot = (~empty).nonzero()[-1].tolist()
        wrong[token, slot] *= 2  # exact in bf16: a relative error of 1
        named = worst_slots(wrong, slots, inputs[r]["topk_idx"], count=1)
        assert named == [f"token {token} slot {slot} expert {int(inputs[r]['topk_idx'][token, slot])}: "
                         f"relative L2 error 1.000e+00"]
