"""Registration: the entry point, idempotence and cost of register(), and every way a user
selects the backend (serve CLI flag, --kernel-config JSON, EngineArgs / LLM kwargs)."""
import json
import os
import subprocess
import sys
import typing

import pytest

pytest.importorskip("vllm")

from conftest import FIXTURE_MODEL, engine_args  # noqa: E402

from megamoe_plugin.vllm_plugin.registration import passthrough_all2all_supported  # noqa: E402

BACKEND = "megamoe_sm90"
# vLLM >= 0.33 binds self-dispatching MoE backends to its passthrough all2all backend; older ones have none.
needs_passthrough = pytest.mark.skipif(not passthrough_all2all_supported(),
                                       reason="this vLLM has no passthrough all2all backend (vLLM < 0.33)")


def _serve_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def _engine_config_from_cli(argv):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _serve_parser().parse_args(argv)
    args.model = args.model_tag
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config()


SERVE_ARGV = ["serve", str(FIXTURE_MODEL), "--quantization", "fp8", "--moe-backend", BACKEND,
              "--enable-expert-parallel", "--skip-tokenizer-init", "--max-model-len", "512",
              "--max-num-batched-tokens", "64", "--enforce-eager"]


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == BACKEND]
    if not eps:
        pytest.skip("megamoe_plugin is not pip-installed (the entry point comes from setup.py)")
    assert eps[0].value == "megamoe_plugin.vllm_plugin:register"


def test_register_twice_is_idempotent(registered):
    import vllm.config.kernel as kernel_mod
    import vllm.model_executor.layers.quantization as quant_mod

    from megamoe_plugin.vllm_plugin import register

    def state():
        return (typing.get_args(kernel_mod.MoEBackend),
                typing.get_args(kernel_mod.KernelConfig.__dataclass_fields__["moe_backend"].type),
                quant_mod._CUSTOMIZED_METHOD_TO_QUANT_CONFIG)

    before = state()
    register()
    register()
    after = state()
    assert before[0] == after[0] and before[1] == after[1] and before[2] is after[2]
    assert after[0].count(BACKEND) == 1 and after[1].count(BACKEND) == 1


@needs_passthrough
def test_register_twice_wraps_passthrough_binding_once(registered):
    import vllm.config.kernel as kernel_mod

    from megamoe_plugin.vllm_plugin import register

    before = kernel_mod.bind_passthrough_all2all_backend
    register()
    bind = kernel_mod.bind_passthrough_all2all_backend
    assert bind is before and bind._megamoe_wrapped
    assert not getattr(bind._megamoe_original, "_megamoe_wrapped", False)


def test_register_is_cheap_and_cuda_free():
    """In a fresh process: no vLLM model/kernel modules, no fp8 module, no CUDA init."""
    code = """
import sys, time
import vllm.config  # vLLM imports its config package before it loads plugins
before = set(sys.modules)
t0 = time.perf_counter()
from megamoe_plugin.vllm_plugin import register
register(); register()
elapsed = time.perf_counter() - t0
new = set(sys.modules) - before
import torch
heavy = sorted(m for m in new if m.startswith(("vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.fused_moe", "vllm.model_executor.models", "vllm.engine",
    "megamoe_plugin.vllm_plugin.moe_method", "megamoe_plugin.vllm_plugin.quant_config", "triton")))
assert not heavy, heavy
assert not torch.cuda.is_initialized()
assert elapsed < 5.0, elapsed
print("ok %.3f s, %d new modules" % (elapsed, len(new)))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith("ok")


def test_fp8_lookup_resolves_to_plugin_config_lazily(registered):
    import vllm.model_executor.layers.quantization as quant_mod

    from megamoe_plugin.vllm_plugin.quant_config import MegaMoEFp8Config

    cls = quant_mod.get_quantization_config("fp8")
    assert cls is MegaMoEFp8Config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    assert issubclass(cls, Fp8Config)
    # Other methods are untouched.
    assert quant_mod.get_quantization_config("compressed-tensors").__name__ == "CompressedTensorsConfig"


def test_kernel_config_accepts_backend(registered):
    from pydantic import ValidationError
    from vllm.config.kernel import KernelConfig

    assert KernelConfig(moe_backend=BACKEND).moe_backend == BACKEND
    assert KernelConfig(moe_backend="MegaMoE-SM90").moe_backend == BACKEND  # vLLM's normalization applies
    with pytest.raises(ValidationError):
        KernelConfig(moe_backend="megamoe_sm91")


def test_serve_cli_parses_and_builds_engine_config(registered):
    args, cfg = _engine_config_from_cli(SERVE_ARGV)
    assert args.moe_backend == BACKEND and args.quantization == "fp8" and args.enable_expert_parallel
    assert cfg.kernel_config.moe_backend == BACKEND
    assert type(cfg.quant_config).__name__ == "MegaMoEFp8Config"
    assert list(cfg.quant_config.weight_block_size) == [128, 128]


@needs_passthrough
def test_serve_cli_binds_passthrough_all2all(registered):
    _, cfg = _engine_config_from_cli(SERVE_ARGV)
    assert cfg.parallel_config.all2all_backend == "passthrough"


def test_serve_cli_help_lists_backend(registered, capsys):
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["serve", "--moe-backend", "not_a_backend"])
    assert BACKEND in capsys.readouterr().err  # argparse lists the valid choices


def test_kernel_config_json(registered):
    argv = [a for a in SERVE_ARGV if a not in ("--moe-backend", BACKEND)]
    argv += ["--kernel-config", json.dumps({"moe_backend": BACKEND})]
    _, cfg = _engine_config_from_cli(argv)
    assert cfg.kernel_config.moe_backend == BACKEND


def test_engine_args_kwargs(registered):
    cfg = engine_args().create_engine_config()
    assert cfg.kernel_config.moe_backend == BACKEND
    assert type(cfg.quant_config).__name__ == "MegaMoEFp8Config"


def test_llm_kwargs_path(registered, monkeypatch):
    """LLM(..., moe_backend="megamoe_sm90") up to the engine: the config it would start with."""
    import vllm.entrypoints.llm as llm_mod

    captured = {}

    class Stop(Exception):
        pass

    def fake_from_engine_args(engine_args, **kwargs):
        captured["config"] = engine_args.create_engine_config()
        raise Stop

    monkeypatch.setattr(llm_mod.LLMEngine, "from_engine_args", staticmethod(fake_from_engine_args))
    with pytest.raises(Stop):
        llm_mod.LLM(model=str(FIXTURE_MODEL), quantization="fp8", moe_backend=BACKEND, enable_expert_parallel=True,
                    skip_tokenizer_init=True, max_model_len=512, max_num_batched_tokens=64, enforce_eager=True)
    cfg = captured["config"]
    assert cfg.kernel_config.moe_backend == BACKEND
    assert type(cfg.quant_config).__name__ == "MegaMoEFp8Config"


def test_other_backends_keep_vllm_fp8_moe_method(vllm_config, monkeypatch):
    """With another moe_backend the plugin's fp8 config hands MoE layers vLLM's own
    Fp8MoEMethod (stubbed here: vLLM's FP8 MoE kernels do not build on a CPU)."""
    import types

    import vllm.model_executor.layers.quantization.fp8 as vllm_fp8

    from megamoe_plugin.vllm_plugin.compat import routed_experts_class

    made = []
    monkeypatch.setattr(vllm_fp8, "Fp8MoEMethod", lambda quant_config, layer: made.append(layer) or "vllm")
    layer = object.__new__(routed_experts_class())
    object.__setattr__(layer, "moe_config", types.SimpleNamespace(moe_backend="triton"))
    assert vllm_config.quant_config.get_quant_method(layer, "model.layers.0.mlp.experts") == "vllm"
    assert made == [layer]


@needs_passthrough
def test_explicit_other_all2all_backend_is_refused(registered):
    with pytest.raises(ValueError, match="leave --all2all-backend unset"):
        engine_args(all2all_backend="deepep_low_latency").create_engine_config()


@pytest.mark.slow
def test_entry_point_in_fresh_process():
    """vLLM itself discovers and runs the entry point (no direct register() call): the
    serve CLI accepts the backend in a clean interpreter. ~20 s."""
    from importlib.metadata import entry_points

    if not [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == BACKEND]:
        pytest.skip("megamoe_plugin is not pip-installed (no entry point)")
    code = f"""
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(p.add_subparsers(dest="subparser"))
a = p.parse_args({SERVE_ARGV!r})
assert a.moe_backend == "{BACKEND}"
print("ok")
"""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env.pop("VLLM_PLUGINS", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
