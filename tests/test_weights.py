"""SM90 weight layout: the gate/up interleave row by row, the scale mapping, the
256-row block property the kernel relies on, the exact inverse, and every validation
error."""
import pytest
import torch
import torch.nn.functional as F

import megamoe_plugin.fp8 as fp8
from contract_oracle import dequant_blocks, quant_blocks
from megamoe_plugin.weights import (append_experts, split_mlp, transform_weights, untransform_weights,
                                    validate_checkpoint_weights)

E_LOCAL, HIDDEN, INTER = 3, 384, 256


def _random_bytes(shape, gen):
    """Random fp8 bit patterns (NaN codes included: the transform must move bits, not values)."""
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(fp8.FP8_DTYPE)


def _checkpoint(seed=0, num_local_experts=E_LOCAL, hidden=HIDDEN, inter=INTER):
    gen = torch.Generator().manual_seed(seed)
    w13 = _random_bytes((num_local_experts, 2 * inter, hidden), gen)
    w13_scale = torch.rand(num_local_experts, 2 * inter // 128, hidden // 128, generator=gen)
    w2 = _random_bytes((num_local_experts, hidden, inter), gen)
    w2_scale = torch.rand(num_local_experts, hidden // 128, inter // 128, generator=gen)
    return w13, w13_scale, w2, w2_scale


def _bits(t):
    return t.view(torch.uint8)


def test_outputs_shapes_dtypes_contiguity():
    w13, w13_scale, w2, w2_scale = _checkpoint()
    (w13_t, w13_scale_t), (w2_t, w2_scale_t) = transform_weights((w13, w13_scale), (w2, w2_scale))
    assert w13_t.shape == w13.shape and w13_t.dtype == fp8.FP8_DTYPE
    assert w13_scale_t.shape == (E_LOCAL, INTER // 128, 2, HIDDEN // 128) and w13_scale_t.dtype == torch.float32
    for t in (w13_t, w13_scale_t, w2_t, w2_scale_t):
        assert t.is_contiguous() and t.device == w13.device


def test_gate_up_interleave_row_by_row():
    w13, w13_scale, w2, w2_scale = _checkpoint(seed=1)
    (w13_t, _), _ = transform_weights((w13, w13_scale), (w2, w2_scale))
    for e in range(E_LOCAL):
        for j in range(INTER // 8):
            for r in range(8):
                assert torch.equal(_bits(w13_t[e, 16 * j + r]), _bits(w13[e, 8 * j + r]))
                assert torch.equal(_bits(w13_t[e, 16 * j + 8 + r]), _bits(w13[e, INTER + 8 * j + r]))


def test_each_256_row_block_holds_one_gate_and_one_up_scale_block():
    # Tag every checkpoint row with its index (two bytes) and follow the rows through.
    w13, w13_scale, w2, w2_scale = _checkpoint(seed=2)
    rows = torch.arange(2 * INTER)
    tagged = _bits(w13).clone()
    tagged[:, :, 0] = (rows // 256).to(torch.uint8)
    tagged[:, :, 1] = (rows % 256).to(torch.uint8)
    (w13_t, w13_scale_t), _ = transform_weights((tagged.view(fp8.FP8_DTYPE), w13_scale), (w2, w2_scale))
    source_row = _bits(w13_t)[:, :, 0].long() * 256 + _bits(w13_t)[:, :, 1].long()
    for g in range(INTER // 128):
        block = source_row[:, 256 * g:256 * (g + 1)]
        expected = set(range(128 * g, 128 * g + 128)) | set(range(INTER + 128 * g, INTER + 128 * g + 128))
        for e in range(E_LOCAL):
            assert set(block[e].tolist()) == expected

    # Dequantizing block g with w13_scale_t[:, g] (gate runs with slot 0, up runs with
    # slot 1) gives the checkpoint's dequantized rows: the scales travel with their rows.
    finite = (_bits(w13) & 0x77).view(fp8.FP8_DTYPE)  # no NaN codes, so values compare equal
    reference = fp8.dequantize_weight_blocks(finite, w13_scale)
    (w13_t, w13_scale_t), _ = transform_weights((finite, w13_scale), (w2, w2_scale))
    run_is_up = (torch.arange(2 * INTER) // 8) % 2
    for g in range(INTER // 128):
        rows_t = slice(256 * g, 256 * (g + 1))
        row_scale = w13_scale_t[:, g, run_is_up[rows_t]].repeat_interleave(128, -1)  # [E, 256, H]
        deq_t = w13_t[:, rows_t].float() * row_scale
        assert torch.equal(deq_t, reference[:, source_row[0, rows_t]])


def test_scale_mapping():
    w13, w13_scale, w2, w2_scale = _checkpoint(seed=3)
    (_, w13_scale_t), (w2_t, w2_scale_t) = transform_weights((w13, w13_scale), (w2, w2_scale))
    for e in range(E_LOCAL):
        for g in range(INTER // 128):
            for kb in range(HIDDEN // 128):
                assert w13_scale_t[e, g, 0, kb] == w13_scale[e, g, kb]
                assert w13_scale_t[e, g, 1, kb] == w13_scale[e, INTER // 128 + g, kb]
    assert torch.equal(_bits(w2_t), _bits(w2)) and torch.equal(w2_scale_t, w2_scale)


def test_round_trip_is_bit_exact_and_accepts_non_contiguous_inputs():
    w13, w13_scale, w2, w2_scale = _checkpoint(seed=4)
    w2_strided = w2.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous
    assert not w2_strided.is_contiguous()
    l1_t, l2_t = transform_weights((w13, w13_scale), (w2_strided, w2_scale))
    (w13_back, w13_scale_back), (w2_back, w2_scale_back) = untransform_weights(l1_t, l2_t)
    assert torch.equal(_bits(w13_back), _bits(w13)) and torch.equal(w13_scale_back, w13_scale)
    assert torch.equal(_bits(w2_back), _bits(w2)) and torch.equal(w2_scale_back, w2_scale)
    assert l2_t[0].is_contiguous()


def test_validate_checkpoint_weights_returns_shapes_and_names_dict_entries():
    assert validate_checkpoint_weights(*_checkpoint()) == (E_LOCAL, HIDDEN, INTER)
    w13, w13_scale, w2, w2_scale = _checkpoint()
    with pytest.raises(ValueError, match=r"weights\[1\]\['w2_scale'\] must be torch\.float32"):
        validate_checkpoint_weights(w13, w13_scale, w2, w2_scale.double(), where="weights[1]")


def _replace(**changes):
    tensors = dict(zip(("w13", "w13_scale", "w2", "w2_scale"), _checkpoint()))
    tensors.update({key: make(tensors) for key, make in changes.items()})
    return (tensors["w13"], tensors["w13_scale"]), (tensors["w2"], tensors["w2_scale"])


BLOCK_REQUIRED = r"128x128 block quantization is required"


@pytest.mark.parametrize("args, error, match", [
    (lambda: ([None, None, None], _replace()[1]), TypeError, r"l1 must be a \(weight, scale\) pair"),
    (lambda: _replace(w13=lambda t: t["w13"].view(torch.uint8).numpy()), TypeError, r"w13 must be a torch\.Tensor"),
    (lambda: _replace(w13=lambda t: t["w13"].float()), ValueError, r"w13 must be torch\.float8_e4m3fn"),
    (lambda: _replace(w2=lambda t: t["w2"].view(torch.uint8)), ValueError, r"w2 must be torch\.float8_e4m3fn"),
    (lambda: _replace(w13_scale=lambda t: t["w13_scale"].bfloat16()), ValueError, r"w13_scale must be torch\.float32"),
    (lambda: _replace(w13=lambda t: t["w13"][0]), ValueError, r"w13 must be 3-D"),
    (lambda: _replace(w13=lambda t: t["w13"][:, 1:]), ValueError, r"w13\.shape\[1\]=511 must be even"),
    (lambda: _replace(w13=lambda t: t["w13"][:, :192]), ValueError,
     r"intermediate size I = w13\.shape\[1\] / 2 = 96 must be a multiple of 128"),
    (lambda: _replace(w13=lambda t: t["w13"][:, :, :320]), ValueError,
     r"hidden size H = w13\.shape\[2\] = 320 must be a multiple of 128"),
    (lambda: _replace(w2=lambda t: t["w2"][0]), ValueError, r"w2 must be 3-D"),
    (lambda: _replace(w2=lambda t: t["w2"][:2]), ValueError, r"w2\.shape\[0\]=2 must equal w13\.shape\[0\]=3"),
    (lambda: _replace(w2=lambda t: t["w2"].transpose(1, 2)), ValueError,
     r"w2 must have shape \[E_local, H, I\] = \(3, 384, 256\)"),
    (lambda: _replace(w13_scale=lambda t: torch.ones(E_LOCAL)), ValueError, BLOCK_REQUIRED),  # per-tensor
    (lambda: _replace(w13_scale=lambda t: torch.ones(E_LOCAL, 1, 1)), ValueError, BLOCK_REQUIRED),
    (lambda: _replace(w13_scale=lambda t: torch.ones(E_LOCAL, 2 * INTER, 1)), ValueError, BLOCK_REQUIRED),  # channel
    (lambda: _replace(w13_scale=lambda t: torch.ones(E_LOCAL, 2 * INTER // 64, HIDDEN // 64)), ValueError,
     r"w13_scale must have shape \[E_local, 2I/128, H/128\] = \(3, 4, 3\), got \(3, 8, 6\): " + BLOCK_REQUIRED),
    (lambda: _replace(w2_scale=lambda t: torch.ones(E_LOCAL, HIDDEN // 128, INTER // 64)), ValueError,
     r"w2_scale must have shape \[E_local, H/128, I/128\] = \(3, 3, 2\).*" + BLOCK_REQUIRED),
    (lambda: _replace(w2_scale=lambda t: t["w2_scale"].to("meta")), ValueError,
     r"w2_scale is on meta but w13 is on cpu; all weights must be on one device"),
])
def test_transform_validation_errors(args, error, match):
    l1, l2 = args()
    with pytest.raises(error, match=match):
        transform_weights(l1, l2)


def test_untransform_requires_the_kernel_scale_layout():
    w13, w13_scale, w2, w2_scale = _checkpoint()
    with pytest.raises(ValueError, match=r"w13_scale must have shape \[E_local, I/128, 2, H/128\]"):
        untransform_weights((w13, w13_scale), (w2, w2_scale))


def test_split_mlp_is_the_same_function():
    """One SwiGLU MLP of S*I equals the sum of its S channel-slice experts (in float32, exactly up to
    summation order)."""
    g = torch.Generator().manual_seed(3)
    num, inter, hidden = 3, 128, 256
    gate_up, gate_up_s = quant_blocks(torch.randn(2 * num * inter, hidden, generator=g))
    down, down_s = quant_blocks(torch.randn(hidden, num * inter, generator=g))
    experts = split_mlp(gate_up, gate_up_s, down, down_s, inter)
    assert experts["w13"].shape == (num, 2 * inter, hidden) and experts["w13_scale"].shape == (num, 2, 2)
    assert experts["w2"].shape == (num, hidden, inter) and experts["w2_scale"].shape == (num, 2, 1)
    x = torch.randn(5, hidden, generator=g)
    gu = x @ dequant_blocks(gate_up, gate_up_s).T
    whole = (F.silu(gu[:, :num * inter]) * gu[:, num * inter:]) @ dequant_blocks(down, down_s).T
    parts = 0
    for s in range(num):
        e_gu = x @ dequant_blocks(experts["w13"][s], experts["w13_scale"][s]).T
        parts = parts + (F.silu(e_gu[:, :inter]) * e_gu[:, inter:]) @ dequant_blocks(experts["w2"][s],
                                                                                      experts["w2_scale"][s]).T
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-3)


def test_append_experts_is_the_transform_with_shared_experts():
    """Appending S experts to weights already in the kernel layout gives, bit for bit, what the
    transform of the checkpoint with them as `shared` gives; the inputs are left as they were."""
    w13, w13_scale, w2, w2_scale = _checkpoint(seed=7)
    s13, s13_scale, s2, s2_scale = _checkpoint(seed=8, num_local_experts=2)
    shared = dict(w13=s13, w13_scale=s13_scale, w2=s2, w2_scale=s2_scale)
    routed = transform_weights((w13, w13_scale), (w2, w2_scale))
    kept = [t.clone() for pair in routed for t in pair]
    got = append_experts(*routed, shared)
    want = transform_weights((w13, w13_scale), (w2, w2_scale), shared=shared)
    for g, w in zip((t for pair in got for t in pair), (t for pair in want for t in pair)):
        assert g.shape == w.shape and torch.equal(_bits(g) if g.dtype == fp8.FP8_DTYPE else g,
                                                  _bits(w) if w.dtype == fp8.FP8_DTYPE else w)
    for t, k in zip((t for pair in routed for t in pair), kept):
        assert torch.equal(_bits(t) if t.dtype == fp8.FP8_DTYPE else t, _bits(k) if k.dtype == fp8.FP8_DTYPE else k)
    with pytest.raises(ValueError, match=r"shared experts have H=256, I=256; .* H=384, I=256"):
        append_experts(*routed, dict(zip(("w13", "w13_scale", "w2", "w2_scale"), _checkpoint(hidden=256))))
    with pytest.raises(ValueError, match=r"missing \['w2_scale'\]"):
        append_experts(*routed, dict(w13=s13, w13_scale=s13_scale, w2=s2))
    with pytest.raises(ValueError, match=r"w13_scale must have shape"):  # checkpoint layout, not the kernel's
        append_experts((w13, w13_scale), (w2, w2_scale), shared)
