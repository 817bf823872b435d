"""benchmarks/*.py: --help describes the script and every option, and without an SM90 GPU
the script stops with one line on stderr, not a traceback."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


def _run(script, *args, **env):
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def _parser(script, monkeypatch):
    spec = importlib.util.spec_from_file_location(script[:-3], BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parser()


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_the_script_and_every_option(script, monkeypatch):
    proc = _run(script, "--help")
    assert proc.returncode == 0, proc.stderr
    first_line = _parser(script, monkeypatch).description.splitlines()[0]
    assert first_line in proc.stdout
    assert all(action.help for action in _parser(script, monkeypatch)._actions)


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_a_gpu_one_line_error(script):
    proc = _run(script, "--tokens", "1", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"{script}: needs an SM90 (Hopper) GPU; CUDA is not available here"]

