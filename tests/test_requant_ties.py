"""Exact mode's judge and step 4's ties (megamoe_plugin.reference.tie_allowances).

A float32-faithful kernel sums its L1 in another order than the reference, a few float32 ulps
apart. Where the reference's act / s lies on the midpoint of two e4m3 values, the kernel may round
it the other way; on a token's dominant element that moves the token past exact mode's 1e-2. The
judge excuses exactly that: a token over the bound passes by no more than its ties can move it.
"""
import torch

from megamoe_plugin.fp8 import FP8_DTYPE, quantize_weight_blocks, requant_tie_deltas, requantize_groups
from megamoe_plugin.reference import _matmul_nt, mega_moe, tie_allowances, token_rel_errors
from megamoe_plugin.testing import Layer, output_errors, reference_ranks
from megamoe_plugin.weights import dequantize_weight

H = I = 128
TIE = 1  # the intermediate column of token 0's tie
TOKENS = 64


def test_requant_tie_deltas_finds_midpoints_only():
    act = torch.tensor([448.0, 336.0, 336.0 * (1 + 2.0 ** -22), 336.0 * (1 + 1e-3), 100.0, -336.0, 0.0, 1e-9])
    act = act.repeat(16).unsqueeze(0)  # one 128-wide group whose amax is 448: s = 1
    q1, s1 = requantize_groups(act, 128)
    within = torch.full_like(act, 1e-4)
    deltas = requant_tie_deltas(act, q1, s1, 128, within)[0, :8].tolist()
    # 336 rounds to even (320), so its other rounding is +32; just above the midpoint it went to
    # 352; 336.3 and 448 are no ties; 100 sits between 96 and 104; 0 and 1e-9 are no ties either.
    assert deltas == [0.0, 32.0, -32.0, 0.0, 8.0, -32.0, 0.0, 0.0]
    # The same values times 2^-20 (s = 2^-20) with the error bound scaled alike tie at the same places.
    q, s = requantize_groups(act * 2.0 ** -20, 128)
    assert requant_tie_deltas(act * 2.0 ** -20, q, s, 128, within * 2.0 ** -20)[0, :8].tolist() == [
        d * 2.0 ** -20 for d in deltas]
    # An error bound that reaches 336.3's midpoint (336) makes it a tie too.
    assert requant_tie_deltas(act, q1, s1, 128, torch.full_like(act, 0.4))[0, 3] == -32


def _case():
    """TOKENS tokens, one expert. x is 1 in column 0 (the others: and -1 in column 1), so the L1 output is
    column 0 of w13 (minus column 1). Gate 32 (silu(32) = 32 in float32) and up 4 make intermediate
    column 0's act 128, the group's amax; column TIE's is 32 * 3 = 96 for token 0 (act / s = 336, the
    midpoint of 320 and 352) and 32 * 2.5 = 80 for the others (280: no tie); the rest is small. The
    others make it a call whose calc_diff is within exact mode's bound."""
    x = torch.zeros(TOKENS, H)
    x[:, 0] = 1.0
    x[1:, 1] = -1.0
    inputs = dict(x=x.to(FP8_DTYPE), x_sf=torch.ones(TOKENS, 1), topk_idx=torch.zeros(TOKENS, 1, dtype=torch.int64),
                  topk_weights=torch.ones(TOKENS, 1))
    w13 = torch.zeros(1, 2 * I, H)
    w13[0, :I, 0] = 0.5
    w13[0, I:, 0] = 0.25
    w13[0, [0, TIE], 0] = 32.0
    w13[0, [I, I + TIE], 0] = torch.tensor([4.0, 3.0])
    w13[0, I + TIE, 1] = 0.5
    w2 = torch.randn(1, H, I, generator=torch.Generator().manual_seed(0)) / I ** 0.5
    checkpoint = dict(w13=w13.to(FP8_DTYPE), w13_scale=torch.ones(1, 2 * I // 128, H // 128))  # every value exact
    checkpoint["w2"], checkpoint["w2_scale"] = quantize_weight_blocks(w2)
    return inputs, checkpoint


def _token0_up_times(factor):
    """Another float32 evaluation of step 1: token 0's up value at column TIE times `factor`."""
    def l1_gemm(x, x_sf, w13, w13_scale):
        out = _matmul_nt(x.float() * x_sf.repeat_interleave(128, 1), dequantize_weight(w13, w13_scale))
        out[0, I + TIE] *= factor
        return out
    return l1_gemm


def test_the_judge_excuses_a_tie_rounded_the_other_way_and_nothing_else():
    inputs, checkpoint = _case()
    layer = Layer(checkpoint=checkpoint, l1=(), l2=())
    ref = mega_moe([inputs], [checkpoint], 1)[0]
    # A few ulps off, to whichever side rounds 336 the other way than the reference did.
    others = [mega_moe([inputs], [checkpoint], 1, l1_gemm=_token0_up_times(1 + sign * 2.0 ** -21))[0]
              for sign in (1, -1)]
    other = next(y for y in others if not torch.equal(y, ref))
    rel = token_rel_errors(other, ref)
    assert rel[0] > 1e-2 and not rel[1:].any(), rel  # the tie moves its token far past exact mode's bound
    allowance = tie_allowances([inputs], [checkpoint], 1)[0]
    assert allowance[0] > 0 and not allowance[1:].any(), allowance

    assert output_errors([other], [inputs], [layer], 1, "exact") == [None]
    # The same token three times as far, or the untied token 2% off, is not excused.
    thrice = other.clone()
    thrice[0] = (ref[0].double() + 3 * (other[0].double() - ref[0].double())).to(torch.bfloat16)
    untied_off = other.clone()
    untied_off[1] = (ref[1].double() * 1.02).to(torch.bfloat16)
    for bad in (thrice, untied_off):
        (error,) = output_errors([bad], [inputs], [layer], 1, "exact")
        assert error is not None and "requant ties excuse up to" in error, error


def test_any_evaluation_within_the_error_model_passes_the_judge():
    """Another L1 evaluation, off by up to L1_SUM_ERROR * sum |a b| per output (random, either sign),
    with LLM-like outlier channels in the activations and 2 ranks: codes round otherwise at ties, and
    every token passes exact mode's judge; what it excuses stays small."""
    from megamoe_plugin.reference import L1_SUM_ERROR
    from megamoe_plugin.fp8 import dequantize_per_token_group
    from megamoe_plugin.testing import random_inputs, random_layer

    hidden, inter, topk, local_experts, tokens, ranks = 512, 256, 4, 4, 96, 2
    gen = torch.Generator().manual_seed(5)
    layers = [random_layer(local_experts, hidden, inter, "cpu", gen) for _ in range(ranks)]
    inputs = []
    for _ in range(ranks):
        rank_inputs = random_inputs(tokens, hidden, local_experts * ranks, topk, "uniform", "cpu", gen)
        outliers = torch.ones(hidden)
        outliers[torch.randperm(hidden, generator=gen)[:8]] = 40.0  # a few channels far larger, as in LLMs
        rank_inputs["x"], rank_inputs["x_sf"] = fp8_quantize(rank_inputs["hidden_states"].float() * outliers)
        inputs.append(rank_inputs)
    noise_gen = torch.Generator().manual_seed(6)

    def perturbed_l1(x, x_sf, w13, w13_scale):
        a = dequantize_per_token_group(x, x_sf)
        b = dequantize_weight(w13, w13_scale)
        noise = (torch.rand(a.shape[0], b.shape[0], generator=noise_gen, dtype=torch.float64) * 2 - 1)
        return (_matmul_nt(a, b).double() + noise * L1_SUM_ERROR * (a.abs().double() @ b.abs().double().T)).float()

    rank_args = reference_ranks(inputs)
    checkpoints = [layer.checkpoint for layer in layers]
    ys, other_rows = mega_moe(rank_args, checkpoints, local_experts * ranks, l1_gemm=perturbed_l1,
                              return_intermediates=True)
    _, ref_rows = mega_moe(rank_args, checkpoints, local_experts * ranks, return_intermediates=True)
    flipped = sum(int((o["act_q"].view(torch.uint8) != r["act_q"].view(torch.uint8)).sum())
                  for o, r in zip(other_rows, ref_rows))
    assert flipped > 0  # the perturbation did round codes otherwise, so the judge had something to excuse
    assert output_errors(ys, inputs, layers, local_experts * ranks, "exact") == [None] * ranks
    refs = mega_moe(rank_args, checkpoints, local_experts * ranks)
    for allowance, ref in zip(tie_allowances(rank_args, checkpoints, local_experts * ranks), refs):
        relative = allowance / ref.double().norm(dim=1)
        # Most excused amounts are codes of small magnitude (cancellation in their L1 sums): far below
        # the 1e-2 bound; one on a token's dominant element is at most about 1/16 of it.
        assert float(relative.quantile(0.9)) < 1e-3 and float(relative.max()) < 3e-2, relative


def fp8_quantize(x):
    from megamoe_plugin.fp8 import quantize_per_token_group
    return quantize_per_token_group(x)
