"""The end-to-end comparison tool (tools/e2e) on synthetic client outputs."""
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "compare_logprobs", Path(__file__).resolve().parent.parent / "tools" / "e2e" / "compare_logprobs.py")
compare_logprobs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_logprobs)


def _write(path, logprobs, text="x", prompt="p"):
    path.write_text(json.dumps([{"prompt": prompt, "prompt_logprobs": logprobs, "text": text,
                                 "token_logprobs": None}]))
    return str(path)


def test_within_and_over_tolerance(tmp_path, capsys):
    a = _write(tmp_path / "a.json", [None, -1.0, -2.0])
    b = _write(tmp_path / "b.json", [None, -1.05, -2.0])
    assert compare_logprobs.main([a, b]) == 0
    assert "max |diff| 0.0500" in capsys.readouterr().out
    assert compare_logprobs.main([a, b, "--tolerance", "0.01"]) == 1


def test_different_prompts_are_refused(tmp_path):
    a = _write(tmp_path / "a.json", [None, -1.0, -2.0], prompt="p")
    b = _write(tmp_path / "b.json", [None, -1.0, -2.0], prompt="q")
    with pytest.raises(ValueError, match="prompts differ"):
        compare_logprobs.main([a, b])


_spec_w = importlib.util.spec_from_file_location(
    "scaled_dummy_weights", Path(__file__).resolve().parent.parent / "tools" / "e2e" / "scaled_dummy_weights.py")
scaled_dummy_weights = importlib.util.module_from_spec(_spec_w)
_spec_w.loader.exec_module(scaled_dummy_weights)


def _toy_block_fp8_model():
    import torch

    class Linear(torch.nn.Module):
        def __init__(self, out_f, in_f):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.weight_scale_inv = torch.nn.Parameter(torch.empty(out_f // 128, in_f // 128), requires_grad=False)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.empty(4, 512, 256, dtype=torch.float8_e4m3fn),
                                                 requires_grad=False)
            self.w13_weight_scale_inv = torch.nn.Parameter(torch.empty(4, 4, 2), requires_grad=False)
            self.w2_weight = torch.nn.Parameter(torch.empty(4, 256, 256, dtype=torch.float8_e4m3fn),
                                                requires_grad=False)
            self.w2_weight_scale_inv = torch.nn.Parameter(torch.empty(4, 2, 2), requires_grad=False)

    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(1000, 256)
    model.input_layernorm = torch.nn.Module()
    model.input_layernorm.weight = torch.nn.Parameter(torch.empty(256))
    model.qkv_proj = Linear(384, 256)
    model.experts = Experts()
    model.lm_head = torch.nn.Linear(256, 1000, bias=False)
    model.bias = torch.nn.Parameter(torch.empty(7))
    return model


def test_scaled_dummy_weights_are_realistic_and_seeded_by_name():
    import torch

    a, b = _toy_block_fp8_model(), _toy_block_fp8_model()
    assert scaled_dummy_weights.fill(a) == ["bias"]
    scaled_dummy_weights.fill(b)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if name == "bias":
            continue  # no rule: left as created (torch.empty)
        assert torch.equal(pa.float(), pb.float()), name  # same name -> same values, run to run
        assert torch.isfinite(pa.float()).all(), name
    norm = a.input_layernorm.weight
    assert 0.9 <= norm.min() and norm.max() <= 1.1
    for weight, scale in ((a.qkv_proj.weight, a.qkv_proj.weight_scale_inv),
                          (a.experts.w13_weight, a.experts.w13_weight_scale_inv),
                          (a.experts.w2_weight, a.experts.w2_weight_scale_inv)):
        assert (scale > 0).all()
        w = weight.float()
        assert (w != 0).float().mean() > 0.95  # FP8 values well inside e4m3's range, not rounded away
        blocks = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
        dequant_std = (w * blocks).std().item()
        fan_in = weight.shape[-1]
        assert 0.7 / fan_in ** 0.5 < dequant_std < 1.3 / fan_in ** 0.5
    assert abs(a.lm_head.weight.std().item() - 3 / 256 ** 0.5) < 0.02


def test_degenerate_reference_is_refused(tmp_path, capsys):
    flat = [None] + [-10.3734] * 5  # uniform next-token distributions: no information
    a = _write(tmp_path / "a.json", flat)
    b = _write(tmp_path / "b.json", flat)
    assert compare_logprobs.main([a, b]) == 2
    assert "degenerate" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["qwen3_moe_fp8", "deepseek_v3_fp8"])
def test_e2e_models_have_the_layer_the_benchmarks_time(model):
    """The served models' MoE layer is the one `python -m megamoe_plugin.bench.vs_vllm` times by
    default (and the tuner's "e2e" shape): H 2048, I 768, 128 experts, top-8, 32000 tokens."""
    from megamoe_plugin.bench import vs_vllm
    from megamoe_plugin.model_config import read_config

    folder = Path(__file__).resolve().parent.parent / "tools" / "e2e" / "models" / model
    shape = read_config(str(folder))
    defaults = vs_vllm.parser().parse_args([])
    assert (shape.hidden, shape.intermediate_size, shape.num_experts, shape.num_topk) == (
        defaults.hidden, defaults.intermediate_size, defaults.num_experts, defaults.topk)
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 32000


def test_wait_healthy_waits_for_health_and_names_a_dead_server(tmp_path):
    """tools/e2e/wait_healthy.py, which both serve scripts run: 0 once /health answers; non-zero,
    saying so, when the server process is gone first."""
    import http.server
    import subprocess
    import sys
    import threading

    script = str(Path(__file__).resolve().parents[1] / "tools" / "e2e" / "wait_healthy.py")

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ok = subprocess.run([sys.executable, script, str(server.server_port), "30", str(os.getpid())],
                            capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert ok.returncode == 0 and "healthy after" in ok.stdout
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = subprocess.run([sys.executable, script, "9", "30", str(gone.pid)], capture_output=True, text=True,
                          timeout=60)
    assert dead.returncode != 0 and "the server exited before it was healthy" in dead.stderr


def test_served_folder_holds_the_config_and_the_tokenizer_and_names_what_is_missing(tmp_path):
    script = Path(__file__).resolve().parents[1] / "tools" / "e2e" / "served_folder.sh"
    model, tokenizer, out = tmp_path / "model", tmp_path / "tok", tmp_path / "out"
    model.mkdir()
    tokenizer.mkdir()
    (model / "config.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    run = lambda: subprocess.run(["bash", str(script), str(model), str(tokenizer), str(out)], capture_output=True,
                                 text=True)
    missing = run()
    assert missing.returncode == 2 and f"no tokenizer.json in {tokenizer}" in missing.stderr
    (tokenizer / "tokenizer.json").write_text("{}")
    assert run().returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    (model / "config.json").unlink()
    no_config = run()
    assert no_config.returncode == 2 and f"no config.json in {model}" in no_config.stderr
