"""tools/e2e's SGLang helpers on a CPU: sglang_logprobs.py turns sglang /generate answers into the
records that compare_logprobs.py compares; sglang_scaled_weights/ replaces SGLang's dummy fill;
decode_steps.py reads a server log's decode reports."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


logprobs = _load("sglang_logprobs", "tools/e2e/sglang_logprobs.py")
compare_logprobs = _load("compare_logprobs", "tools/e2e/compare_logprobs.py")
decode_steps = _load("decode_steps", "tools/e2e/decode_steps.py")


def _answers(input_ids, shift, output_ids=(11, 12)):
    # sglang's meta_info entries are [logprob, token id, text]; the first prompt token has none.
    return [{"meta_info": {
        "input_token_logprobs": [[None, ids[0], None]] + [[-1.0 - 0.3 * k + shift, t, None]
                                                           for k, t in enumerate(ids[1:])],
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids]}} for ids in input_ids]


def test_records_compare_and_detect_a_difference(tmp_path):
    ids = logprobs.prompts()
    assert [len(p) for p in ids] == list(logprobs.PROMPT_LENGTHS) and ids == logprobs.prompts()
    ref, close, far = (tmp_path / f"{n}.json" for n in ("ref", "close", "far"))
    ref.write_text(json.dumps(logprobs.records(ids, _answers(ids, 0.0))))
    close.write_text(json.dumps(logprobs.records(ids, _answers(ids, 0.03))))
    far.write_text(json.dumps(logprobs.records(ids, _answers(ids, 0.5, output_ids=(13, 12)))))
    rec = json.loads(ref.read_text())[0]
    assert rec["prompt"] == ids[0] and rec["prompt_logprobs"][0] is None
    assert rec["prompt_logprobs"][1:3] == [-1.0, -1.3] and rec["text"] == [11, 12]
    assert compare_logprobs.main([str(ref), str(close)]) == 0
    assert compare_logprobs.main([str(ref), str(far)]) == 1


def test_records_refuse_a_short_answer():
    ids = logprobs.prompts()
    with pytest.raises(ValueError, match="3 answers for 4 prompts"):
        logprobs.records(ids, _answers(ids[:3], 0.0))


SCALED_WEIGHTS = ROOT / "tools" / "e2e" / "sglang_scaled_weights"
FAKE_LOADER = '''
import torch
def initialize_dummy_weights(model, low=-1e-3, high=1e-3, seed=1234):
    for p in model.state_dict().values():
        if torch.is_floating_point(p):
            p.copy_(torch.empty(p.shape).uniform_(low, high).to(p.dtype))
'''
CHILD = '''
import sys, torch
assert "sglang" not in sys.modules and type(sys.meta_path[0]).__name__ == "LoaderPatch"
from sglang.srt.model_loader import loader
m = torch.nn.Module()
m.w13_weight = torch.nn.Parameter(torch.zeros(256, 512, dtype=torch.float8_e4m3fn), requires_grad=False)
m.w13_weight_scale_inv = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
m.input_layernorm = torch.nn.Module()
m.input_layernorm.weight = torch.nn.Parameter(torch.zeros(512))
m.e_score_correction_bias = torch.nn.Parameter(torch.full((8,), 7.0))
loader.initialize_dummy_weights(m)
w = m.w13_weight.float()
print(round(w.std().item()), round(m.w13_weight_scale_inv.mean().item() * 64 * 512 ** 0.5, 1),
      round(m.input_layernorm.weight.mean().item(), 1), m.e_score_correction_bias.abs().max().item() <= 1e-3)
'''


def _run_child(tmp_path, loader_source):
    pkg = tmp_path / "sglang" / "srt" / "model_loader"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "loader.py").write_text(loader_source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCALED_WEIGHTS), str(tmp_path)])}
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)


def test_scaled_weights_replace_sglangs_dummy_fill_in_a_fresh_process(tmp_path):
    proc = _run_child(tmp_path, FAKE_LOADER)
    assert proc.returncode == 0, proc.stderr
    # FP8 values of std 64, block scales 1/(64 sqrt(fan_in)),
    # norm gains near 1; the 1-D bias without a rule keeps SGLang's uniform(-1e-3, 1e-3).
    assert proc.stdout.split()[-4:] == ["64", "1.0", "1.0", "True"], proc.stdout
    assert "scaled_weights: filled 4 parameters" in proc.stdout


def test_scaled_weights_refuse_a_loader_without_the_dummy_fill(tmp_path):
    proc = _run_child(tmp_path, "x = 1\n")
    assert proc.returncode != 0 and "has no initialize_dummy_weights" in proc.stderr


def _decode_report(running, throughput):
    return (f"[2026-12-06 19:00:06] Decode batch, #running-req: {running}, #token: 76436, token usage: 0.01, "
            f"cuda graph: True, gen throughput (token/s): {throughput}, #queue-req: 0\n")


def test_decode_steps_takes_the_median_at_the_usual_running_count(tmp_path, capsys):
    log = tmp_path / "serve.log"
    lines = ["[2026-12-06 19:00:00] Prefill batch, #new-seq: 1, #new-token: 8, input throughput (token/s): 6.06\n",
             _decode_report(1, 1.31), _decode_report(4, 9000.0)]
    lines += [_decode_report(64, t) for t in (900.5, 24000.0, 25000.0, 26000.0, 23000.0)]
    log.write_text("".join(lines))
    assert decode_steps.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "with 64 running requests: 5, gen throughput median 24000 tok/s" in out
    assert decode_steps.main([str(log), "--running", "4"]) == 0
    assert "with 4 running requests: 1, gen throughput median 9000 tok/s" in capsys.readouterr().out
    assert decode_steps.main([str(log), "--running", "8"]) == 1
    assert "no decode report with 8 running requests" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text(lines[0])
    assert decode_steps.main([str(empty)]) == 1
