"""stage_inputs: validation, the CPU (torch) path, and the CUDA (Triton) path.

The CUDA tests compare the fused Triton kernel bit for bit with the torch path
(megamoe_plugin.fp8.quantize_per_token_group + copies) run on the same GPU tensors; they
skip with a stated reason on machines without a CUDA device.
"""
import pytest
import torch

from megamoe_plugin import get_symm_buffer
from megamoe_plugin.fp8 import quantize_per_token_group
from megamoe_plugin.staging import stage_inputs

E, K, H, I = 16, 4, 384, 128
MAX_TOKENS = 33

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: the Triton staging kernel runs on CUDA only")


def _buffer(device="cpu", max_tokens=MAX_TOKENS, topk=K, hidden=H):
    return get_symm_buffer(None, E, max_tokens, topk, hidden, I, device=device)


def _inputs(n, device="cpu", dtype=torch.bfloat16, id_dtype=torch.int64, topk=K, hidden=H, seed=0,
            weight_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # Per-token magnitudes spanning several decades, so scales differ per token and group.
    hs = torch.randn(n, hidden, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 3)
    if n > 2:
        hs[1] = 0.0            # an all-zero row: finite eps scale, zero codes
        hs[2, :128] = 0.0      # one all-zero group
    ids = torch.randint(-1, E, (n, topk), generator=g).to(id_dtype)
    weights = torch.rand(n, topk, generator=g).to(weight_dtype)
    return hs.to(dtype).to(device), ids.to(device), weights.to(device)


def _expected(hs, ids, weights):
    q, s = quantize_per_token_group(hs, 128)
    return q, s, ids.to(torch.int64), weights.to(torch.float32)


def _assert_staged(buf, n, hs, ids, weights):
    q, s, ids64, w32 = _expected(hs, ids, weights)
    assert torch.equal(buf.x[:n].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(buf.x_sf[:n], s)
    assert buf.topk_idx.dtype == torch.int64 and torch.equal(buf.topk_idx[:n], ids64)
    assert buf.topk_weights.dtype == torch.float32 and torch.equal(buf.topk_weights[:n], w32)


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("n", [0, 1, 7, MAX_TOKENS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_path_matches_fp8_module(n, dtype):
    buf = _buffer()
    hs, ids, weights = _inputs(n, dtype=dtype)
    assert stage_inputs(buf, hs, ids, weights) == n
    _assert_staged(buf, n, hs, ids, weights)


def test_cpu_int32_ids_and_bf16_weights_are_widened():
    buf = _buffer()
    hs, ids, weights = _inputs(9, id_dtype=torch.int32, weight_dtype=torch.bfloat16)
    stage_inputs(buf, hs, ids, weights)
    _assert_staged(buf, 9, hs, ids, weights)


def test_cpu_zero_rows_have_finite_scales_and_zero_codes():
    buf = _buffer()
    hs, ids, weights = _inputs(5)
    stage_inputs(buf, hs, ids, weights)
    assert torch.isfinite(buf.x_sf[:5]).all() and (buf.x_sf[:5] > 0).all()
    assert (buf.x[1].float() == 0).all()
    assert (buf.x[2, :128].float() == 0).all()


def test_rows_past_n_are_untouched():
    buf = _buffer()
    buf.storage.fill_(0x7)
    before_x, before_idx = buf.x[5:].clone(), buf.topk_idx[5:].clone()
    hs, ids, weights = _inputs(5)
    stage_inputs(buf, hs, ids, weights)
    assert torch.equal(buf.x[5:].view(torch.uint8), before_x.view(torch.uint8))
    assert torch.equal(buf.topk_idx[5:], before_idx)


def test_strided_topk_tensors_are_accepted():
    # Non-contiguous top-k tensors (e.g. column slices) are fine: only hidden_states must be contiguous.
    buf = _buffer()
    hs, ids, weights = _inputs(6)
    wide_ids = torch.stack([ids, ids], dim=2)[..., 0]
    wide_w = torch.stack([weights, weights], dim=2)[..., 1]
    assert not wide_ids.is_contiguous()
    stage_inputs(buf, hs, wide_ids, wide_w)
    _assert_staged(buf, 6, hs, ids, weights)


@pytest.mark.parametrize("bad, needle", [
    (lambda hs, ids, w: (hs.to(torch.int32), ids, w), "hidden_states must be one of"),
    (lambda hs, ids, w: (hs[:, :128], ids, w), "hidden_states must have shape [num_tokens, hidden=384]"),
    (lambda hs, ids, w: (hs.unsqueeze(0), ids, w), "hidden_states must have shape"),
    (lambda hs, ids, w: (hs.t().contiguous().t(), ids, w), "hidden_states must be contiguous"),
    (lambda hs, ids, w: (hs, ids.float(), w), "topk_idx must be int32 or int64"),
    (lambda hs, ids, w: (hs, ids[:, :2], w), "topk_idx must have shape [num_tokens=8, num_topk=4]"),
    (lambda hs, ids, w: (hs, ids[:3], w), "topk_idx must have shape"),
    (lambda hs, ids, w: (hs, ids, w.to(torch.int64)), "topk_weights must be a float tensor"),
    (lambda hs, ids, w: (hs, ids, w[:, :1]), "topk_weights must have shape [num_tokens=8, num_topk=4]"),
    (lambda hs, ids, w: (hs, ids, "w"), "topk_weights must be a torch.Tensor"),
])
def test_validation_names_the_argument(bad, needle):
    buf = _buffer()
    hs, ids, weights = _inputs(8)
    buf.storage.fill_(0x3)
    snapshot = buf.storage.clone()
    with pytest.raises((ValueError, TypeError)) as info:
        stage_inputs(buf, *bad(hs, ids, weights))
    assert needle in str(info.value)
    assert torch.equal(buf.storage, snapshot), "a rejected call must not write anything"


def test_too_many_tokens_is_refused():
    buf = _buffer(max_tokens=4)
    hs, ids, weights = _inputs(5)
    with pytest.raises(ValueError, match="more than the buffer's num_max_tokens_per_rank=4"):
        stage_inputs(buf, hs, ids, weights)


def test_package_exports_stage_inputs():
    import megamoe_plugin as mm

    assert mm.stage_inputs is stage_inputs


def test_importing_staging_does_not_import_triton():
    import subprocess
    import sys

    code = ("import sys, megamoe_plugin.staging as s, torch\n"
            "b = __import__('megamoe_plugin').get_symm_buffer(None, 4, 2, 1, 128, 128, device='cpu')\n"
            "s.stage_inputs(b, torch.zeros(2, 128), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))\n"
            "assert 'triton' not in sys.modules, 'triton was imported on the CPU path'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


_INTERPRETER_SCRIPT = r"""
import torch
from megamoe_plugin import staging
from megamoe_plugin.buffer import BufferShape, SymmBuffer, get_symm_buffer_size
hidden, topk = 640, 3  # 5 groups: one full and one partial block of 4 groups
g = torch.Generator().manual_seed(0)
# Rank 1 of 2 ranks with 8 routed experts each, without and with 2 shared experts.
for shared in (0, 2):
    shape = BufferShape.of_routed(2, 16, 8, topk, hidden, 128, num_shared_experts=shared)
    size = get_symm_buffer_size(2, 16, 8, topk, hidden, 128, num_shared_experts=shared)
    buf, want = (SymmBuffer(shape, torch.zeros(size, dtype=torch.uint8), 1, (1, 2)) for _ in range(2))
    for n in (1, 6):
        hs = (torch.randn(n, hidden, generator=g) * 5).to(torch.bfloat16)
        ids = torch.randint(-3, 20, (n, topk), generator=g, dtype=torch.int32)  # invalid ones too
        w = torch.rand(n, topk, generator=g)
        staging._stage_triton(buf, hs, ids, w, n, 0.75)
        staging._stage_torch(want, hs, ids, w, n, 0.75)
        assert torch.equal(buf.x_sf[:n], want.x_sf[:n]), "scales"
        assert torch.equal(buf.topk_idx[:n], want.topk_idx[:n]), ("ids", buf.topk_idx[:n], want.topk_idx[:n])
        assert torch.equal(buf.topk_weights[:n], want.topk_weights[:n]), "weights"
print("interpreter ok")
"""


def test_triton_kernel_indexing_in_interpreter():
    """The Triton kernel's indexing (scales, ids, weights; the shared experts' slots and the routed
    ids in the kernel's numbering) on CPU through Triton's interpreter, against the torch path.

    The interpreter's float -> fp8 cast does not round to nearest even (it rounds ties
    away and mishandles carries), so the fp8 codes themselves are compared on the GPU
    only (test_cuda_bit_exact_vs_torch). Runs in a subprocess because TRITON_INTERPRET
    must be set before triton is imported."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interpreter ok" in result.stdout


def test_triton_kernel_compiles_for_sm90_with_exact_arithmetic():
    """Compile the staging kernel ahead of time for sm_90 (no GPU needed) and check the PTX
    uses only IEEE round-to-nearest division and the round-to-nearest-even fp8 conversion,
    the two operations the bit-exactness against the torch path rests on."""
    import inspect
    import re

    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - other Triton layouts
        pytest.skip(f"this Triton has no ahead-of-time compile API: {exc}")
    from megamoe_plugin import staging

    _, kernel = staging._triton_kernel()
    names = list(inspect.signature(kernel.fn).parameters)
    for x_type, idx_type, shared in (("*bf16", "*i32", 0), ("*fp16", "*i64", 1), ("*fp32", "*i64", 2)):
        consts = dict(HIDDEN=7168, NUM_GROUPS=56, GROUP=128, GPB=staging._GROUPS_PER_PROGRAM, K=8, BLOCK_K=8,
                      LOCAL_ROUTED=32, SHARED=shared, BLOCK_SHARED=max(shared, 1), SCALE_MIN=1e-10, QMAX=448.0)
        signature = dict(x_ptr=x_type, x_row_stride="i32", idx_ptr=idx_type, idx_s0="i32", idx_s1="i32",
                         w_ptr="*fp32", w_s0="i32", w_s1="i32", q_ptr="*fp8e4nv", sf_ptr="*fp32",
                         out_idx_ptr="*i64", out_w_ptr="*fp32", first_shared_id="i32", shared_scale="fp32",
                         **{k: "constexpr" for k in consts})
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(k),): v for k, v in consts.items()})
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        except Exception as exc:  # pragma: no cover - toolchain missing, not a kernel bug
            if "ptxas" in str(exc).lower():
                pytest.skip(f"Triton's ptxas is unavailable: {exc}")
            raise
        ptx = compiled.asm["ptx"]
        ops = set(re.findall(r"\b((?:div|rcp|cvt)\.[a-z0-9.]+)", ptx))
        assert "cvt.rn.satfinite.e4m3x2.f32" in ops, ops
        assert {op for op in ops if op.startswith(("div", "rcp"))} == {"div.rn.f32"}, ops


# ----------------------------------------------------------------------------- CUDA


def _cuda_case(n, id_dtype, dtype=torch.bfloat16, seed=0, max_tokens=MAX_TOKENS):
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = _buffer(device=dev, max_tokens=max_tokens)
    buf.storage.fill_(0x5A)
    hs, ids, weights = _inputs(n, device=dev, dtype=dtype, id_dtype=id_dtype, seed=seed)
    assert stage_inputs(buf, hs, ids, weights) == n
    torch.cuda.synchronize()
    return buf, hs, ids, weights


@needs_cuda
@pytest.mark.parametrize("n", [0, 1, 2, 17, MAX_TOKENS])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_cuda_bit_exact_vs_torch(n, id_dtype):
    buf, hs, ids, weights = _cuda_case(n, id_dtype, seed=n)
    _assert_staged(buf, n, hs, ids, weights)  # expected values computed by the torch path on the same GPU
    if n < MAX_TOKENS:  # nothing past n written
        assert (buf.x[n:].view(torch.uint8) == 0x5A).all()
        assert (buf.topk_idx[n:].view(torch.uint8) == 0x5A).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_other_input_dtypes(dtype):
    buf, hs, ids, weights = _cuda_case(13, torch.int64, dtype=dtype, seed=3)
    _assert_staged(buf, 13, hs, ids, weights)


@needs_cuda
def test_cuda_many_random_inputs_bit_exact():
    # Large and odd token counts, wide dynamic range: exercises every rounding case of the fp8 cast.
    for seed, n in enumerate((255, 511, 1000)):
        buf, hs, ids, weights = _cuda_case(n, torch.int32, seed=100 + seed, max_tokens=1024)
        _assert_staged(buf, n, hs, ids, weights)


@needs_cuda
def test_cuda_graph_capture_and_replay():
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = _buffer(device=dev)
    hs, ids, weights = _inputs(11, device=dev, seed=7)
    stage_inputs(buf, hs, ids, weights)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            stage_inputs(buf, hs, ids, weights)
    new_hs, new_ids, new_weights = _inputs(11, device=dev, seed=8)
    hs.copy_(new_hs), ids.copy_(new_ids), weights.copy_(new_weights)
    graph.replay()
    torch.cuda.synchronize()
    _assert_staged(buf, 11, new_hs, new_ids, new_weights)


@needs_cuda
def test_cuda_wrong_device_is_refused():
    buf = _buffer(device=torch.device("cuda", torch.cuda.current_device()))
    hs, ids, weights = _inputs(3)  # CPU tensors
    with pytest.raises(ValueError, match="hidden_states must be on the buffer's device"):
        stage_inputs(buf, hs, ids, weights)
