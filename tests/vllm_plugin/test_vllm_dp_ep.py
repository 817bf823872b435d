"""megamoe_sm90 inside real vLLM with two ranks (two processes, gloo on the CPU):
`--data-parallel-size 2 --enable-expert-parallel` and `--tensor-parallel-size 2
--enable-expert-parallel`.

Each rank (dp_ep_worker.py) builds vLLM's groups and a MoE layer, loads the whole
checkpoint through vLLM's weight loader and runs the layer forward through vLLM's MoE
runner; the kernel op is a stand-in that computes this rank's rows of the float32
multi-rank reference from every rank's staged inputs and experts, as the kernel's own
dispatch and combine would. These tests check, for the deployment the kernel exists for:
- vLLM runs no naive DP dispatch (all-gather of the DP ranks' tokens) and no all-reduce
  around the layer, and each rank gets exactly its own tokens' MoE output (not R times it);
- the buffer's rank is the EP rank whose experts vLLM loaded;
- the kernel variant is chosen by a token count equal on all ranks (the DP-padded one);
- TP-only expert parallelism logs its warning, DP + EP does not;
- a DeepSeek-family layer's shared experts (S = 1, 2) run in each rank's kernel call: each
  rank's buffer and kernel weights hold its S shared experts after its routed ones, vLLM's
  runner has none left to run, and each rank gets routed * routed_scaling_factor + shared
  for its own tokens (a torch oracle from the checkpoints).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from conftest import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOPK, _free_port  # noqa: E402
from dp_ep_worker import CHECKPOINT_SEED, DP_TOKENS, TP_TOKENS  # noqa: E402
from test_vllm_layer import _assert_close, make_checkpoint, torch_moe  # noqa: E402
from test_vllm_shared_experts import ROUTED_SCALING_FACTOR, torch_shared  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dp_ep_worker.py")
TIMEOUT_S = 300


def _run_ranks(mode, out_dir):
    """Both ranks of MODE, started together; their results."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    outs = [out_dir / f"{mode}{rank}.pt" for rank in range(2)]
    logs = [out_dir / f"{mode}{rank}.log" for rank in range(2)]
    procs = []
    for rank in range(2):
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, str(rank), str(port), str(outs[rank])],
                                          stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, code in enumerate(codes):
        assert code == 0, f"{mode} rank {rank} exited {code}:\n" + logs[rank].read_text()[-6000:]
    return [torch.load(out, weights_only=False) for out in outs]


@pytest.fixture(scope="module")
def dp_ranks(tmp_path_factory):
    return _run_ranks("dp", tmp_path_factory.mktemp("dp_ep"))


@pytest.fixture(scope="module")
def tp_ranks(tmp_path_factory):
    return _run_ranks("tp", tmp_path_factory.mktemp("tp_ep"))


@pytest.fixture(scope="module", params=[1, 2], ids=["S1", "S2"])
def dp_shared_ranks(request, tmp_path_factory):
    """(S, both ranks' results) of DP + EP with a layer of S shared experts."""
    mode = f"dp_shared{request.param}"
    return request.param, _run_ranks(mode, tmp_path_factory.mktemp(mode))


@pytest.fixture(scope="module")
def checkpoint():
    return make_checkpoint(seed=CHECKPOINT_SEED)[0]


# ----------------------------------------------------------------------------- DP + EP


def test_dp_ep_layout(dp_ranks):
    for rank, out in enumerate(dp_ranks):
        assert (out["moe_dp_size"], out["moe_ep_size"], out["moe_tp_size"]) == (2, 2, 1)
    from megamoe_plugin.vllm_plugin.registration import passthrough_all2all_supported

    if passthrough_all2all_supported():  # vLLM 0.33: no all2all manager is built for the layer
        assert {out["all2all_backend"] for out in dp_ranks} == {"passthrough"}


@pytest.mark.parametrize("case", ["eager", "padded"])
def test_dp_ep_each_rank_gets_its_own_tokens_moe(dp_ranks, checkpoint, case):
    """Every rank's output is its own tokens through all experts (half of them on the
    other rank) exactly once: no reduction over ranks added on top of the kernel's combine."""
    for rank, out in enumerate(dp_ranks):
        run = out[case]
        assert run["y"].shape[0] == run["x"].shape[0] == (DP_TOKENS[rank] if case == "eager" else max(DP_TOKENS))
        _assert_close(run["y"], torch_moe(run["x"], run["logits"], checkpoint, TOPK))


@pytest.mark.parametrize("case", ["eager", "padded"])
def test_dp_ep_no_naive_dispatch_no_all_reduce(dp_ranks, case):
    for out in dp_ranks:
        assert out[case]["collectives"] == [], out[case]["collectives"]


def test_dp_ep_control_unseen_kernel_is_dispatched_naively(dp_ranks):
    """The spies see vLLM's naive dispatch when vLLM does not see the method's kernel
    (what a renamed attribute would mean; the plugin refuses that, test_vllm_refusals.py)."""
    for out in dp_ranks:
        names = [name for name, _ in out["unseen_kernel"]["collectives"]]
        assert names[:2] == ["dispatch_router_logits", "all_gatherv"], names


def test_buffer_rank_is_the_ep_rank_that_loaded_the_experts(dp_ranks):
    for rank, out in enumerate(dp_ranks):
        assert out["ep_rank"] == out["moe_ep_rank"] == rank
        # vLLM's loader kept global experts [4r, 4r + 4): the kernel's placement for rank r.
        assert out["held_experts"] == list(range(4 * rank, 4 * rank + 4))
        assert out["buffer_ranks"] == [rank]  # one buffer, allocated over ...
        assert out["buffer_group_is_ep"] == [True]  # ... vLLM's EP device group
        assert {op["buffer_rank"] for case in ("eager", "padded") for op in out[case]["ops"]} == {rank}


def test_variant_from_dp_padded_token_count_equal_on_all_ranks(dp_ranks):
    eager = [out["eager"]["ops"][0] for out in dp_ranks]
    assert [op["n"] for op in eager] == list(DP_TOKENS)
    # The local counts would pick different kernel variants on the two ranks ...
    assert eager[0]["local_variant"] != eager[1]["local_variant"]
    # ... the plugin passes the max over DP ranks (what DP padding pads to) on both.
    assert [op["config_num_tokens"] for op in eager] == [max(DP_TOKENS)] * 2
    assert eager[0]["variant"] == eager[1]["variant"]

    padded = [out["padded"] for out in dp_ranks]
    assert [run["across"] for run in padded] == [[max(DP_TOKENS)] * 2] * 2  # vLLM's DP padding (CUDA graphs)
    assert [run["ops"][0]["config_num_tokens"] for run in padded] == [max(DP_TOKENS)] * 2
    assert padded[0]["ops"][0]["variant"] == padded[1]["ops"][0]["variant"] == eager[0]["variant"]


def test_dp_ep_logs_no_tp_only_warning(dp_ranks):
    for out in dp_ranks:
        assert not any("tensor parallelism only" in w for w in out["warnings"]), out["warnings"]


# ----------------------------------------------------------------------------- DP + EP, shared experts


def test_dp_ep_shared_experts_are_in_each_ranks_kernel(dp_shared_ranks):
    """Each rank's kernel runs S shared experts after its E / R routed ones (kernel numbering), with
    routing weight 1 / routed_scaling_factor; vLLM's runner is left with none to run."""
    num_shared, ranks = dp_shared_ranks
    local = NUM_EXPERTS // 2
    for rank, out in enumerate(ranks):
        assert out["held_experts"] == list(range(local * rank, local * rank + local))
        assert out["num_shared_experts"] == num_shared
        assert out["shared_scale"] == pytest.approx(1 / ROUTED_SCALING_FACTOR)
        # one buffer: the layer's routed experts, the kernel's (2 ranks x (E/R + S)), S shared
        assert out["buffer_experts"] == [(NUM_EXPERTS, 2 * (local + num_shared), num_shared)]
        assert out["buffer_ranks"] == [rank] and out["buffer_group_is_ep"] == [True]
        # The kernel's weights (w13, its scales, w2, its scales): E/R + S experts; the parameters
        # (EPLB's view) are its routed ones, same storage. The op was handed them.
        assert out["kernel_weight_experts"] == [local + num_shared] * 4
        assert out["param_experts"] == [local] * 4 and all(out["params_are_kernel_weights"])
        for case in ("eager", "padded"):
            assert [op["weight_experts"] for op in out[case]["ops"]] == [[local + num_shared] * 4]
        assert not out["runner_has_shared_experts"]
        assert out["mlp_numel"] == 0  # the kernel's copy is the only one
        assert not any("run beside the kernel" in w for w in out["warnings"]), out["warnings"]
    # Both ranks loaded the one shared MLP of S * I (the oracle's checkpoint).
    (q0, s0), (q1, s1) = (out["shared_ckpt"]["down_proj"] for out in ranks)
    assert q0.shape == (HIDDEN, num_shared * INTERMEDIATE)
    assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)


@pytest.mark.parametrize("case", ["eager", "padded"])
def test_dp_ep_shared_experts_each_rank_gets_routed_times_scale_plus_shared(dp_shared_ranks, checkpoint, case):
    """Every rank's output is its own tokens through all routed experts (half of them on the other
    rank), times routed_scaling_factor, plus its tokens through the shared MLP, exactly once."""
    num_shared, ranks = dp_shared_ranks
    for rank, out in enumerate(ranks):
        run = out[case]
        assert run["y"].shape[0] == run["x"].shape[0] == (DP_TOKENS[rank] if case == "eager" else max(DP_TOKENS))
        assert run["collectives"] == [], run["collectives"]
        routed = ROUTED_SCALING_FACTOR * torch_moe(run["x"], run["logits"], checkpoint, TOPK).float()
        _assert_close(run["y"], (routed + torch_shared(run["x"], out["shared_ckpt"])).to(torch.bfloat16))
        # and it is the shared experts that make the difference
        assert not torch.allclose(run["y"].float(), routed, rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------- TP-only EP


def test_tp_only_ep_warns(tp_ranks):
    for out in tp_ranks:
        assert (out["moe_dp_size"], out["moe_ep_size"], out["moe_tp_size"]) == (1, 2, 1)
        warning = [w for w in out["warnings"] if "tensor parallelism only" in w]
        assert len(warning) == 1 and "dispatched 2 times" in warning[0] and "--data-parallel-size" in warning[0]


def test_tp_only_ep_output_is_not_all_reduced(tp_ranks, checkpoint):
    """Both TP ranks run the same batch; each gets it through all experts once (an
    all-reduce over the TP group on top would double it)."""
    for rank, out in enumerate(tp_ranks):
        run = out["eager"]
        assert run["collectives"] == [], run["collectives"]
        assert run["x"].shape[0] == TP_TOKENS and out["buffer_ranks"] == [rank]
        _assert_close(run["y"], torch_moe(run["x"], run["logits"], checkpoint, TOPK))
    assert torch.equal(tp_ranks[0]["eager"]["y"], tp_ranks[1]["eager"]["y"])
