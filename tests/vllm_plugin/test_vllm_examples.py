"""The examples' command lines are valid for the installed vLLM (parsed, not run)."""
import re
import runpy
import shlex
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from conftest import FIXTURE_MODEL  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _exec_args(script: str, command: str, env: dict) -> list:
    """The arguments of the `exec <command> ...` line (with continuations) of a script."""
    text = (EXAMPLES / script).read_text()
    block = re.search(rf"^exec {re.escape(command)} (.*?)\"\$@\"", text, re.S | re.M).group(1)
    block = block.replace("\\\n", " ")
    for name, value in env.items():
        block = block.replace(f'"${name}"', value).replace(f"${{{name}}}", value).replace(f"${name}", value)
    return shlex.split(block)


def test_scripts_are_valid_shell():
    for script in ("serve.sh", "bench_serve.sh"):
        subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)


class _StopAtLLM(Exception):
    pass


def _offline_engine_args(monkeypatch, argv):
    """The EngineArgs that examples/offline.py's `LLM(...)` call builds (LLM passes its kwargs to EngineArgs)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    built = []

    def capture_llm(**kwargs):
        built.append(EngineArgs(**kwargs))
        raise _StopAtLLM

    monkeypatch.setattr(vllm, "LLM", capture_llm)
    monkeypatch.setattr("sys.argv", ["offline.py"] + argv)
    with pytest.raises(_StopAtLLM):
        runpy.run_path(str(EXAMPLES / "offline.py"), run_name="__main__")
    return built[0]


def test_offline_example_builds_engine_config(registered, monkeypatch):
    args = _offline_engine_args(monkeypatch, ["--model", str(FIXTURE_MODEL)])
    args.skip_tokenizer_init = True  # the fixture model is a config only
    cfg = args.create_engine_config()
    assert cfg.kernel_config.moe_backend == "megamoe_sm90" and cfg.model_config.quantization == "fp8"
    assert cfg.parallel_config.tensor_parallel_size == 1 and not cfg.parallel_config.enable_expert_parallel
    assert cfg.scheduler_config.max_num_batched_tokens == 8192 and cfg.model_config.max_model_len == 4096


def test_offline_example_expert_parallel_with_tensor_parallel(monkeypatch):
    args = _offline_engine_args(monkeypatch, ["--tensor-parallel-size", "8", "--moe-backend", "auto"])
    assert args.tensor_parallel_size == 8 and args.enable_expert_parallel and args.moe_backend == "auto"


def test_serve_example_flags_parse(registered):
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = _exec_args("serve.sh", "vllm serve", {"MODEL": str(FIXTURE_MODEL), "PORT": "8000",
                                                 "MAX_BATCHED_TOKENS": "8192"})
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    ns = parser.parse_args(["serve"] + args)
    assert ns.moe_backend == "megamoe_sm90" and ns.quantization == "fp8"
    assert ns.data_parallel_size == 8 and ns.enable_expert_parallel


def test_bench_example_flags_parse():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = _exec_args("bench_serve.sh", "vllm bench serve", {"MODEL": "m", "HOST": "127.0.0.1", "PORT": "8000"})
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(args)
    assert ns.dataset_name == "random" and ns.num_prompts == 512 and ns.max_concurrency == 64 and ns.ignore_eos
    assert ns.random_input_len == 1024 and ns.random_output_len == 256
