"""`python -m megamoe_plugin.bench` on CPU: its options, the no-GPU error, the JSON file and
the plot from fake timings, and the unfused torch baseline's math against the reference."""
import json
import os
import subprocess
import sys

import pytest
import torch

from cli_help import assert_help_describes
from megamoe_plugin.bench import cli, report
from megamoe_plugin.bench.baselines import UnfusedTorchMoE, make_baseline
from megamoe_plugin.fp8 import quantize_per_token_group
from megamoe_plugin.reference import calc_diff, mega_moe, token_rel_errors
from megamoe_plugin.testing import random_layer, random_routing


def _run(*args, **env):
    return subprocess.run([sys.executable, "-m", "megamoe_plugin.bench", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_a_points_inputs_depend_on_its_rank_and_token_count_alone():
    from megamoe_plugin.testing import random_inputs

    def draw(rank, n):
        return random_inputs(n, 256, 32, 8, "uniform", "cpu", cli.point_generator(rank, n, "cpu"))

    first = draw(0, 8)
    random_inputs(32, 256, 32, 8, "uniform", "cpu", cli.point_generator(0, 32, "cpu"))  # another point between
    again = draw(0, 8)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(draw(1, 8)["topk_idx"], first["topk_idx"])
    assert not torch.equal(draw(0, 9)["topk_idx"][:8], first["topk_idx"])


def test_help_explains_every_option():
    assert_help_describes(_run("--help"), cli.parser())


def test_without_a_gpu_one_line_error():
    proc = _run("--tokens", "1", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["megamoe-bench: needs an SM90 (Hopper) GPU; CUDA is not available here"]


def test_console_script_is_declared():
    from pathlib import Path

    setup = (Path(cli.__file__).parents[2] / "setup.py").read_text()
    assert '"megamoe-bench = megamoe_plugin.bench.cli:main"' in setup


def test_reference_configs_and_options_parse():
    args, configs, tokens, numerics = cli.parse_args(["--configs", "v4flash,qwen30", "--tokens", "1,64",
                                                      "--numerics", "exact", "--baseline", "torch"])
    assert configs == [("v4flash", (4096, 2048, 6), None), ("qwen30", (2048, 768, 8), None)]
    assert (tokens, numerics, args.baseline, args.iters, args.fast_math) == ([1, 64], ["exact"], "torch", 20, True)


def test_a_model_config_replaces_the_reference_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 7168,
                                                      "moe_intermediate_size": 2048, "n_routed_experts": 256,
                                                      "num_experts_per_tok": 8}))
    _, configs, _, _ = cli.parse_args(["--model", str(tmp_path)])
    assert configs == [("deepseek_v3", (7168, 2048, 8), 256)]
    _, configs, _, _ = cli.parse_args(["--hidden", "2048", "--intermediate-size", "768", "--num-experts", "128",
                                       "--topk", "8"])
    assert configs == [("model", (2048, 768, 8), 128)]


@pytest.mark.parametrize("config, argv, shared", [
    ({}, [], 0),
    ({"n_shared_experts": 1}, [], 1),  # the model's own
    ({"n_shared_experts": 1}, ["--shared-experts", "0"], 0),  # the option overrides it
    ({}, ["--shared-experts", "2"], 2),
    (None, [], 0),  # the reference configs
    (None, ["--shared-experts", "2"], 2),
])
def test_shared_experts_from_the_model_or_the_option(tmp_path, config, argv, shared):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 7168,
                                                          "moe_intermediate_size": 2048, "n_routed_experts": 256,
                                                          "num_experts_per_tok": 8, **config}))
        argv = ["--model", str(tmp_path), *argv]
    args, configs, _, _ = cli.parse_args(argv)
    assert args.shared_experts == shared
    assert len(configs) == (1 if config is not None else 2)


@pytest.mark.parametrize("argv, needle", [(["--configs", "v3,nope"], "--configs: unknown config(s) nope"),
                                          (["--tokens", "1,x"], "--tokens: '1,x' is not"),
                                          (["--tokens", "-1"], "counts must be >= 0"),
                                          (["--numerics", "fp4"], "--numerics: unknown mode(s) fp4"),
                                          (["--baseline", "cublas"], "invalid choice: 'cublas'"),
                                          (["--iters", "0"], "--iters must be >= 1"),
                                          (["--shared-experts", "-1"],
                                           "argument --shared-experts: expected an integer >= 0, got '-1'"),
                                          (["--hidden", "2048"], "all of --hidden --intermediate-size")])
def test_bad_options_are_named(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2 and needle in capsys.readouterr().err


def _fake_results(baseline=True):
    points = []
    for config, scale in (("v3", 2.0), ("v4flash", 1.0)):
        for n in (1, 8, 128):
            base = 300.0 * scale * n ** 0.5 if baseline else None
            for numerics, slower in (("fast", 1.0), ("exact", 1.2)):
                points.append(report.point(config, numerics, n, 100e-6 * scale * slower * n ** 0.3,
                                           int(1e9 * n), 60e-6 * scale * n ** 0.3, 110e-6 * scale * n ** 0.3,
                                           None if base is None else base * 1e-6))
    return dict(device="NVIDIA H200", num_ranks=1, fast_math=True, iters=20, date="2026-12-01 10:00:00",
                baseline="unfused torch (torch._scaled_mm, block scales)", points=points,
                ceilings=dict(hbm_bytes_per_s=4.0e12, fp8_flops_per_s=1.2e15, peer_bytes_per_s=None))


def test_vllm_baseline_needs_vllm(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    with pytest.raises(SystemExit):
        cli.parse_args(["--baseline", "vllm"])
    assert "--baseline vllm: vllm is not installed" in capsys.readouterr().err


def test_zero_tokens_have_no_floor_ratio():
    p = report.point("v3", "fast", 0, 50e-6, 0, 0.0, 60e-6, None)
    assert p["time_per_floor"] is None and report.row(p).split()[6] == "-"


def test_rows_line_up_with_the_header():
    results = _fake_results()
    first = results["points"][0]
    line = report.row(first)
    assert len(line) == len(report.header())
    # The last column, NVLink MB per call, is "-" on one rank.
    assert line.split() == ["v3", "fast", "1", "200.0", "5.0", "120.0", "1.67", "-", "-", "-", "220.0", "600.0", "2.73",
                            "-"]
    clocked = report.point("v3", "fast", 1, 200e-6, int(1e9), 120e-6, 220e-6, None,
                           clock=dict(sm_mhz=1755.4, sm_mhz_min=1410.0, limits="P"))
    assert report.row(clocked).split()[7:10] == ["1755", "1410", "P"]
    assert len(report.row(clocked)) == len(report.header())
    assert report.row(dict(first, baseline_us=None, speedup=None)).split()[-3:] == ["-", "-", "-"]


def test_a_ceilings_clock_note():
    assert report.clock_note(dict(sm_mhz=1755.4, sm_mhz_min=1700, limits="-")) == " at 1755 MHz"
    assert report.clock_note(dict(sm_mhz=1515.0, sm_mhz_min=1485, limits="P")) == " at 1515 MHz (limit P)"
    assert report.clock_note(dict(sm_mhz=None, sm_mhz_min=None, limits=None)) == ""


def test_json_and_plot_from_fake_timings(tmp_path):
    results = _fake_results()
    json_path, png_path, note = report.write_results(results, tmp_path / "out", "bench_x")
    assert json.loads(json_path.read_text()) == results and note == ""
    png = png_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
    import matplotlib.pyplot as plt

    lines, texts = [], []
    real_savefig = plt.Figure.savefig

    def capture(fig, *args, **kwargs):
        lines.extend(line.get_label() for line in fig.axes[0].get_lines())
        texts.extend(text.get_text() for text in fig.texts)
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = capture
    try:
        report.plot(results, tmp_path / "again.png")
    finally:
        plt.Figure.savefig = real_savefig
    baseline = results["baseline"]
    assert lines == ["v3 megamoe, fast", "v3 megamoe, exact", "v3 floor", "v3 baseline",
                     "v4flash megamoe, fast", "v4flash megamoe, exact", "v4flash floor", "v4flash baseline"]
    assert texts == [f"baseline: {baseline}"]  # its full name once, under the axes


def test_without_matplotlib_the_json_is_still_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    json_path, png_path, note = report.write_results(_fake_results(baseline=False), tmp_path, "bench_y")
    assert json_path.exists() and png_path is None and "matplotlib is not installed" in note
    assert not list(tmp_path.glob("*.png"))


def test_torch_baseline_matches_the_reference():
    """The unfused torch path (its dequantized-BF16 GEMMs: CPU has no block-scaled
    _scaled_mm) computes the MoE of the float32 reference, masked slots included."""
    gen = torch.Generator().manual_seed(3)
    num_experts, hidden, inter, topk, tokens = 4, 256, 256, 2, 40
    layer = random_layer(num_experts, hidden, inter, "cpu", gen)
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = random_routing(tokens, num_experts, topk, "masked", "cpu", gen)
    weights = torch.rand(tokens, topk, generator=gen) + 0.1
    baseline, name = make_baseline("torch", layer.checkpoint)
    assert isinstance(baseline, UnfusedTorchMoE)
    assert name == "unfused torch (BF16 matmuls of dequantized weights (torch._scaled_mm: needs a CUDA device))"
    y = baseline(hidden_states, idx.int(), weights)  # the ids as vLLM's router gives them (bench/baselines.py)
    x, x_sf = quantize_per_token_group(hidden_states)
    (ref,) = mega_moe([dict(x=x, x_sf=x_sf, topk_idx=idx, topk_weights=weights)], [layer.checkpoint], num_experts)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert bool((y[0] == 0).all()) and bool((ref[0] == 0).all())  # testing.random_routing masks token 0 whole
    # BF16 GEMM operands (2^-9 relative) move some SwiGLU outputs across an FP8 rounding step of
    # the requant: measured calc_diff 1.2-1.7e-4 and worst tokens 3-4e-2 over three seeds, as
    # vLLM's Triton MoE is (README); a wrong scale, expert or slot is far beyond these bounds.
    assert calc_diff(y, ref) < 5e-4
    assert token_rel_errors(y, ref)[1:].max().item() < 0.1
    # and it is not trivially close: a wrong routing weight shows
    assert calc_diff(baseline(hidden_states, idx.int(), weights * 1.5), ref) > 1e-2


def test_no_baseline():
    assert make_baseline("none", {}) == (None, "none")
    with pytest.raises(ValueError, match="baseline must be one of"):
        make_baseline("cublas", {})


def test_rank_floor_counts_the_nvlink_bytes_of_each_direction():
    """With R ranks the benchmark reports a rank's NVLink bytes per call (issue 14): in, the rows it
    pulls (FP8 row + scales) and the BF16 rows others scatter back to its tokens; out, the BF16 rows
    it scatters to others' tokens; the larger of the two. One rank moves none."""
    from megamoe_plugin.bench.floors import Ceilings, rank_floor

    hidden, inter, local = 256, 128, 2
    ceilings = Ceilings(hbm_bytes_per_s=1e12, fp8_flops_per_s=1e15, peer_bytes_per_s=1e11)
    # Rank 0 owns experts 0-1, rank 1 experts 2-3. Rank 0's 3 tokens send 2 slots to rank 1's experts;
    # rank 1's 2 tokens send 3 slots to rank 0's.
    idx0 = torch.tensor([[0, 2], [1, 3], [1, -1]])
    idx1 = torch.tensor([[0, 1], [3, 0]])
    floor, flops, nvlink = rank_floor([idx0, idx1], 0, 2, hidden, inter, ceilings, local)
    pulled, returned = 3, 2
    into = pulled * (hidden + hidden // 128 * 4) + returned * 2 * hidden
    out = pulled * 2 * hidden
    assert nvlink == max(into, out) and floor >= nvlink / ceilings.peer_bytes_per_s
    assert flops == 2 * 6 * 3 * inter * hidden  # rank 0 computes its 6 rows (3 own, 3 pulled)
    assert rank_floor([idx0], 0, 1, hidden, inter, ceilings, local)[2] == 0
    row = report.row(report.point("v3", "fast", 3, 1e-5, flops, floor, 2e-5, None, nvlink))
    assert row.split()[-1] == f"{nvlink / 1e6:.2f}"


def test_the_floor_of_a_fused_call_counts_the_shared_expert_on_the_ranks_own_rows():
    """The kernel's view of a call with a shared expert (staging.kernel_expert_ids): the shared expert is
    one more expert of the rank, hit by every own token, pulled over no link; the floor reads its
    weights and counts its rows' FLOPs."""
    from megamoe_plugin.bench.floors import Ceilings, rank_floor
    from megamoe_plugin.staging import kernel_expert_ids, shared_expert_ids

    hidden, inter, local = 256, 128, 2
    ceilings = Ceilings(hbm_bytes_per_s=1e12, fp8_flops_per_s=1e15, peer_bytes_per_s=1e11)
    idx = [torch.tensor([[0, 2], [1, 3], [1, -1]]), torch.tensor([[0, 1], [3, 0]])]
    fused = [torch.cat([kernel_expert_ids(i, local, 1), torch.full((i.shape[0], 1), shared_expert_ids(r, local, 1)[0])],
                       dim=1) for r, i in enumerate(idx)]
    _, flops, nvlink = rank_floor(idx, 0, 2, hidden, inter, ceilings, local)
    _, fused_flops, fused_nvlink = rank_floor(fused, 0, 2, hidden, inter, ceilings, local + 1)
    assert fused_flops == flops + 2 * 3 * 3 * inter * hidden  # rank 0's 3 tokens through its shared expert
    assert fused_nvlink == nvlink
