"""The plugin inside real sglang on a CPU: loading through the entry point, the flag, the
argument resolution, the hooks, and the refusal of an sglang it was not written for."""
import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import FIXTURE_MODEL, not_0_5_17

pytestmark = not_0_5_17

BACKEND = "megamoe_sm90"
HOOKED = ("sglang.srt.layers.moe.mega_moe_sm90.build_sm90_mega_moe_experts_weights",
          "sglang.srt.layers.moe.mega_moe_sm90.is_sm90_fp8_mega_moe_available",
          "sglang.srt.layers.moe.mega_moe._get_mega_moe_symm_buffer",
          "sglang.srt.layers.moe.mega_moe_sm90.run_sm90_mega_routed",
          "sglang.srt.model_executor.model_runner.ModelRunner.load_model")


def test_plugin_loads_through_the_entry_point_in_a_fresh_process():
    script = textwrap.dedent("""
        import json, pkgutil
        from importlib.metadata import entry_points
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        from megamoe_plugin.sglang_plugin import refusals, registration
        from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES
        eps = [ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "megamoe_sm90"]
        print(json.dumps(dict(
            entry_points=eps, registered=registration.is_registered(), problem=refusals.incompatibility(),
            choices=MOE_RUNNER_BACKEND_CHOICES.count("megamoe_sm90"), patched=sorted(HookRegistry._patched),
            wrapped={t: getattr(pkgutil.resolve_name(t), "__wrapped__", None) is not None for t in %r})))
    """ % (HOOKED,))
    env = dict(os.environ, SGLANG_PLUGINS=BACKEND)  # SGLang's allowlist: only this plugin
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["entry_points"] == ["megamoe_plugin.sglang_plugin:register"]
    assert got["registered"] is True and got["problem"] is None
    assert got["choices"] == 1
    assert set(HOOKED) <= set(got["patched"])
    assert all(got["wrapped"].values()), got["wrapped"]


def test_register_is_idempotent(registered):
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS

    from megamoe_plugin.sglang_plugin import register

    before = (list(MOE_RUNNER_BACKEND_CHOICES), {k: list(v) for k, v in _HOOKS.items()})
    register()
    register()
    assert (list(MOE_RUNNER_BACKEND_CHOICES), {k: list(v) for k, v in _HOOKS.items()}) == before


def _parse(*argv):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", str(FIXTURE_MODEL), *argv]))


def test_the_flag_parses(registered):
    assert _parse("--moe-runner-backend", BACKEND).moe_runner_backend == BACKEND
    with pytest.raises(SystemExit):
        _parse("--moe-runner-backend", "megamoe_sm91")


@pytest.fixture
def sm90_platform(monkeypatch):
    """SGLang's own SM90 check (check_mega_moe_compat) sees a CUDA SM90 platform."""
    import sglang.srt.arg_groups.mega_moe_hook as hook

    class SM90:
        is_cuda, is_sm90, is_sm100, is_hip = True, True, False, False

    monkeypatch.setattr(hook, "get_platform", lambda: SM90())


def _resolve_mega_moe(server_args):
    from sglang.srt.arg_groups.mega_moe_hook import handle_mega_moe
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.resolution_hooks import run_hook

    run_hook(handle_mega_moe, server_args)
    return resolving_view(server_args)


def test_server_args_resolve_to_sglangs_mega_moe_path(registered, sm90_platform):
    from megamoe_plugin.sglang_plugin.resolution import selected_by

    args = _parse("--moe-runner-backend", BACKEND)
    cfg = _resolve_mega_moe(args)
    assert (cfg.moe_a2a_backend, cfg.moe_runner_backend) == ("megamoe", "auto")
    assert args.moe_runner_backend == BACKEND and selected_by(args)  # the operator's input stays on the record
    # DeepGEMM's megamoe is left alone.
    other = _parse("--moe-runner-backend", "megamoe")
    assert (_resolve_mega_moe(other).moe_a2a_backend, selected_by(other)) == ("megamoe", False)


def test_sglangs_own_checks_run_on_the_resolved_path(registered):
    # On this CPU machine SGLang's mega-MoE platform check refuses, as it does for DeepGEMM's.
    with pytest.raises(ValueError, match="needs a CUDA SM90 GPU"):
        _resolve_mega_moe(_parse("--moe-runner-backend", BACKEND))


@pytest.mark.parametrize("argv, message", [
    (("--moe-a2a-backend", "deepep"), "--moe-a2a-backend deepep.*leave --moe-a2a-backend unset"),
    (("--enable-eplb",), "--enable-eplb: EPLB moves experts.*drop --enable-eplb"),
])
def test_arguments_the_kernel_cannot_take_are_refused(registered, sm90_platform, argv, message):
    from megamoe_plugin.sglang_plugin.refusals import MegaMoEUnsupportedError

    with pytest.raises(MegaMoEUnsupportedError, match=message):
        _resolve_mega_moe(_parse("--moe-runner-backend", BACKEND, *argv))


def test_the_hooks_defer_to_sglang_when_not_selected(registered):
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    class Experts:
        _mega_moe_sm90_fp8_weights = True

    # No published server arguments select the backend: SGLang's original answers (no
    # DeepGEMM SM90 device here, so not available).
    assert sm90.is_sm90_fp8_mega_moe_available(Experts()) is False
    assert sm90.is_sm90_fp8_mega_moe_available.__wrapped__(Experts()) is False


def test_a_changed_signature_is_found(registered, monkeypatch):
    import sglang.srt.layers.moe.mega_moe_sm90 as sm90

    from megamoe_plugin.sglang_plugin import registration

    assert registration.signature_problem(registration.SIGNATURES_0_5_23) is None

    def run_sm90_mega_routed(experts, hidden_states, topk_ids, topk_weights, buf, num_tokens, *, hidden_size,
                             activation_clamp=None, routed_scaling_factor=1.0, new_option=False):
        raise AssertionError("not called")

    monkeypatch.setattr(sm90, "run_sm90_mega_routed", run_sm90_mega_routed)
    problem = registration.signature_problem(registration.SIGNATURES_0_5_23)
    assert "sglang.srt.layers.moe.mega_moe_sm90.run_sm90_mega_routed" in problem
    assert "new_option=False" in problem and "routed_scaling_factor=1.0)" in problem
    monkeypatch.delattr(sm90, "run_sm90_mega_routed")
    assert "sglang has no sglang.srt.layers.moe.mega_moe_sm90.run_sm90_mega_routed" in registration.signature_problem(
        registration.SIGNATURES_0_5_23)


def test_an_unsupported_sglang_is_refused_when_the_backend_is_selected(registered, monkeypatch, sm90_platform):
    from megamoe_plugin.sglang_plugin import refusals, registration
    from megamoe_plugin.sglang_plugin.refusals import IncompatibleSGLangError

    assert registration.version_problem("0.5.23") is None
    assert registration.version_problem("0.5.24") is None
    assert "written for sglang ==0.5.17 or >=0.5.23,<0.6, this is sglang 0.5.22" in registration.version_problem("0.5.22")
    assert registration.version_problem("0.5.17") is None and registration.version_problem("0.5.16") is not None
    assert registration.signatures_for("0.5.17") is registration.SIGNATURES_0_5_17
    assert registration.signatures_for("0.5.23.post1") is registration.SIGNATURES_0_5_23
    assert registration.version_problem("0.6.0") is not None

    reason = "sglang's x takes (a), the plugin was written for (b)"
    monkeypatch.setattr(refusals, "_incompatibility", reason)
    with pytest.raises(IncompatibleSGLangError) as info:
        _resolve_mega_moe(_parse("--moe-runner-backend", BACKEND))
    assert str(info.value).startswith(f"--moe-runner-backend {BACKEND} cannot run on this sglang: {reason}")
    assert "To fix: install an sglang the plugin supports" in str(info.value)
    # Other backends are unaffected.
    assert _resolve_mega_moe(_parse("--moe-runner-backend", "megamoe")).moe_a2a_backend == "megamoe"
