"""The plugin inside real sglang 0.5.17 on a CPU (its own hook points: registration.SIGNATURES_0_5_17).

0.5.17 is the one release with the SM90 mega-MoE path whose pins fit torch 2.11 (docs/sglang.md,
"Which sglang releases"). Here: loading through the entry point, the flag and its resolution around
ServerArgs.__post_init__, the refusals that resolution adds, a changed signature, and a MoE
layer through SGLang's real `_run_mega_routed` (the buffer and the routed forward hooked)
with the float32 reference standing in for the kernel, and the over-the-cap refusal.
"""
import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import DEEPSEEK_FIXTURE_MODEL, FIXTURE_MODEL, HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK, only_0_5_17
from fp8_experts import (CAP, Block, Experts, SharedMLP, built_experts, expected, fp8_config, load_model, routing,
                         shared_expected, sm90_reference)

pytestmark = only_0_5_17

BACKEND = "megamoe_sm90"


def test_plugin_loads_through_the_entry_point_in_a_fresh_process():
    script = textwrap.dedent("""
        import json, pkgutil
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        from megamoe_plugin.sglang_plugin import layer, refusals, registration, resolution
        from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES
        targets = sorted(layer.HOOKS_0_5_17) + [resolution.SERVER_ARGS_POST_INIT]
        print(json.dumps(dict(
            registered=registration.is_registered(), problem=refusals.incompatibility(),
            choices=MOE_RUNNER_BACKEND_CHOICES.count("megamoe_sm90"), targets=targets,
            patched=sorted(HookRegistry._patched),
            wrapped={t: getattr(pkgutil.resolve_name(t), "__wrapped__", None) is not None for t in targets})))
    """)
    env = dict(os.environ, SGLANG_PLUGINS=BACKEND)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["registered"] is True and got["problem"] is None
    assert got["choices"] == 1
    assert len(got["targets"]) == 9 and set(got["targets"]) <= set(got["patched"])
    assert all(got["wrapped"].values()), got["wrapped"]


def _parse(*argv, model=DEEPSEEK_FIXTURE_MODEL, ranks=2):
    """Server arguments resolved on CPU, on `ranks` GPUs (EP = TP): 0.5.17 cannot serve a mega-MoE
    backend on one (test_one_gpu_is_refused_on_0_5_17)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(
        ["--model-path", str(model), "--device", "cpu", "--tp-size", str(ranks), "--ep-size", str(ranks), *argv]))


def test_the_flag_resolves_to_sglangs_mega_moe_path(registered):
    from megamoe_plugin.sglang_plugin.resolution import MARKER, selected_by

    args = _parse("--moe-runner-backend", BACKEND, "--chunked-prefill-size", "1024")
    assert (args.moe_a2a_backend, args.moe_runner_backend) == ("megamoe", "auto")
    assert selected_by(args)
    # The mark travels with the record to the scheduler processes (SGLang pickles it).
    assert selected_by(pickle.loads(pickle.dumps(args))) and getattr(args, MARKER) is True
    # DeepGEMM's megamoe is left alone.
    other = _parse("--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "1024")
    assert other.moe_a2a_backend == "megamoe" and not selected_by(other)
    with pytest.raises(SystemExit):
        _parse("--moe-runner-backend", "megamoe_sm91")


@pytest.mark.parametrize("argv, model, message", [
    (("--chunked-prefill-size", "1024"), FIXTURE_MODEL,
     "Qwen3MoeForCausalLM on sglang 0.5.17: only DeepseekV2ForCausalLM, DeepseekV3ForCausalLM"),
    (("--chunked-prefill-size", "2048"), DEEPSEEK_FIXTURE_MODEL,
     "a prefill chunk of 2048 tokens per rank, over the per-rank token cap 1024"),
    (("--chunked-prefill-size", "-1"), DEEPSEEK_FIXTURE_MODEL, "unbounded prefill (chunked prefill off)"),
    (("--moe-a2a-backend", "deepep"), DEEPSEEK_FIXTURE_MODEL, "--moe-a2a-backend deepep"),
    (("--chunked-prefill-size", "1024", "--enable-eplb"), DEEPSEEK_FIXTURE_MODEL, "--enable-eplb: EPLB moves experts"),
])
def test_what_0_5_17_cannot_serve_is_refused_at_resolution(registered, argv, model, message):
    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    with pytest.raises(MegaMoEUnsupportedError, match=re.escape(message)) as info:
        _parse("--moe-runner-backend", BACKEND, *argv, model=model)
    assert str(info.value).startswith(f"--moe-runner-backend {BACKEND}: ")


def test_an_incompatible_sglang_is_refused_when_the_backend_is_selected(registered, monkeypatch):
    from megamoe_plugin.sglang_plugin import refusals
    from megamoe_plugin.sglang_plugin.refusals import IncompatibleSGLangError

    monkeypatch.setattr(refusals, "_incompatibility", "sglang's x takes (a), the plugin was written for (b)")
    with pytest.raises(IncompatibleSGLangError, match=re.escape("cannot run on this sglang: sglang's x takes (a)")):
        _parse("--moe-runner-backend", BACKEND, "--chunked-prefill-size", "1024")
    assert _parse("--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "1024").moe_a2a_backend == "megamoe"


def test_a_changed_signature_is_found(registered, monkeypatch):
    import sglang.srt.layers.moe.mega_moe as mega_moe

    from megamoe_plugin.sglang_plugin import registration

    assert registration.signature_problem(registration.SIGNATURES_0_5_17) is None
    # The 0.5.23 table does not describe 0.5.17 (that is why there are two).
    assert "run_sm90_mega_routed takes (moe, " in registration.signature_problem(registration.SIGNATURES_0_5_23)

    def should_use_mega_moe(moe, hidden_states, forward_batch=None):
        raise AssertionError("not called")

    monkeypatch.setattr(mega_moe, "should_use_mega_moe", should_use_mega_moe)
    problem = registration.signature_problem(registration.SIGNATURES_0_5_17)
    assert "mega_moe.should_use_mega_moe takes (moe, hidden_states, forward_batch=None)" in problem


class _Block:
    """The DeepSeek-V2 MoE block attributes 0.5.17's mega-MoE forward reads: its router
    gives fixed top-k ids and weights."""

    def __init__(self, experts, ids, weights):
        self.experts, self.layer_id, self.is_hash, self.num_fused_shared_experts = experts, 0, False, 0
        self.routed_scaling_factor = 2.5
        self.config = type("Cfg", (), dict(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                          num_experts_per_tok=TOPK, swiglu_limit=None))()
        self.gate = lambda hidden_states, forward_batch=None: None
        self.topk = lambda hidden_states, logits, **kwargs: type("TopK", (), dict(
            topk_ids=ids[:hidden_states.shape[0]], topk_weights=weights[:hidden_states.shape[0]]))()


@pytest.fixture
def selected_on_sm90(registered, monkeypatch):
    """Published server arguments selecting the backend, SGLang's SM90 reading and mega-MoE
    a2a flag, the token cap, one EP rank, no expert-location dispatch, the reference executor."""
    import sglang.srt.distributed.parallel_state as parallel_state
    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.layers.moe.utils import MoeA2ABackend, get_flags

    args = _parse("--moe-runner-backend", BACKEND, "--chunked-prefill-size", "1024")
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    monkeypatch.setattr(get_flags().moe, "a2a_backend", MoeA2ABackend("megamoe"))
    monkeypatch.setattr(parallel_state, "get_moe_ep_group", lambda: type("G", (), {"device_group": None})())
    monkeypatch.setattr(mega_moe, "ExpertLocationDispatchInfo", type("D", (), {"init_new": staticmethod(
        lambda layer_id: None)}))
    with sm90_reference(monkeypatch):
        yield


def test_a_deepseek_moe_block_runs_the_kernel_path_and_matches_the_contract(selected_on_sm90):
    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    experts = Experts(fp8_config())
    experts.should_fuse_routed_scaling_factor_in_topk = False
    ckpt = [p.data.clone() for p in (experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight,
                                     experts.w2_weight_scale_inv)]
    sm90.build_sm90_mega_moe_experts_weights(experts)  # what 0.5.17's Fp8MoEMethod calls at load
    assert experts.mega_l1_weights[0].data_ptr() == experts.w13_weight.data_ptr()  # no second copy

    x, ids, weights = routing(5)
    block = _Block(experts, ids, weights)
    assert mega_moe.should_use_mega_moe(block, x)
    y = mega_moe._run_mega_routed(block, x, None, None, 5)
    assert y.shape == (5, HIDDEN) and y.dtype == torch.bfloat16
    want = expected(x.float(), ids, 2.5 * weights, *ckpt)  # the block's routed scaling factor
    rel = ((y.float() - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel
    # A router that already folded the factor into the weights.
    experts.should_fuse_routed_scaling_factor_in_topk = True
    y = mega_moe._run_mega_routed(block, x, None, None, 5)
    want = expected(x.float(), ids, weights, *ckpt)
    rel = ((y.float() - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel
    # Zero local tokens still take part.
    assert mega_moe._run_mega_routed(block, x[:0], None, None, 0).shape == (0, HIDDEN)


def test_a_forward_over_the_token_cap_is_refused_not_run_on_the_usual_path(selected_on_sm90):
    import sglang.srt.layers.moe.mega_moe as mega_moe
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    experts = Experts(fp8_config())
    sm90.build_sm90_mega_moe_experts_weights(experts)
    x, ids, weights = routing(CAP + 1)
    with pytest.raises(MegaMoEUnsupportedError, match=f"a forward of {CAP + 1} tokens on this rank"):
        mega_moe.should_use_mega_moe(_Block(experts, ids, weights), x)
    assert mega_moe.should_use_mega_moe(_Block(experts, ids, weights), x[:CAP])
    # Layers whose weights SGLang built (another backend) keep SGLang's answer.
    assert mega_moe.should_use_mega_moe(_Block(Experts(fp8_config()), ids, weights), x) is False


def test_one_gpu_is_refused_on_0_5_17(registered):
    """0.5.17's MLP-sync step fails at world size 1 for every mega-MoE backend (refusals.py):
    refused at resolution, naming the fix, unless the installed copy was fixed in place
    (docs/sglang.md, "Numbers", gives the one-line fix)."""
    import inspect

    from sglang.srt.managers.scheduler_components.dp_attn import MLPSyncBatchInfo

    from megamoe_plugin.sglang_plugin import refusals

    with pytest.raises(refusals.MegaMoEUnsupportedError,
                       match=re.escape("one GPU (--tp-size 1) on sglang 0.5.17") + ".*use sglang >=0.5.23"):
        _parse("--moe-runner-backend", BACKEND, "--chunked-prefill-size", "1024", ranks=1)
    # DeepGEMM's megamoe is SGLang's to run or not.
    assert _parse("--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "1024", ranks=1).moe_a2a_backend == "megamoe"
    source = inspect.getsource(MLPSyncBatchInfo.all_gather)
    assert refusals._ALIASING_GATHER.search(source)
    assert not refusals._ALIASING_GATHER.search(source.replace(").contiguous()", ").clone()"))


def test_the_blocks_shared_experts_run_inside_the_call(selected_on_sm90):
    """0.5.17's load and forward: after ModelRunner.load_model the block's forward runs one call
    with its shared expert in it (the buffer asked for it), not the MLP."""
    import sglang.srt.layers.moe.mega_moe as mega_moe

    experts, ckpt = built_experts(3)
    experts.should_fuse_routed_scaling_factor_in_topk = False
    x, ids, weights = routing(6)
    block = Block(experts, SharedMLP(1, seed=4), ids, weights)
    load_model([block])
    assert experts.w13_weight.shape[0] == NUM_EXPERTS + 1
    y = mega_moe.forward_mega_moe(block, x)
    want = expected(x.float(), ids, 2.5 * weights, *ckpt) + shared_expected(x.float(), *block.shared_checkpoint)
    rel = ((y.float() - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel
    assert block.shared_forwards == 0
