"""Fixtures for the vLLM plugin tests (CPU machine, real vllm package).

vLLM is pointed at its CPU platform (VLLM_TARGET_DEVICE=cpu, docs/design.md section 6) before
anything imports it; in an environment without vllm each test module skips itself, with that
reason (it starts with pytest.importorskip("vllm"), before its module-level vllm imports).
NOTE: this directory must stay without an __init__.py: as a package named `vllm` it
would shadow the real one.
"""
import importlib.util
import itertools
import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if HAVE_VLLM and os.environ["VLLM_TARGET_DEVICE"] == "cpu":
    # vLLM 0.24 ignores VLLM_TARGET_DEVICE when it picks the platform of a CUDA wheel on a
    # machine without GPUs (it falls back to UnspecifiedPlatform); 0.33 honours it.
    import vllm.platforms as _platforms

    if not _platforms.current_platform.device_type:
        from vllm.platforms.cpu import CpuPlatform

        _platforms._current_platform = CpuPlatform()

FIXTURE_MODEL = Path(__file__).resolve().parent / "fixtures" / "tiny_fp8_moe"
# The fixture model's MoE shape (config.json).
NUM_EXPERTS, TOPK, HIDDEN, INTERMEDIATE = 8, 2, 256, 128
MAX_BATCHED_TOKENS = 64

_layer_ids = itertools.count()


def engine_args(**overrides):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(model=str(FIXTURE_MODEL), quantization="fp8", moe_backend="megamoe_sm90",
                  enable_expert_parallel=True, skip_tokenizer_init=True, max_model_len=512,
                  max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=16, enforce_eager=True)
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


def make_vllm_config(**overrides):
    return engine_args(**overrides).create_engine_config()


@pytest.fixture(scope="session")
def registered():
    from megamoe_plugin.vllm_plugin import register

    register()


@pytest.fixture(scope="session")
def vllm_config(registered):
    return make_vllm_config()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def dist_env(vllm_config):
    """A one-rank gloo 'distributed' environment with vLLM's model-parallel groups."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                     local_rank=0, backend="gloo")
        with set_current_vllm_config(vllm_config):
            initialize_model_parallel(1, 1)
    try:  # vLLM 0.24's modular kernel takes its scratch from the worker's workspace manager
        import torch
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))
    except ImportError:
        pass
    return True


@pytest.fixture
def reference_executor():
    from megamoe_plugin.vllm_plugin import executor

    previous = executor.set_executor("reference")
    executor.clear_buffers()
    yield
    executor.set_executor(previous)
    executor.clear_buffers()


def torch_softmax_topk(hidden_states, gating_output, topk, renormalize):
    """Softmax top-k routing in torch (what vLLM's fused top-k computes)."""
    import torch

    weights, ids = torch.topk(torch.softmax(gating_output.float(), dim=-1), topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _has_cpu_router() -> bool:
    # vLLM 0.33 routes on the CPU platform; 0.24's router calls a CUDA-only op.
    return importlib.util.find_spec("vllm.model_executor.layers.fused_moe.router.cpu_router") is not None


def build_moe(cfg, *, num_experts=NUM_EXPERTS, top_k=TOPK, hidden=HIDDEN, intermediate=INTERMEDIATE,
              quant_config=None, **kwargs):
    """A vLLM MoE layer (router + RoutedExperts + runner) as a model would build it."""
    import torch
    from vllm.config import set_current_vllm_config

    from megamoe_plugin.vllm_plugin.compat import fused_moe_factory

    kwargs.setdefault("params_dtype", torch.bfloat16)
    kwargs.setdefault("renormalize", True)
    if not _has_cpu_router():
        kwargs.setdefault("custom_routing_function", torch_softmax_topk)
    prefix = kwargs.pop("prefix", f"model.layers.{next(_layer_ids)}.mlp.experts")
    with set_current_vllm_config(cfg):
        return fused_moe_factory()(num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                                   intermediate_size=intermediate, prefix=prefix,
                                   quant_config=quant_config if quant_config is not None else cfg.quant_config,
                                   **kwargs)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a fresh Python process with vLLM (~20 s); deselect with "
                                       "-m 'not slow'")
