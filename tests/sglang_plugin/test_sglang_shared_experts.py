"""A MoE block's shared experts on SGLang's mega-MoE forward (`mega_moe.forward_mega_moe`, wrapped by
the plugin on every supported sglang): the routed call is launched first and the shared experts
after it (serving.SharedExpertsAfterKernel, whose stream protocol tests/vllm_plugin/test_vllm_layer.py
checks), the block's output is routed + shared; without the backend selected, or for a block whose
shared experts SGLang hands to the call (its SM100 path), SGLang's own forward runs."""
import pytest
import torch


class Block:
    """The MoE block attributes the forward reads, recording what runs in which order."""

    def __init__(self, log, shared_output, mega_shared_l1_weights=None):
        self.log, self.shared_output = log, shared_output
        self.experts = type("Experts", (), {})()  # whose call runs no shared experts
        self.mega_shared_l1_weights = mega_shared_l1_weights

    def _forward_shared_experts(self, hidden_states):
        self.log.append(("shared", hidden_states.shape[0]))
        return self.shared_output


@pytest.fixture
def routed(registered, monkeypatch):
    """SGLang's routed call replaced by a recorder returning fixed rows; the backend selected."""
    import sglang.srt.layers.moe.mega_moe as mega_moe

    from megamoe_plugin.sglang_plugin import layer

    log = []

    def run_mega_routed(moe, hidden_states, forward_batch, input_ids_global, num_tokens):
        log.append(("routed", num_tokens, forward_batch, input_ids_global))
        return torch.full((num_tokens, 4), 2.0)

    monkeypatch.setattr(mega_moe, "_run_mega_routed", run_mega_routed)
    monkeypatch.setattr(layer, "selected", lambda: True)
    return mega_moe, log


@pytest.mark.parametrize("with_shared", [True, False])
def test_the_block_returns_routed_plus_shared(routed, with_shared):
    mega_moe, log = routed
    x = torch.zeros(3, 4)
    block = Block(log, torch.full((3, 4), 0.5) if with_shared else None)
    y = mega_moe.forward_mega_moe(block, x, "batch", input_ids_global="ids")
    assert torch.equal(y, torch.full((3, 4), 2.5 if with_shared else 2.0))
    # on the CPU one after the other; each exactly once, with the forward's arguments
    assert sorted(log, key=str) == sorted([("shared", 3), ("routed", 3, "batch", "ids")], key=str)


def test_the_kernel_is_launched_before_the_shared_experts(routed, monkeypatch):
    """On CUDA tensors the plugin's order: routed first, shared experts after it (the stream
    stand-ins of SharedExpertsAfterKernel record no CUDA work here)."""
    from megamoe_plugin.sglang_plugin import layer

    mega_moe, log = routed
    order = []

    def run(kernel, shared, on_cuda):
        order.append(on_cuda)
        out = kernel()
        return out, shared()

    monkeypatch.setattr(layer._shared_after_kernel, "run", run)
    y = mega_moe.forward_mega_moe(Block(log, torch.ones(2, 4)), torch.zeros(2, 4))
    assert [entry[0] for entry in log] == ["routed", "shared"] and torch.equal(y, torch.full((2, 4), 3.0))
    assert order == [False]  # CPU tensors: the runner is told so


def test_sglangs_forward_runs_when_not_selected_or_the_call_takes_the_shared_experts(routed, monkeypatch):
    from megamoe_plugin.sglang_plugin import layer

    _, log = routed
    calls = []

    def sglang_forward(*args):
        calls.append(args)
        return "sglang's"

    # SGLang's SM100 path: a block with shared weights for the call keeps SGLang's forward.
    assert layer.forward_mega_moe(sglang_forward, Block(log, None, mega_shared_l1_weights=("w",)),
                                  torch.zeros(1, 4)) == "sglang's"
    monkeypatch.setattr(layer, "selected", lambda: False)
    assert layer.forward_mega_moe(sglang_forward, Block(log, None), torch.zeros(1, 4), "batch", "ids") == "sglang's"
    assert len(calls) == 2 and calls[1][2:] == ("batch", "ids") and log == []
