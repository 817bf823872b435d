"""Recording stand-ins for the kernel's op and warm-up, for the framework layer tests that run
the glue's "kernel" executor on a CPU (tests/vllm_plugin, tests/sglang_plugin): the op computes
the float32 reference from the staged buffer and the weights it is handed, so the glue's
staging, weights and buffer are what a test checks; the warm-up only records its arguments."""
import megamoe_plugin as mm
import megamoe_plugin.ops as ops


def record_kernel_calls(monkeypatch) -> dict:
    """Installs both stand-ins; returns {"op": [per call: n, l1, l2, buf, clamp, config,
    numerics], "warmup": [per call: (buf, counts, numerics, [l1, l2], [[l1, l2] of the other
    layers])]}."""
    calls = {"op": [], "warmup": []}

    def fake_op(y, l1, l2, buf, activation_clamp=None, fast_math=True, cumulative_local_expert_recv_stats=None,
                config_num_tokens=None, numerics=None):
        n = y.shape[0]
        calls["op"].append(dict(n=n, l1=l1, l2=l2, buf=buf, clamp=activation_clamp, config=config_num_tokens,
                                numerics=numerics))
        if n:
            (w13, s13), (w2, s2) = mm.untransform_weights(tuple(l1), tuple(l2))
            ranks = [dict(x=buf.x[:n], x_sf=buf.x_sf[:n], topk_idx=buf.topk_idx[:n],
                          topk_weights=buf.topk_weights[:n])]
            (ref,) = mm.reference.mega_moe(ranks, [dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)],
                                           buf.num_experts, activation_clamp=activation_clamp)
            y.copy_(ref)
        return y

    def fake_warmup(buf, l1, l2, counts, fast_math=True, numerics=None, other_layers=()):
        calls["warmup"].append((buf, list(counts), numerics, [tuple(l1), tuple(l2)], [list(w) for w in other_layers]))
        return 1

    # The glue calls torch.ops.megamoe.fp8_mega_moe, whose eager implementation calls ops.fp8_mega_moe.
    monkeypatch.setattr(ops, "fp8_mega_moe", fake_op)
    monkeypatch.setattr(ops, "warmup", fake_warmup)
    return calls
