"""`python -m megamoe_plugin.bench.vs_vllm`: --help describes the command and every option, it names
the shape as the other CLIs do, and without an SM90 GPU it stops with one line on stderr, not a
traceback."""
import os
import subprocess
import sys

from megamoe_plugin.bench import vs_vllm

MODULE = "megamoe_plugin.bench.vs_vllm"


def _run(*args, **env):
    return subprocess.run([sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_help_describes_the_command_and_every_option():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    parser = vs_vllm.parser()
    assert parser.description.splitlines()[0] in proc.stdout
    for action in parser._actions:
        assert action.help, action.dest
        assert action.option_strings[-1] in proc.stdout


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
