"""The end-to-end comparison tool (tools/e2e) on synthetic client outputs."""
import importlib.util
import json
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
    a = _write(tmp_path / "a.json", [None, -1.0], prompt="p")
    b = _write(tmp_path / "b.json", [None, -1.0], prompt="q")
    with pytest.raises(ValueError, match="prompts differ"):
        compare_logprobs.main([a, b])
