"""Every bad call of the public API raises a clear error naming the argument, before
anything is launched; without an SM90 GPU a valid call raises RuntimeError."""
import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin import kernel_variant, settings, variants
from megamoe_plugin.testing import random_layer

E, N, K, H, I = 4, 16, 2, 256, 256


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator().manual_seed(0)
    layer = random_layer(E, H, I, "cpu", gen)
    buf = mm.get_symm_buffer(None, E, N, K, H, I, device="cpu")
    return layer, buf


def y_of(n=4, **kw):
    return torch.zeros(n, kw.get("hidden", H), dtype=kw.get("dtype", torch.bfloat16))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_experts=0), ValueError, "num_experts"),
    (dict(num_topk=0), ValueError, "num_topk"),
    (dict(num_topk=17), ValueError, "num_topk"),
    (dict(hidden=200), ValueError, "hidden"),
    (dict(intermediate_size=100), ValueError, "intermediate_size"),
    (dict(num_max_tokens_per_rank=0), ValueError, "num_max_tokens_per_rank"),
    (dict(num_experts=513), ValueError, "at most 512 experts per rank"),
    (dict(hidden=256.0), TypeError, "hidden must be an int"),
])
def test_buffer_shape_errors(kwargs, exc, match):
    args = dict(num_experts=E, num_max_tokens_per_rank=N, num_topk=K, hidden=H, intermediate_size=I)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        mm.get_symm_buffer(None, device="cpu", **args)
    with pytest.raises(exc, match=match):
        mm.get_symm_buffer_size(1, **args)


def test_buffer_views_and_size():
    buf = mm.get_symm_buffer(None, E, N, K, H, I, device="cpu")
    assert buf.x.shape == (N, H) and buf.x.dtype == torch.float8_e4m3fn
    assert buf.x_sf.shape == (N, H // 128) and buf.topk_idx.dtype == torch.int64
    assert buf.topk_weights.shape == (N, K)
    assert mm.get_symm_buffer_size(1, E, N, K, H, I) == buf.storage.numel()


def _bad_cases(layer, buf):
    l1, l2 = layer.l1, layer.l2
    w13, s13 = l1
    w2, s2 = l2
    return [
        ("y", dict(y=y_of(dtype=torch.float16)), ValueError, "y must be torch.bfloat16"),
        ("y shape", dict(y=y_of(hidden=128)), ValueError, r"y must have shape \[num_tokens, hidden=256\]"),
        ("y too many tokens", dict(y=y_of(n=N + 1)), ValueError, "more than the buffer's num_max_tokens_per_rank"),
        ("y non-contiguous", dict(y=torch.zeros(H, 4, dtype=torch.bfloat16).t()), ValueError, "y must be contiguous"),
        ("y not a tensor", dict(y=[1, 2]), TypeError, "y must be a torch.Tensor"),
        ("l1 pair", dict(l1=w13), TypeError, "l1 must be a \\(weight, scale\\) pair"),
        ("l1 dtype", dict(l1=(w13.float(), s13)), ValueError, "l1 weight"),
        ("l1 checkpoint scale", dict(l1=(w13, torch.ones(E, 2 * I // 128, H // 128))), ValueError,
         "transformed layout"),
        ("l2 shape", dict(l2=(w2[:, :128].contiguous(), s2)), ValueError, "l2 weight"),
        ("buf", dict(buf=object()), TypeError, "buf must be a SymmBuffer"),
        ("clamp type", dict(activation_clamp="3"), TypeError, "activation_clamp"),
        ("clamp value", dict(activation_clamp=-1.0), ValueError, "activation_clamp must be a finite positive"),
        ("fast_math", dict(fast_math=1), TypeError, "fast_math must be a bool"),
        ("stats dtype", dict(cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int64)), ValueError,
         "cumulative_local_expert_recv_stats must be torch.int32"),
        ("stats shape", dict(cumulative_local_expert_recv_stats=torch.zeros(E + 1, dtype=torch.int32)), ValueError,
         "cumulative_local_expert_recv_stats must have shape"),
        ("config_num_tokens", dict(config_num_tokens=-1), ValueError, "config_num_tokens must be a non-negative int"),
        ("numerics", dict(numerics="fp8"), ValueError, r"numerics must be one of \('fast', 'exact'\), got 'fp8'"),
    ]


def test_bad_calls_name_the_argument(setup):
    layer, buf = setup
    for name, override, exc, match in _bad_cases(layer, buf):
        args = dict(y=y_of(), l1=layer.l1, l2=layer.l2, buf=buf)
        args.update(override)
        with pytest.raises(exc, match=match):
            mm.fp8_mega_moe(args.pop("y"), args.pop("l1"), args.pop("l2"), args.pop("buf"), **args)


def test_weights_from_another_buffer_shape_are_refused(setup):
    layer, _ = setup
    other = mm.get_symm_buffer(None, E, N, K, H + 128, I, device="cpu")
    with pytest.raises(ValueError, match=r"l1 weight \(w13\) must have shape \[4, 512, 384\]"):
        mm.fp8_mega_moe(torch.zeros(1, H + 128, dtype=torch.bfloat16), layer.l1, layer.l2, other)


def test_valid_call_without_sm90_gpu_raises_runtime_error(setup):
    layer, buf = setup
    with pytest.raises(RuntimeError, match="SM90"):
        mm.fp8_mega_moe(y_of(), layer.l1, layer.l2, buf)


def test_y_with_more_rows_than_staged_is_refused(setup):
    layer, buf = setup

    def stage(n):
        return mm.stage_inputs(buf, torch.randn(n, H).to(torch.bfloat16), torch.zeros(n, K, dtype=torch.int64),
                               torch.ones(n, K))

    assert stage(3) == 3
    with pytest.raises(ValueError, match=r"y has 4 rows but 3 tokens were staged for this call .* rows 3 to 3 "
                                         r"would run on stale inputs"):
        mm.fp8_mega_moe(y_of(4), layer.l1, layer.l2, buf)
    # The refused call took the count: a call on inputs written without mark_staged is not held to it.
    with pytest.raises(RuntimeError, match="SM90"):
        mm.fp8_mega_moe(y_of(4), layer.l1, layer.l2, buf)
    for staged_rows, y_rows in ((4, 4), (4, 2), (0, 0)):  # as many rows as staged, or fewer, pass the check
        stage(staged_rows)
        with pytest.raises(RuntimeError, match="SM90"):
            mm.fp8_mega_moe(y_of(y_rows), layer.l1, layer.l2, buf)
    buf.mark_staged(1)  # a caller that writes the views itself declares its count the same way
    with pytest.raises(ValueError, match="y has 2 rows but 1 tokens were staged"):
        mm.fp8_mega_moe(y_of(2), layer.l1, layer.l2, buf)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
            buf.mark_staged(bad)


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("8", 8), ("32", 32), ("64", 64),
                                                     ("128", 128)])
def test_forced_block_m(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("MEGAMOE_BLOCK_M", raising=False)
    else:
        monkeypatch.setenv("MEGAMOE_BLOCK_M", value)
    assert settings.forced_block_m() == expected


@pytest.mark.parametrize("value", ["48", "256", "x", "-8"])
def test_forced_block_m_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("MEGAMOE_BLOCK_M", value)
    with pytest.raises(ValueError, match="MEGAMOE_BLOCK_M must be one of the implemented tiers"):
        settings.forced_block_m()


def test_forced_block_m_128_is_refused_in_exact_numerics(monkeypatch):
    from megamoe_plugin import jit
    from megamoe_plugin.buffer import BufferShape

    shape = BufferShape(1, 32, 512, 6, 4096, 2048)
    assert variants.variant_for(shape, "NVIDIA H200", 132, 512, True, "fast", forced_block_m=128).block_m == 128
    # fast_math=False's IEEE divisions would call out of the register-rebalanced region: 64 runs it.
    assert variants.variant_for(shape, "NVIDIA H200", 132, 512, False, "fast", forced_block_m=128).block_m == 64
    with pytest.raises(ValueError, match="needs fast_math=True"):
        kernel_variant.KernelVariant(4096, 2048, 6, 32, 1, 128, 4, False, "fast")
    with pytest.raises(ValueError, match=r"MEGAMOE_BLOCK_M=128 is not implemented in 'exact' numerics"):
        variants.variant_for(shape, "NVIDIA H200", 132, 512, True, "exact", forced_block_m=128)


def test_numerics_default_comes_from_the_environment(monkeypatch):
    from megamoe_plugin import ops

    monkeypatch.delenv("MEGAMOE_NUMERICS", raising=False)
    assert ops.resolve_numerics(None) == "fast"
    monkeypatch.setenv("MEGAMOE_NUMERICS", "exact")
    assert ops.resolve_numerics(None) == "exact"
    assert ops.resolve_numerics("fast") == "fast"  # the argument wins
    monkeypatch.setenv("MEGAMOE_NUMERICS", "fp16")
    with pytest.raises(ValueError, match=r"MEGAMOE_NUMERICS must be one of \('fast', 'exact'\), got 'fp16'"):
        ops.resolve_numerics(None)


def _config_args(variant):
    """The KernelConfig template arguments of a variant's source."""
    return variant.source().split("KernelConfig<")[1].split(">;")[0].split(", ")


def test_select_variant_carries_the_numerics_mode(monkeypatch):
    """The variant (and with it the JIT cache key and the cubin's name) differs per mode."""
    from megamoe_plugin import jit, ops

    monkeypatch.setattr(ops, "_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(ops, "_grid_size", lambda buf: 132)
    monkeypatch.delenv("MEGAMOE_BLOCK_M", raising=False)
    buf = mm.get_symm_buffer(None, 32, 512, 6, 4096, 2048, device="cpu")
    fast, exact = (ops.select_variant(buf, 512, True, numerics) for numerics in ("fast", "exact"))
    assert (fast.numerics, exact.numerics) == ("fast", "exact")
    assert fast.name() != exact.name() and fast.name().endswith("_fast")
    # KernelConfig's last two arguments: exact L1, windowed.
    # KernelConfig's template arguments: ..., fast_math, exact L1, windowed, MXFP4 weights.
    assert _config_args(exact)[-3:] == ["true", "false", "false"] and _config_args(fast)[-3:] == ["false"] * 3
    with pytest.raises(ValueError, match="numerics must be one of"):
        kernel_variant.KernelVariant(4096, 2048, 6, 32, 1, 64, 4, True, "fp8")


def test_select_variant_is_windowed_where_the_buffer_is(monkeypatch):
    """A buffer whose pools hold fewer rows than the worst routing (a pool_rows override on one
    rank; the default pools at R > 1) runs windowed variants: a second entry, the window kernel,
    which the runtime launches after the fused kernel; other buffers' variants have none."""
    from megamoe_plugin import jit, ops

    monkeypatch.setattr(ops, "_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(ops, "_grid_size", lambda buf: 132)
    monkeypatch.delenv("MEGAMOE_BLOCK_M", raising=False)
    whole = mm.get_symm_buffer(None, 32, 512, 6, 4096, 2048, device="cpu")
    windowed = mm.get_symm_buffer(None, 32, 512, 6, 4096, 2048, device="cpu", pool_rows=1024)
    for numerics in ("fast", "exact"):
        plain, win = (ops.select_variant(b, 512, True, numerics) for b in (whole, windowed))
        assert not plain.windowed and win.windowed and win.name() == plain.name() + "_win"
        assert kernel_variant.WINDOW_KERNEL_NAME not in plain.source() and f"{kernel_variant.WINDOW_KERNEL_NAME}(" in win.source()
        assert _config_args(win)[-2] == "true"
        assert f"Cfg::kWindowLoop == {'false' if win.block_m == 128 else 'true'}" in win.source()
    assert mm.buffer.BufferShape(2, 64, 512, 6, 4096, 2048).windowed  # the default pools at EP2


def test_select_variant_is_memoized_and_follows_forced_block_m(monkeypatch, tmp_path):
    """select_variant runs on every call: the second lookup is the same object, and a
    changed MEGAMOE_BLOCK_M still takes effect."""
    from megamoe_plugin import ops

    monkeypatch.setenv("MEGAMOE_CONFIGS_DIR", str(tmp_path))  # no table: the heuristic's tiers
    monkeypatch.setattr(ops, "_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(ops, "_grid_size", lambda buf: 132)
    monkeypatch.delenv("MEGAMOE_BLOCK_M", raising=False)
    buf = mm.get_symm_buffer(None, 32, 512, 6, 4096, 2048, device="cpu")
    first = ops.select_variant(buf, 512, True)
    assert first.block_m == 128  # 96 rows per expert: fast mode's cooperative tier
    assert ops.select_variant(buf, 512, True) is first
    assert ops.select_variant(buf, 1, True).block_m == 8
    assert ops.select_variant(buf, 512, False).fast_math is False
    monkeypatch.setenv("MEGAMOE_BLOCK_M", "16")
    assert ops.select_variant(buf, 512, True).block_m == 16


def test_every_selected_variant_fits_shared_memory_in_its_mode(monkeypatch):
    """The config a call gets (table or heuristic) must fit the mode it runs in: exact L1 needs
    more shared memory than fast (its FP16 token staging)."""
    from megamoe_plugin import jit
    from megamoe_plugin.buffer import BufferShape
    from megamoe_plugin.heuristics import NUMERICS_MODES, SMEM_LIMIT

    for experts, topk, hidden, inter in ((16, 8, 2048, 768), (8, 8, 4096, 1536), (32, 8, 7168, 2048),
                                         (128, 8, 2048, 768)):
        shape = BufferShape(1, experts, 512, topk, hidden, inter)
        for numerics in NUMERICS_MODES:
            for n in range(0, 513, 7):
                variant = variants.variant_for(shape, "NVIDIA H200", 132, n, True, numerics)
                assert jit.smem_bytes_of(variant) <= SMEM_LIMIT, variant


@pytest.mark.parametrize("value", ["1", "x", "-4"])
def test_forced_num_stages_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("MEGAMOE_NUM_STAGES", value)
    with pytest.raises(ValueError, match=r"MEGAMOE_NUM_STAGES must be an integer >= 2, got"):
        settings.forced_num_stages()


def test_forced_num_stages_must_fit_the_tier():
    buf = mm.get_symm_buffer(None, 32, 512, 6, 4096, 2048, device="cpu")
    assert variants.variant_for(buf.shape, "Test GPU", 132, 512, True, "fast", 64, 5).num_stages == 5
    with pytest.raises(ValueError, match=r"forced num_stages=5 \(MEGAMOE_NUM_STAGES\) does not fit: at most 4 stages "
                                         r"of block_m=64 fit in shared memory with 32 local experts in exact numerics"):
        variants.variant_for(buf.shape, "Test GPU", 132, 512, True, "exact", 64, 5)


def test_select_variant_follows_forced_num_stages_and_configs_dir(monkeypatch, tmp_path):
    """The tuning sweep forces each candidate through the environment; a table in
    MEGAMOE_CONFIGS_DIR takes effect in the same process."""
    import json

    from megamoe_plugin import ops
    from megamoe_plugin.configs import table_path

    monkeypatch.setattr(ops, "_device_name", lambda device: "Test GPU")
    monkeypatch.setattr(ops, "_grid_size", lambda buf: 132)
    for name in ("MEGAMOE_BLOCK_M", "MEGAMOE_NUM_STAGES", "MEGAMOE_CONFIGS_DIR"):
        monkeypatch.delenv(name, raising=False)
    buf = mm.get_symm_buffer(None, 32, 512, 6, 4096, 2048, device="cpu")
    assert (ops.select_variant(buf, 1, True).block_m, ops.select_variant(buf, 1, True).num_stages) == (8, 6)
    monkeypatch.setenv("MEGAMOE_NUM_STAGES", "3")
    assert (ops.select_variant(buf, 1, True).block_m, ops.select_variant(buf, 1, True).num_stages) == (8, 3)
    monkeypatch.setenv("MEGAMOE_BLOCK_M", "64")
    assert (ops.select_variant(buf, 1, True).block_m, ops.select_variant(buf, 1, True).num_stages) == (64, 3)
    monkeypatch.delenv("MEGAMOE_BLOCK_M")
    monkeypatch.delenv("MEGAMOE_NUM_STAGES")
    shape = {"num_local_experts": 32, "hidden": 4096, "intermediate_size": 2048, "num_topk": 6}
    table = {"shape": shape, "entries": {"1": {"block_m": 32, "num_stages": 4}}}
    table_path("Test GPU", tmp_path).write_text(json.dumps({"gpu": "Test GPU", "version": 2, "tables": [table]}))
    monkeypatch.setenv("MEGAMOE_CONFIGS_DIR", str(tmp_path))
    assert (ops.select_variant(buf, 1, True).block_m, ops.select_variant(buf, 1, True).num_stages) == (32, 4)
    # A table for one numerics mode serves only calls in that mode.
    table["numerics"] = "exact"
    other = tmp_path / "other"  # a new directory: the loader has not cached it
    other.mkdir()
    table_path("Test GPU", other).write_text(json.dumps({"gpu": "Test GPU", "version": 2, "tables": [table]}))
    monkeypatch.setenv("MEGAMOE_CONFIGS_DIR", str(other))
    exact, fast = ops.select_variant(buf, 1, True, "exact"), ops.select_variant(buf, 1, True, "fast")
    assert (exact.block_m, exact.num_stages, exact.numerics, fast.block_m, fast.num_stages) == (32, 4, "exact", 8, 6)
