"""The reference's shared-expert term (docs/design.md section 2, "Shared experts"): every token
passes through each shared expert with routing weight `shared_scale`, summed after the routed
slots. Judged by two equivalences with the routed-only reference, which other tests judge against
a naive oracle: a shared expert is a routed slot after the others that every token sends to an
expert holding its weights; and with every routed slot empty, the output is the shared experts'
alone, which a one-expert world computes."""
import pytest
import torch

from megamoe_plugin.reference import mega_moe
from megamoe_plugin.testing import random_inputs, random_layer, reference_ranks

H = 256


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _world(num_ranks, local_experts, topk, inter, tokens, routing, seed):
    gen = _gen(seed)
    layers = [random_layer(local_experts, H, inter, "cpu", gen) for _ in range(num_ranks)]
    inputs = [random_inputs(n, H, local_experts * num_ranks, topk, routing, "cpu", gen) for n in tokens]
    ranks = reference_ranks(inputs)
    return ranks, [layer.checkpoint for layer in layers]


def _shared(num_shared, inter, seed):
    return random_layer(num_shared, H, inter, "cpu", _gen(seed)).checkpoint


@pytest.mark.parametrize("num_ranks, local_experts, topk, num_shared, tokens, routing, scale", [
    (1, 4, 2, 1, [7], "uniform", 1.0),
    (2, 3, 3, 2, [5, 0], "masked", 2.5),
    (4, 2, 1, 1, [1, 9, 3, 4], "one_expert", 0.125),
    (2, 4, 6, 3, [16, 11], "masked", -0.75),
])
def test_a_shared_expert_is_a_routed_slot_after_the_others(num_ranks, local_experts, topk, num_shared, tokens,
                                                          routing, scale):
    inter = 256
    ranks, weights = _world(num_ranks, local_experts, topk, inter, tokens, routing, 3)
    shared = _shared(num_shared, inter, 4)
    ys = mega_moe(ranks, weights, local_experts * num_ranks, shared=shared, shared_scale=scale)

    # The same model with the shared experts as num_shared more local experts on every rank (rank
    # 0's copies receive the tokens): global ids move from r * L + l to r * (L + S) + l.
    wide = local_experts + num_shared
    wide_weights = [{key: torch.cat([w[key], shared[key]]) for key in w} for w in weights]
    wide_ranks = []
    for r in ranks:
        idx = r["topk_idx"]
        moved = torch.where(idx >= 0, idx // local_experts * wide + idx % local_experts, idx)
        extra = torch.arange(local_experts, wide).expand(idx.shape[0], num_shared)
        wide_ranks.append(dict(r, topk_idx=torch.cat([moved, extra], dim=1),
                               topk_weights=torch.cat([r["topk_weights"],
                                                       torch.full((idx.shape[0], num_shared), scale)], dim=1)))
    expected = mega_moe(wide_ranks, wide_weights, wide * num_ranks)
    for y, want in zip(ys, expected):
        assert torch.equal(y, want)
    without = mega_moe(ranks, weights, local_experts * num_ranks)
    assert any(not torch.equal(y, w) for y, w in zip(ys, without) if y.numel())  # the term is there


def test_the_shared_experts_have_their_own_intermediate_size():
    """Routed slots all empty: each rank's output is its tokens through the shared expert (Is 384,
    the routed experts' I 256), as a one-expert world with every token on that expert computes."""
    ranks, weights = _world(2, 2, 2, 256, [6, 3], "uniform", 5)
    for r in ranks:
        r["topk_idx"] = torch.full_like(r["topk_idx"], -1)
    shared = _shared(1, 384, 6)
    ys = mega_moe(ranks, weights, 4, shared=shared, shared_scale=1.5)
    # One rank holding every token (the same rows in one GEMM, so the same float32 sums).
    tokens = sum(r["x"].shape[0] for r in ranks)
    alone = {key: torch.cat([r[key] for r in ranks]) for key in ("x", "x_sf")}
    alone.update(topk_idx=torch.zeros(tokens, 1, dtype=torch.int64), topk_weights=torch.full((tokens, 1), 1.5))
    assert [y.shape[0] for y in ys] == [6, 3]
    assert torch.equal(torch.cat(ys), mega_moe([alone], [shared], 1)[0])


def test_no_shared_experts_is_the_routed_reference():
    ranks, weights = _world(2, 2, 2, 256, [4, 4], "masked", 7)
    for y, want in zip(mega_moe(ranks, weights, 4, shared=None), mega_moe(ranks, weights, 4)):
        assert torch.equal(y, want)


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop("w2_scale"), r"shared.*w2_scale"),
    (lambda s: s.update(w13=s["w13"][:, :, :128], w13_scale=s["w13_scale"][:, :, :1],
                        w2=s["w2"][:, :128], w2_scale=s["w2_scale"][:, :1]), "H=128"),
    (lambda s: s.update(w13_scale=s["w13_scale"].double()), "shared"),
])
def test_bad_shared_experts_are_named(change, match):
    ranks, weights = _world(1, 2, 2, 256, [3], "uniform", 8)
    shared = dict(_shared(1, 256, 9))
    change(shared)
    with pytest.raises(ValueError, match=match):
        mega_moe(ranks, weights, 2, shared=shared)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), True, "1"])
def test_a_bad_shared_scale_is_named(scale):
    ranks, weights = _world(1, 2, 2, 256, [3], "uniform", 8)
    with pytest.raises(ValueError, match="shared_scale must be a finite number"):
        mega_moe(ranks, weights, 2, shared=_shared(1, 256, 9), shared_scale=scale)
