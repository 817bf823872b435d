"""Shared experts in the call (docs/design.md section 2, "Shared experts"): the kernel runs a
buffer's S shared experts as S more local experts of every rank, which each token's S more slots
name (stage_inputs), with the weights after the routed ones (transform_weights(shared=...)). On the
CPU the kernel's view of a call (the staged slots and the folded weights) goes through the reference
and must give, bit for bit, the reference's routed + shared output."""
import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.buffer import BufferShape, SymmBuffer, get_symm_buffer_size
from megamoe_plugin.staging import kernel_expert_ids, shared_expert_ids
from megamoe_plugin.testing import random_inputs, random_layer, reference_ranks

H, I, K, LOCAL, TOKENS = 256, 256, 3, 4, 37


def _buffers(num_ranks, num_shared):
    """Rank buffers on the CPU (staging only: the peers' addresses are never read here)."""
    shape = BufferShape.of_routed(num_ranks, LOCAL * num_ranks, TOKENS, K, H, I, num_shared_experts=num_shared)
    size = get_symm_buffer_size(num_ranks, LOCAL * num_ranks, TOKENS, K, H, I, num_shared_experts=num_shared)
    return [SymmBuffer(shape, torch.zeros(size, dtype=torch.uint8), r, tuple(range(1, num_ranks + 1)))
            for r in range(num_ranks)]


def test_the_shape_counts_the_shared_experts_as_local_experts_and_slots():
    shape = BufferShape.of_routed(4, 32, 64, 8, 1024, 512, num_shared_experts=1)
    assert (shape.num_experts, shape.num_local_experts, shape.num_topk) == (36, 9, 9)
    assert (shape.num_routed_experts, shape.num_routed_topk, shape.num_shared_experts) == (32, 8, 1)
    buf = _buffers(2, 2)[1]
    assert (buf.num_experts, buf.num_local_experts, buf.num_topk, buf.num_shared_experts) == (8, 4, 3, 2)
    assert buf.topk_idx.shape == (TOKENS, 5)  # the kernel's slots
    with pytest.raises(ValueError, match="num_topk=16 routed plus num_shared_experts=1 shared slots"):
        BufferShape.of_routed(1, 32, 64, 16, 1024, 512, num_shared_experts=1)
    with pytest.raises(ValueError, match="num_shared_experts=-1"):
        BufferShape.of_routed(1, 32, 64, 8, 1024, 512, num_shared_experts=-1)
    with pytest.raises(TypeError, match="num_shared_experts must be an int"):
        BufferShape.of_routed(1, 32, 64, 8, 1024, 512, num_shared_experts=1.0)


def test_kernel_ids_keep_empty_and_invalid_slots_as_they_were():
    # 2 ranks of 4 routed experts and 1 shared: rank 1's routed 4..7 become 5..8, its shared one is 9.
    ids = torch.tensor([[0, 3, 4, 7, -1, 8, 100, -2, -5]])
    out = kernel_expert_ids(ids, 4, 1)
    assert out.tolist() == [[0, 3, 5, 8, -1, 10, 125, -3, -7]]
    num_kernel_experts = 10
    valid_before = (ids >= -1) & (ids < 8)
    valid_after = (out >= -1) & (out < num_kernel_experts)
    assert torch.equal(valid_before, valid_after)
    assert list(shared_expert_ids(1, 4, 1)) == [9] and list(shared_expert_ids(0, 4, 2)) == [4, 5]


@pytest.mark.parametrize("num_ranks, num_shared, shared_scale", [(1, 1, 1.0), (2, 1, 0.5), (2, 2, 2.5)])
def test_the_kernels_view_of_a_call_is_routed_plus_shared(num_ranks, num_shared, shared_scale):
    gen = torch.Generator().manual_seed(num_ranks * 10 + num_shared)
    layers = [random_layer(LOCAL, H, I, "cpu", gen) for _ in range(num_ranks)]
    shared = random_layer(num_shared, H, I, "cpu", gen).checkpoint
    bufs = _buffers(num_ranks, num_shared)
    inputs = [random_inputs(TOKENS - r, H, LOCAL * num_ranks, K, ("uniform", "masked")[r % 2], "cpu", gen)
              for r in range(num_ranks)]
    kernel_view, kernel_weights = [], []
    for buf, layer, rank_inputs in zip(bufs, layers, inputs):
        n = mm.stage_inputs(buf, rank_inputs["hidden_states"], rank_inputs["topk_idx"], rank_inputs["topk_weights"],
                            shared_scale=shared_scale)
        kernel_view.append(dict(x=buf.x[:n], x_sf=buf.x_sf[:n], topk_idx=buf.topk_idx[:n],
                                topk_weights=buf.topk_weights[:n]))
        c = layer.checkpoint
        l1, l2 = mm.transform_weights((c["w13"], c["w13_scale"]), (c["w2"], c["w2_scale"]), shared=shared)
        (w13, s13), (w2, s2) = mm.untransform_weights(l1, l2)
        kernel_weights.append(dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2))
    fused = mm.reference.mega_moe(kernel_view, kernel_weights, bufs[0].shape.num_experts)
    routed = reference_ranks(inputs)
    want = mm.reference.mega_moe(routed, [layer.checkpoint for layer in layers], LOCAL * num_ranks, shared=shared,
                                 shared_scale=shared_scale)
    for got, expected in zip(fused, want):
        assert torch.equal(got, expected)


def test_transform_weights_takes_shared_experts_of_the_routed_shape_only():
    gen = torch.Generator().manual_seed(3)
    c = random_layer(LOCAL, H, I, "cpu", gen).checkpoint
    l1, l2 = (c["w13"], c["w13_scale"]), (c["w2"], c["w2_scale"])
    shared = random_layer(1, H, I, "cpu", gen).checkpoint
    (w13, s13), (w2, s2) = mm.transform_weights(l1, l2, shared=shared)
    (rw13, rs13), (rw2, rs2) = mm.transform_weights(l1, l2)
    (sw13, ss13), (sw2, ss2) = mm.transform_weights((shared["w13"], shared["w13_scale"]), (shared["w2"], shared["w2_scale"]))
    for folded, routed_part, shared_part in ((w13, rw13, sw13), (s13, rs13, ss13), (w2, rw2, sw2), (s2, rs2, ss2)):
        assert torch.equal(folded.view(torch.uint8), torch.cat([routed_part, shared_part]).view(torch.uint8))
    wider = random_layer(1, H, I + 128, "cpu", gen).checkpoint
    with pytest.raises(ValueError, match="need the routed experts' H=256, I=256"):
        mm.transform_weights(l1, l2, shared=wider)
    with pytest.raises(ValueError, match=r"missing \['w2_scale'\]"):
        mm.transform_weights(l1, l2, shared={k: v for k, v in shared.items() if k != "w2_scale"})


def test_stage_inputs_refuses_a_bad_shared_scale():
    buf = _buffers(1, 1)[0]
    gen = torch.Generator().manual_seed(4)
    r = random_inputs(3, H, LOCAL, K, "uniform", "cpu", gen)
    for bad in (float("nan"), "1", True):
        with pytest.raises(ValueError, match="shared_scale must be a finite number"):
            mm.stage_inputs(buf, r["hidden_states"], r["topk_idx"], r["topk_weights"], shared_scale=bad)


def test_a_call_without_the_shared_experts_weights_is_refused_by_name():
    buf = _buffers(1, 1)[0]
    gen = torch.Generator().manual_seed(5)
    layer = random_layer(LOCAL, H, I, "cpu", gen)
    y = torch.zeros(2, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"l1 holds 4 experts, the routed ones only: the buffer has 1 shared expert"):
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
