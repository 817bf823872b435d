"""`python -m megamoe_plugin.bench.vs_vllm`: --help describes the command and every option, it names
the shape as the other CLIs do, and without an SM90 GPU it stops with one line on stderr, not a
traceback. With --shared-experts (what runs on the CPU): the option (a negative count refused), the
floor counting the shared experts, their one MLP of S*I computing what the S experts sum to, the
torch shared MLP against the reference, and the table's row; --weights mxfp4 refused with shared
experts; each megamoe path's captured call (what it stages and passes to the kernel, its own output
filled with NaN first)."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import megamoe_plugin as mm
from cli_help import assert_help_describes
from megamoe_plugin.bench import vs_vllm
from megamoe_plugin.bench.baselines import merge_shared_experts, shared_expert_mlp
from megamoe_plugin.bench.floors import Ceilings, rank_floor
from megamoe_plugin.buffer import BufferShape, SymmBuffer, get_symm_buffer_size
from megamoe_plugin.fp8 import dequantize_weight_blocks, quantize_per_token_group
from megamoe_plugin.reference import calc_diff, mega_moe, token_rel_errors
from megamoe_plugin.testing import random_layer

MODULE = "megamoe_plugin.bench.vs_vllm"


def _run(*args, **env):
    return subprocess.run([sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_help_describes_the_command_and_every_option():
    assert_help_describes(_run("--help"), vs_vllm.parser())


def test_shape_options_are_named_as_in_the_other_clis():
    args = vs_vllm.parser().parse_args(["--hidden", "4096", "--intermediate-size", "1536", "--num-experts", "64",
                                        "--topk", "6"])
    assert (args.hidden, args.intermediate_size, args.num_experts, args.topk) == (4096, 1536, 64, 6)
    defaults = vs_vllm.parser().parse_args([])
    assert (defaults.hidden, defaults.intermediate_size, defaults.num_experts, defaults.topk) == (2048, 768, 128, 8)


def test_without_a_gpu_one_line_error():
    proc = _run("--tokens", "1", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"{vs_vllm.PROG}: needs an SM90 (Hopper) GPU; CUDA is not available here"]


def test_shared_experts_default_to_none_and_take_a_count():
    assert vs_vllm.parse_args([]).shared_experts == 0
    assert vs_vllm.parse_args(["--shared-experts", "2"]).shared_experts == 2


def test_a_negative_shared_expert_count_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as stop:
        vs_vllm.parse_args(["--shared-experts", "-1"])
    assert stop.value.code == 2
    assert "--shared-experts must be >= 0, got -1" in capsys.readouterr().err


H, I, E, K, MAX_TOKENS = 256, 256, 4, 2, 8


def _staged_cpu_buffer(num_shared, topk_idx):
    """A one-rank buffer on the CPU with these routed slots staged (staging only: no kernel runs)."""
    shape = BufferShape.of_routed(1, E, MAX_TOKENS, K, H, I, num_shared_experts=num_shared)
    size = get_symm_buffer_size(1, E, MAX_TOKENS, K, H, I, num_shared_experts=num_shared)
    buf = SymmBuffer(shape, torch.zeros(size, dtype=torch.uint8), 0, (1,))
    n = topk_idx.shape[0]
    hidden = torch.randn(n, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    mm.stage_inputs(buf, hidden, topk_idx, torch.full((n, K), 0.5))
    return buf


def test_mxfp4_experts_are_compared_alone(capsys):
    assert vs_vllm.parse_args([]).weights == "fp8" and vs_vllm.parse_args(["--weights", "mxfp4"]).weights == "mxfp4"
    with pytest.raises(SystemExit) as stop:
        vs_vllm.parse_args(["--weights", "mxfp4", "--shared-experts", "1"])
    assert stop.value.code == 2
    assert "--shared-experts times FP8 experts only (--weights fp8)" in capsys.readouterr().err


def test_the_floor_counts_the_shared_experts_weights_and_rows():
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]])  # 3 tokens, 3 routed rows on experts 0 and 1
    n, routed_rows, routed_experts_hit, num_shared = 3, 3, 2, 2
    expert_bytes = 3 * I * H  # FP8 w13 and w2 of one expert
    bytes_only, flops_only = Ceilings(1.0, math.inf), Ceilings(math.inf, 1.0)

    def expected(rows, experts):
        moved = experts * expert_bytes + n * H * 3 + rows * (H + 2 * I + 2 * H)
        return moved, 2 * rows * 3 * I * H

    routed = _staged_cpu_buffer(0, idx)
    # Without shared experts it is the routed layer's floor, as the table computed it before them.
    assert vs_vllm.staged_floor(routed, n, bytes_only) == rank_floor([idx], 0, 1, H, I, bytes_only, E)[0]
    assert (vs_vllm.staged_floor(routed, n, bytes_only), vs_vllm.staged_floor(routed, n, flops_only)) == \
        expected(routed_rows, routed_experts_hit)
    # Every token is a row of each shared expert, and each shared expert's weights are read.
    shared = _staged_cpu_buffer(num_shared, idx)
    assert (vs_vllm.staged_floor(shared, n, bytes_only), vs_vllm.staged_floor(shared, n, flops_only)) == \
        expected(routed_rows + n * num_shared, routed_experts_hit + num_shared)


def _dequantized_mlp(x, w13, w13_scale, w2, w2_scale):
    """One expert's SwiGLU MLP in float64 on its dequantized weights."""
    gate, up = (x @ dequantize_weight_blocks(w13, w13_scale).double().T).chunk(2, dim=1)
    return (F.silu(gate) * up) @ dequantize_weight_blocks(w2, w2_scale).double().T


@pytest.mark.parametrize("num_shared", [1, 2, 3])
def test_one_mlp_of_s_times_i_is_the_sum_of_the_s_shared_experts(num_shared):
    gen = torch.Generator().manual_seed(num_shared)
    shared = random_layer(num_shared, H, I, "cpu", gen).checkpoint
    mlp = merge_shared_experts(shared)
    assert {key: tuple(t.shape) for key, t in mlp.items()} == dict(
        w13=(1, 2 * num_shared * I, H), w13_scale=(1, 2 * num_shared * I // 128, H // 128),
        w2=(1, H, num_shared * I), w2_scale=(1, H // 128, num_shared * I // 128))
    x = torch.randn(9, H, generator=gen, dtype=torch.float64)
    one = _dequantized_mlp(x, *(mlp[key][0] for key in ("w13", "w13_scale", "w2", "w2_scale")))
    experts = sum(_dequantized_mlp(x, *(shared[key][e] for key in ("w13", "w13_scale", "w2", "w2_scale")))
                  for e in range(num_shared))
    # Equal up to float64 summation order: a gate/up or expert mix-up is off by the outputs' own size.
    assert torch.allclose(one, experts, rtol=0, atol=1e-12 * experts.abs().max().item())


def test_the_torch_shared_mlp_is_the_references_shared_experts():
    """The shared-expert MLP where vLLM's linear layers cannot run (here: no GPU) computes what the
    reference's S shared experts add to a token whose routed slots are all empty."""
    gen = torch.Generator().manual_seed(5)
    num_shared, n = 2, 11
    shared = random_layer(num_shared, H, I, "cpu", gen).checkpoint
    mlp, name = shared_expert_mlp(merge_shared_experts(shared))
    assert name.startswith("torch (BF16 matmuls of dequantized weights")
    hidden = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    x, x_sf = quantize_per_token_group(hidden)
    nothing_routed = dict(x=x, x_sf=x_sf, topk_idx=torch.full((n, K), -1), topk_weights=torch.ones(n, K))
    ref = mega_moe([nothing_routed], [random_layer(E, H, I, "cpu", gen).checkpoint], E, shared=shared)[0]
    y = mlp(hidden)
    # BF16 GEMM outputs and a BF16 SiLU-and-mul, as vLLM's, beside the reference's float32 ones.
    assert calc_diff(y, ref) < 1e-3 and token_rel_errors(y, ref).max().item() < 5e-2


def test_the_shared_expert_row_gives_each_variants_time_and_the_ratios_to_fused():
    seconds = {"fused": 100e-6, "mm+aux": 150e-6, "vllm": 230e-6}
    errors = [(1e-5, 1e-2), (2e-5, 2e-2), (3e-5, 3e-2)]
    row = vs_vllm.shared_row(64, seconds, 50e-6, errors)
    header = vs_vllm.shared_header()
    numbers, accuracy = row.split(" | ")[1:]
    columns = header.split(" | ")[1].split()
    assert dict(zip(columns, numbers.split())) == {
        "fused_us": "100.0", "mm+aux_us": "150.0", "vllm_us": "230.0", "floor_us": "50.0",
        "fused/floor": "2.00", "vllm/fused": "2.30", "mm+aux/fused": "1.50"}
    assert header.endswith("fused, mm+aux, vllm") and vs_vllm.SHARED_VARIANTS == ("fused", "mm+aux", "vllm")
    assert accuracy == "1.0e-05/1.0e-02, 2.0e-05/2.0e-02, 3.0e-05/3.0e-02"


def test_each_megamoe_path_stages_its_inputs_then_calls_the_kernel_into_its_own_nan_output(monkeypatch):
    calls = []

    def stage_inputs(buf, hidden, idx, weights, **kwargs):
        calls.append(("stage", buf, hidden, idx, weights, kwargs))

    def fp8_mega_moe(y, l1, l2, buf, numerics=None):
        calls.append(("kernel", y.isnan().all().item(), l1, l2, buf, numerics))
        y.fill_(1.0)

    monkeypatch.setattr(mm, "stage_inputs", stage_inputs)
    monkeypatch.setattr(mm, "fp8_mega_moe", fp8_mega_moe)
    hidden, idx, weights = torch.zeros(3, 256, dtype=torch.bfloat16), torch.zeros(3, 2), torch.ones(3, 2)
    fused = vs_vllm._megamoe_call("buf", "l1", "l2", hidden, idx, weights, numerics="fast", shared_scale=1.0)
    routed = vs_vllm._megamoe_call("buf2", "m1", "m2", hidden, idx, weights)
    y = fused()
    assert y.shape == (3, 256) and y.dtype == torch.bfloat16 and bool((y == 1).all())
    assert routed() is not y
    (_, buf, h, i, w, kwargs), (_, was_nan, l1, l2, kbuf, numerics) = calls[:2]
    assert (buf, kbuf, l1, l2, numerics, kwargs, was_nan) == ("buf", "buf", "l1", "l2", "fast", {"shared_scale": 1.0}, True)
    assert h is hidden and i is idx and w is weights
    assert calls[2][5] == {} and calls[3][1:] == (True, "m1", "m2", "buf2", None)


def test_accuracy_gives_calc_diff_and_the_worst_token_of_each_pair():
    ref = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = ref.clone()
    out[2] *= 1.25
    errors = vs_vllm.accuracy([(out, ref), (ref, ref)])
    assert errors[0] == (calc_diff(out, ref), token_rel_errors(out, ref).max().item())
    assert errors[0][1] > 0.1 and errors[1][1] == 0.0
    assert vs_vllm.accuracy_text(errors).endswith(", 0.0e+00/0.0e+00")


def test_vllm_baselines_get_the_routing_as_vllm_gives_it():
    from megamoe_plugin.bench.baselines import _vllm_moe_as_baseline

    seen = {}
    run = _vllm_moe_as_baseline(lambda hidden, **kwargs: seen.update(hidden=hidden, **kwargs) or "out")
    hidden, ids, weights = torch.zeros(2, 8), torch.tensor([[0, 3], [1, -1]], dtype=torch.int32), torch.ones(2, 2)
    assert run(hidden, ids, weights) == "out"
    # passed through as they are: a cast would be one more kernel in the baseline's timed call
    assert seen["hidden"] is hidden and seen["topk_weights"] is weights and seen["topk_ids"] is ids
    seen.clear()
    with pytest.raises(TypeError, match="topk_ids must be int32.*int64"):
        run(hidden, ids.long(), weights)
    assert not seen
