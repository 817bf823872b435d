"""Everything megamoe_sm90 refuses, checked at model load (layer construction), each
with a message that says what to change.

The hardware facts (GPU capability, EP topology) come from a `HardwareProbe`; tests on
CPU machines install a fake one with `override_probe(...)` so every refusal can be
exercised without a GPU. The EP topology probe is collective over the EP group's CPU
group; it runs once per group (the first MoE layer) and every rank reaches the same
verdict, so a refusal never leaves some ranks waiting in a later collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Dict, List, Optional, Tuple

from .. import support
from ..heuristics import Numerics
from . import BACKEND

logger = logging.getLogger("vllm.megamoe_sm90")

HINTS = support.Hints(pick_other="pick another --moe-backend (e.g. leave it at 'auto')",
                      ep_size_flags="--data-parallel-size x --tensor-parallel-size",
                      ep_size_words="data-parallel x tensor-parallel ranks",
                      more_ranks_flag="--data-parallel-size")
PICK_OTHER = HINTS.pick_other
OTHER_BACKEND = HINTS.other_backend


class MegaMoEUnsupportedError(support.UnsupportedError):
    """A deployment megamoe_sm90 cannot run; the message names what to change."""

    def __init__(self, what: str, change: str):
        super().__init__(f"--moe-backend {BACKEND}", what, change)


# ------------------------------------------------------------------ hardware probe


@dataclasses.dataclass(frozen=True)
class EPTopology:
    """What the EP group looks like from every rank's point of view."""
    world_size: int
    same_node: Tuple[bool, ...]                 # rank r shares a node with rank 0
    devices: Tuple[str, ...]                    # a label per rank (e.g. "cuda:3 (NVIDIA H200)")
    no_peer_access: Tuple[Tuple[int, int], ...] = ()   # (rank a, rank b) pairs without P2P
    unverified: Tuple[Tuple[int, int], ...] = ()       # pairs whose access could not be checked


class HardwareProbe:
    """The real probe: torch.cuda for the local GPU, vLLM's EP group for the topology."""

    def device_capability(self) -> Optional[Tuple[int, int]]:
        import torch

        if not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))  # type: ignore[return-value]

    def device_name(self) -> str:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        return torch.cuda.get_device_name(torch.cuda.current_device())

    def ep_topology(self) -> EPTopology:
        import torch
        import torch.distributed as dist
        from vllm.distributed import get_ep_group
        from vllm.distributed.parallel_state import in_the_same_node_as

        ep = get_ep_group()
        world = ep.world_size
        if world == 1:
            label = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            return EPTopology(1, (True,), (label,))
        cpu_group = ep.cpu_group
        same_node = tuple(bool(x) for x in in_the_same_node_as(cpu_group, source_rank=0))

        local = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(local)
        me = dict(index=local, name=props.name, bus=_pci_bus_id(props, local))
        infos: List[Dict] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(infos, me, group=cpu_group)

        # This rank's row of the peer-access matrix, over devices visible here.
        visible = {_pci_bus_id(torch.cuda.get_device_properties(i), i): i for i in range(torch.cuda.device_count())}
        rank = ep.rank_in_group
        row_missing, row_unverified = [], []
        for peer, info in enumerate(infos):
            if peer == rank or not same_node[peer] or not same_node[rank]:
                continue
            peer_index = visible.get(info["bus"])
            if peer_index is None:
                row_unverified.append((rank, peer))
            elif peer_index != local and not torch.cuda.can_device_access_peer(local, peer_index):
                row_missing.append((rank, peer))
        rows: List[Tuple[List, List]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(rows, (row_missing, row_unverified), group=cpu_group)
        missing = tuple(sorted({tuple(p) for r in rows for p in r[0]}))
        unverified = tuple(sorted({tuple(p) for r in rows for p in r[1]}))
        labels = tuple(f"cuda:{i['index']} ({i['name']}, bus {i['bus']})" for i in infos)
        return EPTopology(world, same_node, labels, missing, unverified)


def _pci_bus_id(props, index: int) -> str:
    """A process-independent id of a GPU (device indices depend on CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    if getattr(props, "pci_bus_id", None) is not None:
        return f"{getattr(props, 'pci_domain_id', 0)}:{props.pci_bus_id}:{getattr(props, 'pci_device_id', 0)}"
    return f"index{index}"


_probe: HardwareProbe = HardwareProbe()
_topology_cache: Dict[object, EPTopology] = {}


def get_probe() -> HardwareProbe:
    return _probe


def set_probe(probe: HardwareProbe) -> HardwareProbe:
    """Install a probe (tests); returns the previous one. Clears the topology cache."""
    global _probe
    previous, _probe = _probe, probe
    _topology_cache.clear()
    return previous


@contextlib.contextmanager
def override_probe(probe: HardwareProbe):
    previous = set_probe(probe)
    try:
        yield probe
    finally:
        set_probe(previous)


def _cached_topology(key: object) -> EPTopology:
    topo = _topology_cache.get(key)
    if topo is None:
        topo = _probe.ep_topology()
        _topology_cache[key] = topo
    return topo


# ------------------------------------------------------------------ the checks


def check_quantization(quant_config) -> None:
    """128x128 block FP8 with dynamic activation quantization, serialized in the checkpoint."""
    support.check_quantization(quant_config, MegaMoEUnsupportedError, HINTS)


def check_fp4_experts(moe_quant_algo: str) -> None:
    """FP4 routed experts (DeepSeek-V4): MXFP4 only, which the plugin re-encodes as FP8 blocks."""
    if moe_quant_algo and moe_quant_algo.upper() != "MXFP4":
        raise MegaMoEUnsupportedError(
            f"the checkpoint's routed experts are {moe_quant_algo} (quantization_config.moe_quant_algo), the "
            "kernel takes FP8 blocks, and MXFP4 experts re-encoded as FP8 blocks",
            f"serve a checkpoint with MXFP4 or FP8 routed experts {OTHER_BACKEND}")


def check_layer_skipped(prefix: str) -> None:
    raise MegaMoEUnsupportedError(
        f"MoE layer {prefix!r} is excluded from FP8 quantization by the checkpoint (ignored_layers / "
        "modules_to_not_convert), the kernel needs FP8 experts in every MoE layer",
        f"use a checkpoint whose MoE experts are all FP8 {OTHER_BACKEND}")


def _activation_name(activation) -> str:
    return str(getattr(activation, "value", activation))


def check_layer(moe_config, layer, *, executor: str) -> None:
    """Activation, dtypes, shapes, parallel layout, LoRA: everything the layer itself decides."""
    import torch

    act = moe_config.activation
    if _activation_name(act).lower() != "silu" or not getattr(moe_config, "is_act_and_mul", True):
        raise MegaMoEUnsupportedError(
            f"the model's MoE activation is {_activation_name(act)!r}, the kernel computes SiLU-gated "
            "experts only (silu(gate) * up)",
            f"serve a SwiGLU MoE model (DeepSeek-V3, Qwen3-MoE, Kimi-K2, GLM-4.5, ...) {OTHER_BACKEND}")
    if getattr(moe_config, "swiglu_alpha", None) is not None or getattr(moe_config, "swiglu_beta", None) is not None:
        raise MegaMoEUnsupportedError(
            "the model's SwiGLU has custom alpha/beta, the kernel computes plain silu(gate) * up (with an optional "
            "clamp)", PICK_OTHER)
    if getattr(moe_config, "has_bias", False):
        raise MegaMoEUnsupportedError("the model's experts have biases, the kernel has none",
                                      PICK_OTHER)
    if getattr(layer, "apply_router_weight_on_input", False):
        raise MegaMoEUnsupportedError(
            "the model applies router weights to the MoE input, the kernel applies them after SwiGLU",
            PICK_OTHER)
    in_dtype = getattr(moe_config, "in_dtype", torch.bfloat16)
    if in_dtype != torch.bfloat16:
        raise MegaMoEUnsupportedError(
            f"activations are {in_dtype}, the kernel reads and writes bfloat16", "pass --dtype bfloat16")
    if getattr(moe_config, "is_lora_enabled", False):
        raise MegaMoEUnsupportedError(
            "LoRA adapters on MoE layers are not supported by the fused kernel",
            f"remove --enable-lora {OTHER_BACKEND}")

    par = moe_config.moe_parallel_config
    if not par.use_ep and par.tp_size > 1:
        raise MegaMoEUnsupportedError(
            f"the MoE layer is tensor-parallel ({par.tp_size} ranks each hold a slice of every expert), the kernel "
            "needs expert parallelism (each rank holds whole experts)",
            "add --enable-expert-parallel (best with --data-parallel-size N, see docs/vllm.md)")
    if getattr(par, "pcp_size", 1) > 1:
        raise MegaMoEUnsupportedError("prefill context parallelism is not supported",
                                      "remove --prefill-context-parallel-size")
    strategy = getattr(getattr(layer, "expert_map_manager", None), "placement_strategy", "linear")
    if strategy not in (None, "linear"):
        raise MegaMoEUnsupportedError(
            f"expert placement {strategy!r}: the kernel owns experts contiguously (rank r holds experts "
            "[r*E/R, (r+1)*E/R))", "pass --expert-placement-strategy linear")

    num_ranks = par.ep_size if par.use_ep else 1
    num_experts = moe_config.num_experts
    hidden = moe_config.hidden_dim
    inter = moe_config.intermediate_size_per_partition
    topk = moe_config.experts_per_token
    support.check_shapes(num_ranks, num_experts, hidden, inter, topk, MegaMoEUnsupportedError, HINTS)

    if executor == "reference" and num_ranks != 1:
        raise MegaMoEUnsupportedError(
            f"MEGAMOE_EXECUTOR=reference runs the float32 reference on one rank, the EP group has {num_ranks}",
            "unset MEGAMOE_EXECUTOR (the reference is a test aid) or run on one rank")

    if par.use_ep and getattr(par, "dp_size", 1) == 1 and num_ranks > 1:
        warn_once(
            "--moe-backend %s with tensor parallelism only: all %d EP ranks feed the same tokens, so every token "
            "is dispatched %d times. Results are right, but the backend pays off with --data-parallel-size N "
            "--enable-expert-parallel (each rank has its own tokens); see docs/vllm.md.",
            BACKEND, num_ranks, num_ranks)


_logged = set()


def warn_once(message: str, *args) -> None:
    """A warning logged once per process (not once per MoE layer)."""
    _log_once(logging.WARNING, message, args)


def info_once(message: str, *args) -> None:
    """An info line logged once per process (not once per MoE layer)."""
    _log_once(logging.INFO, message, args)


def _log_once(level: int, message: str, args: tuple) -> None:
    key = (level, message, args)
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message, *args)


def check_vllm_features(vllm_config) -> None:
    """Deployment features the kernel cannot coexist with."""
    if vllm_config is None:
        return
    par = getattr(vllm_config, "parallel_config", None)
    if par is not None and getattr(par, "enable_dbo", False):
        raise MegaMoEUnsupportedError(
            "dual batch overlap runs two micro-batches that would share one symmetric buffer",
            "remove --enable-dbo")


# The FusedMoEMethodBase attribute vLLM (0.24..0.33) reads a method's own modular kernel from.
KERNEL_ATTRIBUTE = "moe_kernel"


def check_kernel_attribute(method, *, built: bool) -> None:
    """vLLM's MoE runner skips its naive DP dispatch (an all-gather of every DP rank's tokens
    before the experts, a reduce-scatter of their outputs after) when the method's
    `supports_internal_mk` is true, and skips the all-reduce of the output when
    `moe_kernel.output_is_reduced()`; both read `method.moe_kernel`. A vLLM that keeps the
    kernel under another name would do both around the kernel's already combined output:
    every token R times through the kernel, the output summed over R ranks, silently.
    Before the kernel is built (`built=False`): vLLM's base class must have created the
    attribute; after: vLLM must see it."""
    if not built:
        seen = KERNEL_ATTRIBUTE in vars(method)
    else:
        seen = getattr(method, "supports_internal_mk", True) is True  # vLLM without the gate: no naive dispatch
    if not seen:
        from .compat import vllm_version

        raise MegaMoEUnsupportedError(
            f"vLLM {vllm_version()} does not take a MoE method's modular kernel from `{KERNEL_ATTRIBUTE}`, so it "
            "would all-gather every data-parallel rank's tokens into the kernel and sum its already combined "
            "output over the EP ranks", f"use vLLM 0.24 to 0.33 (docs/vllm.md) {OTHER_BACKEND}")


def check_device() -> None:
    """The GPU kernel needs SM90 (Hopper)."""
    capability = _probe.device_capability()
    name = _probe.device_name() if capability is not None else "no CUDA device"
    support.check_device(capability, name, MegaMoEUnsupportedError, HINTS)


# (shape, EP size, max tokens, numerics, GPU) -> the variants of those calls (every MoE layer
# of a model asks for the same ones).
_layer_variants: Dict[Tuple, list] = {}


def check_kernels_loadable(hidden: int, intermediate_size: int, num_experts: int, num_topk: int, ep_size: int,
                           max_tokens: int, numerics: Optional[Numerics], num_shared_experts: int = 0,
                           weights: str = "fp8") -> None:
    """Where nothing can compile (no nvcc: a serving container with the driver only), every
    kernel variant a step of this layer can select (any batch of 0..max_tokens tokens per
    rank, with its shared experts in the call) must be in the cache, or the first forward would
    fail: refused here, naming the --build command that pre-builds them."""
    from .. import jit
    from ..jit.command import build_command
    from ..variants import deployment_variants
    from ..model_config import MoEShape
    from ..ops import resolve_numerics

    if jit.find_toolchain()[0] is not None:
        return
    mode, gpu = resolve_numerics(numerics), _probe.device_name()
    shape = MoEShape(hidden, intermediate_size, num_experts, num_topk, num_shared_experts=num_shared_experts)
    key = (shape, ep_size, max_tokens, mode, gpu, weights)
    if key not in _layer_variants:
        _layer_variants[key] = deployment_variants(shape, ep_size, range(max_tokens + 1), gpu, (mode,),
                                                   weights=weights)
    missing, why = jit.missing_variants(_layer_variants[key])
    if missing:
        command = build_command(hidden, intermediate_size, num_experts, num_topk, ep_size, range(max_tokens + 1), gpu,
                                num_shared_experts=num_shared_experts, weights=weights)
        raise MegaMoEUnsupportedError(
            f"{len(missing)} of the {len(_layer_variants[key])} kernel variants this layer can run are not in the "
            f"cache {jit.cache_dir()} (MEGAMOE_CACHE_DIR): {', '.join(v.name() for v in missing)}; none can be "
            f"compiled here ({why.removeprefix('megamoe: ')})",
            "pre-build them on a machine with the CUDA toolkit and megamoe_plugin[cutlass], then copy that folder "
            f"here as MEGAMOE_CACHE_DIR (or install the toolkit here): {command}")


def check_ep_topology(group_key: object) -> EPTopology:
    """EP ranks must share one node and have peer access to each other's GPUs."""
    topo = _cached_topology(group_key)
    if topo.world_size > 1:
        if not all(topo.same_node):
            nodes = sorted({i for i, same in enumerate(topo.same_node) if not same})
            raise MegaMoEUnsupportedError(
                f"the EP group of {topo.world_size} ranks spans more than one node (ranks {nodes} are not on rank "
                "0's node); the kernel moves tokens over NVLink inside one node",
                "keep the EP group (data-parallel x tensor-parallel ranks) on one node, e.g. "
                "--data-parallel-size 8 --enable-expert-parallel on one 8-GPU node")
        if topo.no_peer_access:
            pairs = ", ".join(f"{topo.devices[a]} <-> {topo.devices[b]}" for a, b in topo.no_peer_access[:4])
            raise MegaMoEUnsupportedError(
                f"GPUs of the EP group have no peer access to each other ({pairs})",
                "run on GPUs connected by NVLink with P2P enabled (check `nvidia-smi topo -m`) "
                + OTHER_BACKEND)
        if topo.unverified:
            logger.warning("megamoe_sm90: could not verify peer access between EP ranks %s (their GPUs are not "
                           "visible to each other's processes); the symmetric-memory rendezvous will fail if it "
                           "is missing", list(topo.unverified))
    return topo
