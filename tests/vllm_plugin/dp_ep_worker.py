"""One rank of a two-process vLLM deployment on the CPU (gloo), for test_vllm_dp_ep.py.

    python dp_ep_worker.py MODE RANK PORT OUT

MODE "dp": `--data-parallel-size 2 --enable-expert-parallel`, this process is DP rank RANK.
MODE "tp": `--tensor-parallel-size 2 --enable-expert-parallel` (no DP), TP rank RANK.
MODE "dp_shared1", "dp_shared2": "dp" with a DeepSeek-family layer of S = 1, 2 shared experts
(vLLM's DeepseekV2MLP of intermediate S * I, as test_vllm_shared_experts.py builds it), which
the plugin folds into the kernel's call at load.

The rank builds vLLM's distributed groups, a megamoe_sm90 MoE layer through vLLM's
factory, loads the whole fixture checkpoint through vLLM's weight loader (which keeps
this rank's experts) and runs the layer's forward as vLLM's runner does. The GPU pieces
are replaced by stand-ins that keep their cross-rank contract:
- the symmetric buffer is a CPU SymmBuffer of get_symm_buffer's shape (shared experts
  included) whose rank is the rank of the process group the plugin passes (as torch's
  rendezvous would have it);
- the kernel op gathers every rank's staged inputs and experts over the buffer's group
  and writes this rank's rows of the float32 multi-rank reference (megamoe_plugin.reference),
  i.e. what the kernel's dispatch and combine compute, in the kernel's expert numbering
  (each rank's shared experts after its routed ones), and records the token count it
  was told to choose its variant by.
vLLM's collectives (GroupCoordinator methods) are recorded while the layer runs. The
parent test gets everything in OUT (torch.save) and asserts there.
"""
import dataclasses
import io
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import conftest  # noqa: E402  (vLLM's CPU platform, the fixture model, build_moe)
from test_vllm_layer import _inputs, load_checkpoint, make_checkpoint  # noqa: E402
from test_vllm_refusals import FakeProbe, _Records  # noqa: E402
from test_vllm_shared_experts import ROUTED_SCALING_FACTOR, _shared_mlp, use_triton_block_fp8_linears  # noqa: E402

# Token counts per rank: different variants if each rank chose by its own count.
DP_TOKENS = (3, 40)
TP_TOKENS = 9
CHECKPOINT_SEED = 21
# The shared-expert MLP's checkpoint: seed SHARED_SEED + S.
SHARED_SEED = 60
# MODE: (vLLM's parallelism, the layer's shared experts S)
MODES = {"dp": ("dp", 0), "tp": ("tp", 0), "dp_shared1": ("dp", 1), "dp_shared2": ("dp", 2)}
COLLECTIVES = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv",
               "dispatch_router_logits", "dispatch", "combine")


class Recorder:
    """vLLM's group collectives called while `active`, and what the stand-in op saw."""

    def __init__(self):
        self.active = False
        self.collectives = []
        self.ops = []
        self.buffers = []

    def spy_on_collectives(self):
        from vllm.distributed.parallel_state import GroupCoordinator

        for name in COLLECTIVES:
            original = getattr(GroupCoordinator, name, None)
            if original is None:
                continue

            def spy(group, *args, _original=original, _name=name, **kwargs):
                if self.active:
                    self.collectives.append((_name, group.unique_name))
                return _original(group, *args, **kwargs)

            setattr(GroupCoordinator, name, spy)


def _to_bytes(obj) -> bytes:
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


def install_stand_ins(rec):
    import megamoe_plugin as mm
    import megamoe_plugin.ops as ops
    import megamoe_plugin.variants as variants
    from megamoe_plugin.buffer import BufferShape, SymmBuffer, get_symm_buffer_size
    from megamoe_plugin.vllm_plugin import executor, refusals

    def cpu_symm_buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_size,
                        device=None, pool_rows=None, num_shared_experts=0):  # get_symm_buffer's arguments
        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        routed = (num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_size, pool_rows,
                  num_shared_experts)
        storage = torch.zeros(get_symm_buffer_size(num_ranks, *routed), dtype=torch.uint8)
        shape = BufferShape.of_routed(num_ranks, *routed)
        buf = SymmBuffer(shape, storage, rank, (storage.data_ptr(),) * num_ranks, group=group)
        rec.buffers.append(buf)
        return buf

    def multi_rank_reference_op(y, l1, l2, buf, activation_clamp=None, fast_math=True,
                                cumulative_local_expert_recv_stats=None, config_num_tokens=None, numerics=None):
        n = y.shape[0]
        (w13, s13), (w2, s2) = mm.untransform_weights(tuple(l1), tuple(l2))
        # Plain tensors: a parameter's attributes (its weight loader) would drag the layer along.
        mine = [{name: t.detach().clone() for name, t in d.items()} for d in (
            dict(x=buf.x[:n], x_sf=buf.x_sf[:n], topk_idx=buf.topk_idx[:n], topk_weights=buf.topk_weights[:n]),
            dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2))]
        every = [None] * buf.num_ranks
        dist.all_gather_object(every, _to_bytes(mine), group=buf.group)  # pickle alone garbles fp8 storages
        every = [torch.load(io.BytesIO(b)) for b in every]
        # The kernel's experts: the routed ones (buf.num_experts) and every rank's shared ones.
        ys = mm.reference.mega_moe([r[0] for r in every], [r[1] for r in every], buf.shape.num_experts,
                                   activation_clamp=activation_clamp)
        y.copy_(ys[buf.rank])

        def variant(num_tokens):  # the one an H200 would run
            return dataclasses.asdict(variants.variant_for(buf.shape, "NVIDIA H200", 132, num_tokens, True, "fast"))

        rec.ops.append(dict(n=n, config_num_tokens=config_num_tokens, buffer_rank=buf.rank,
                            variant=variant(config_num_tokens), local_variant=variant(n),
                            weight_experts=[w13.shape[0], s13.shape[0], w2.shape[0], s2.shape[0]]))
        return y

    mm.get_symm_buffer = cpu_symm_buffer
    ops.fp8_mega_moe = multi_rank_reference_op
    ops.warmup = lambda buf, l1, l2, counts, fast_math=True, numerics=None, other_layers=(): 1
    executor.set_executor("kernel")
    refusals.set_probe(FakeProbe(topology=refusals.EPTopology(2, (True, True), ("cpu rank 0", "cpu rank 1"))))


def init_vllm_groups(cfg, rank, port, tp):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    method = f"tcp://127.0.0.1:{port}"
    # torch's world first: vLLM then only builds its groups over it (its DP path would pick a port itself).
    dist.init_process_group("gloo", init_method=method, world_size=2, rank=rank)
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=2, rank=rank, distributed_init_method=method, local_rank=rank,
                                     backend="gloo")
        initialize_model_parallel(tp, 1)
    try:  # vLLM 0.24's modular kernel takes its scratch from the worker's workspace manager
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(torch.device("cpu"))
    except ImportError:
        pass


def forward(rec, cfg, runner, x, logits, num_tokens_across_dp=None):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(cfg), set_forward_context(None, cfg, num_tokens=x.shape[0],
                                                           num_tokens_across_dp=num_tokens_across_dp):
        rec.active = True
        try:
            return runner.forward(x, logits)
        finally:
            rec.active = False


def run_dp(rec, cfg, runner, rank, out):
    from vllm.v1.worker.dp_utils import coordinate_batch_across_dp

    n = DP_TOKENS[rank]
    x, logits = _inputs(n, seed=100 + rank)
    # Eager: vLLM's forward context all-reduces the DP ranks' counts, no padding.
    out["eager"] = dict(x=x, logits=logits, y=forward(rec, cfg, runner, x, logits),
                        ops=rec.ops[-1:], collectives=list(rec.collectives))
    rec.collectives.clear()

    # CUDA-graph style: the model runner pads every DP rank to the max before the forward.
    _, across, _ = coordinate_batch_across_dp(num_tokens_unpadded=n, allow_microbatching=False,
                                              parallel_config=cfg.parallel_config, cudagraph_mode=2)
    padded = int(across[rank])
    xp = torch.cat([x, torch.zeros(padded - n, x.shape[1], dtype=x.dtype)])
    lp = torch.cat([logits, torch.zeros(padded - n, logits.shape[1])])
    out["padded"] = dict(x=xp, logits=lp, across=across.tolist(), y=forward(rec, cfg, runner, xp, lp, across),
                         ops=rec.ops[-1:], collectives=list(rec.collectives))
    rec.collectives.clear()

    # Control: a vLLM that does not see the method's kernel (what a renamed attribute means)
    # dispatches naively, and the spies see it. (vLLM's CPU communicator has no all_gatherv,
    # so that dispatch stops there on this machine.)
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    supports = FusedMoEMethodBase.supports_internal_mk
    FusedMoEMethodBase.supports_internal_mk = property(lambda self: False)
    try:
        forward(rec, cfg, runner, x, logits)
        error = None
    except NotImplementedError as exc:
        error = repr(exc)
    finally:
        FusedMoEMethodBase.supports_internal_mk = supports
    out["unseen_kernel"] = dict(collectives=list(rec.collectives), error=error)
    rec.collectives.clear()


def run_tp(rec, cfg, runner, out):
    x, logits = _inputs(TP_TOKENS, seed=200)  # TP ranks see the same batch
    out["eager"] = dict(x=x, logits=logits, y=forward(rec, cfg, runner, x, logits), ops=rec.ops[-1:],
                        collectives=list(rec.collectives))


def build_layer(cfg, num_shared):
    """The MoE layer through vLLM's factory with the whole fixture checkpoint loaded (vLLM's loader
    keeps this rank's experts), not processed yet; with num_shared > 0, a DeepSeek shared-expert MLP of
    num_shared * I (test_vllm_shared_experts.py), loaded and processed as the model loader does (shared
    experts before the routed ones). Returns (runner, routed checkpoint, MLP or None, its checkpoint or None)."""
    mlp, shared_ckpt, kwargs = None, None, {}
    if num_shared:
        use_triton_block_fp8_linears(pytest.MonkeyPatch())  # for the rest of this process
        mlp, shared_ckpt = _shared_mlp(cfg, num_shared, seed=SHARED_SEED + num_shared)
        kwargs = dict(shared_experts=mlp, routed_scaling_factor=ROUTED_SCALING_FACTOR,
                      apply_routed_scale_to_output=True)
    runner = conftest.build_moe(cfg, prefix="model.layers.0.mlp.experts", **kwargs)
    experts, named = make_checkpoint(seed=CHECKPOINT_SEED)
    load_checkpoint(runner, experts, named)
    return runner, experts, mlp, shared_ckpt


def kernel_weights(runner, mlp, shared_ckpt):
    """What the kernel got at load: the runtime's shared experts and weights, against the layer's
    parameters and what is left of vLLM's shared experts."""
    ex = runner.routed_experts
    rt = ex.quant_method.runtime
    params = (ex.w13_weight, ex.w13_weight_scale_inv, ex.w2_weight, ex.w2_weight_scale_inv)
    return dict(num_shared_experts=rt.num_shared_experts, shared_scale=rt.shared_scale,
                kernel_weight_experts=[t.shape[0] for t in (*rt.l1, *rt.l2)],
                param_experts=[p.shape[0] for p in params],
                params_are_kernel_weights=[p.data_ptr() == t.data_ptr() for p, t in zip(params, (*rt.l1, *rt.l2))],
                runner_has_shared_experts=runner.shared_experts is not None,
                mlp_numel=None if mlp is None else sum(p.numel() for p in mlp.parameters()),
                shared_ckpt=shared_ckpt)


def main(mode, rank, port, out_path):
    from megamoe_plugin.vllm_plugin import register

    parallel, num_shared = MODES[mode]
    register()
    if parallel == "dp":
        cfg = conftest.make_vllm_config(data_parallel_size=2, data_parallel_rank=rank)
    else:
        cfg = conftest.make_vllm_config(tensor_parallel_size=2)
    init_vllm_groups(cfg, rank, port, tp=1 if parallel == "dp" else 2)
    rec = Recorder()
    install_stand_ins(rec)
    rec.spy_on_collectives()

    from vllm.distributed import get_ep_group

    # Only now: building vLLM's config reconfigures logging, which drops the handlers of vllm.* loggers.
    with _Records() as warnings:
        runner, experts, mlp, shared_ckpt = build_layer(cfg, num_shared)
        ex = runner.routed_experts
        # The experts this rank holds, by their checkpoint bytes (before the kernel layout).
        held = [next(e for e, entry in enumerate(experts)
                     if torch.equal(ex.w2_weight.data[local].view(torch.uint8),
                                    entry["down_proj"][0].view(torch.uint8)))
                for local in range(ex.w2_weight.shape[0])]
        ex.quant_method.process_weights_after_loading(ex)

    ep = get_ep_group()
    par = ex.moe_config.moe_parallel_config
    out = dict(mode=mode, rank=rank, held_experts=held, ep_rank=ep.rank_in_group, moe_ep_rank=par.ep_rank,
               moe_ep_size=par.ep_size, moe_dp_size=par.dp_size, moe_tp_size=par.tp_size,
               all2all_backend=cfg.parallel_config.all2all_backend, **kernel_weights(runner, mlp, shared_ckpt))
    if parallel == "dp":
        run_dp(rec, cfg, runner, rank, out)
    else:
        run_tp(rec, cfg, runner, out)
    out["buffer_ranks"] = [b.rank for b in rec.buffers]
    out["buffer_group_is_ep"] = [b.group is ep.device_group for b in rec.buffers]
    # the buffer's experts: routed (the layer's), the kernel's (shared ones included) and shared
    out["buffer_experts"] = [(b.num_experts, b.shape.num_experts, b.num_shared_experts) for b in rec.buffers]
    out["warnings"] = list(warnings)
    torch.save(out, out_path)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
