"""What runs a MoE layer call in a serving framework: the GPU kernel (default) or,
selected explicitly, the float32 reference; and the symmetric buffers the kernel runs on.
Shared by the vLLM and SGLang plugins (vllm_plugin/executor.py, sglang_plugin/layer.py add
what only their framework knows: the EP group, the token counts of the other ranks).

Executor selection
    MEGAMOE_EXECUTOR=kernel     (default) megamoe_plugin.fp8_mega_moe on an SM90 GPU.
    MEGAMOE_EXECUTOR=reference  megamoe_plugin.reference.mega_moe in float32, on whatever
                                device the activations are (CPU tests). One EP rank only.
    `set_executor("reference")` overrides the environment from Python (tests).
There is no fallback: the kernel path fails loudly where the kernel cannot run (and
model load refuses non-SM90 GPUs first), the reference is used only when asked for.

Symmetric buffers
    One `SymmBuffer` per (EP device group, device, shape), created on the first forward
    of the first layer of that shape (vLLM's profile run, SGLang's warm-up forward: before
    CUDA-graph capture, with every EP rank in the same forward), sized for the framework's
    token budget per rank, and shared by
    every layer of that shape: layers run one after another, so one buffer suffices.
    Allocation is collective over the EP group (torch symmetric memory rendezvous).

Warm-up
    Every layer registers its kernel-layout weights at load (`register_layer_weights`).
    Before the first kernel call on a buffer (the profile run, on every EP rank alike),
    `maybe_warmup` compiles and loads every kernel variant the batch sizes select and
    builds the kernel params of every registered layer of that buffer, then waits at a
    barrier over the EP group (`megamoe_plugin.ops.warmup`): no rank launches a collective
    call while another still compiles, and graph capture finds everything built.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .heuristics import Numerics

# The package's logger and this module's, below it; route_logs_to hands their records to a
# framework's logger.
PACKAGE_LOGGER = "megamoe_plugin"
logger = logging.getLogger(f"{PACKAGE_LOGGER}.serving")


class _ToFrameworkLogger(logging.Handler):
    """Hands each record to a framework's logger, whose level and handlers (its own, or its
    parents' where it propagates) then decide, as for the framework's own records."""

    def __init__(self, framework_logger: logging.Logger):
        super().__init__()
        self.framework_logger = framework_logger

    def emit(self, record: logging.LogRecord) -> None:
        if self.framework_logger.isEnabledFor(record.levelno):
            self.framework_logger.handle(record)


def route_logs_to(framework_logger: logging.Logger) -> None:
    """Send the package's records (the watchdog's kernel-failure lines, this module's progress)
    to the framework's logger instead of the root logger's handlers. vLLM's logging config
    gives its "vllm" logger the one handler and configures no root handler, so a line on the
    "megamoe_plugin" logger would miss the user's log. A handler on our own logger, not on
    the framework's: the framework may configure its logging again later (vLLM does per
    process), which leaves loggers outside its own tree alone. Idempotent: a second call
    replaces the first (one framework per process)."""
    package = logging.getLogger(PACKAGE_LOGGER)
    for handler in [h for h in package.handlers if isinstance(h, _ToFrameworkLogger)]:
        package.removeHandler(handler)
    package.addHandler(_ToFrameworkLogger(framework_logger))
    package.setLevel(logging.DEBUG)  # every record reaches the handler: the framework's level decides there
    package.propagate = False  # the framework logger propagates where the framework wants


EXECUTORS = ("kernel", "reference")
ENV_VAR = "MEGAMOE_EXECUTOR"

_override: Optional[str] = None


def set_executor(name: Optional[str]) -> Optional[str]:
    """Select the executor from Python ("kernel", "reference", or None to follow the
    environment); returns the previous override."""
    global _override
    if name is not None and name not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS} or None, got {name!r}")
    previous, _override = _override, name
    return previous


def get_executor() -> str:
    name = _override if _override is not None else os.environ.get(ENV_VAR, "kernel").strip().lower() or "kernel"
    if name not in EXECUTORS:
        raise ValueError(f"{ENV_VAR}={name!r} is not one of {EXECUTORS}")
    return name


# ------------------------------------------------------------------ EP group and buffers


class EPGroup:
    """The EP process group a layer's kernel runs over (None for one rank)."""

    def __init__(self, world_size: int, rank: int, device_group=None, key: object = None):
        self.world_size = world_size
        self.rank = rank
        self.device_group = device_group
        self.key = key if key is not None else ("single",)


_buffers: Dict[Tuple, object] = {}
# buffer_key -> {layer: (l1, l2)}, weakly keyed: a freed model's layers drop out.
_layer_weights: Dict[Tuple, "weakref.WeakKeyDictionary"] = {}
# (id(buffer), weight pointers) of every layer warmed up on a buffer.
_warmed: set = set()
_lock = threading.RLock()


def buffer_key(group: EPGroup, device: torch.device, shape: Tuple[int, ...]) -> Tuple:
    index = device.index if device.type == "cuda" and device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else None)
    return (group.key, device.type, index) + tuple(shape)


def get_buffer(group: EPGroup, device: torch.device, num_experts: int, max_tokens: int, topk: int, hidden: int,
               intermediate: int, num_shared_experts: int = 0):
    """The shared buffer for this (group, device, shape), allocating it (collectively) on first use.
    num_shared_experts: shared experts every call runs beside the routed ones (get_symm_buffer's)."""
    import megamoe_plugin as mm

    key = buffer_key(group, device, (num_experts, max_tokens, topk, hidden, intermediate, num_shared_experts))
    with _lock:
        buf = _buffers.get(key)
        if buf is not None:
            return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "megamoe_sm90: the symmetric buffer must be created before CUDA-graph capture (the framework's "
                "profile or warm-up forward does this); a layer's first forward ran inside capture")
        t0 = time.perf_counter()
        shape = dict(num_experts=num_experts, num_max_tokens_per_rank=max_tokens, num_topk=topk, hidden=hidden,
                     intermediate_size=intermediate, num_shared_experts=num_shared_experts)
        nbytes = mm.get_symm_buffer_size(group.world_size, **shape)
        buf = mm.get_symm_buffer(group.device_group if group.world_size > 1 else None, device=device, **shape)
        _buffers[key] = buf
        logger.info("megamoe_sm90: symmetric buffer for %d experts, top-%d%s, hidden %d, intermediate %d, up to %d "
                    "tokens/rank over %d EP rank(s): %.1f MiB per rank (%.2fs)", num_experts, topk,
                    f", {num_shared_experts} shared" if num_shared_experts else "", hidden, intermediate, max_tokens,
                    group.world_size, nbytes / 2**20, time.perf_counter() - t0)
        return buf


def clear_buffers() -> None:
    """Close and drop every cached buffer (tests; a new engine in the same process)."""
    with _lock:
        for buf in _buffers.values():
            buf.close()
        _buffers.clear()
        _warmed.clear()


def num_buffers() -> int:
    return len(_buffers)


# ------------------------------------------------------------------ warm-up


def warmup_token_counts(max_tokens: int, capture_sizes: Optional[Sequence[int]]) -> List[int]:
    """Token counts whose kernel variants to compile before graph capture: every CUDA-graph
    capture size, powers of two up to the maximum (eager batches) and the maximum."""
    counts = set(int(c) for c in (capture_sizes or ()) if 0 < int(c) <= max_tokens)
    p = 1
    while p < max_tokens:
        counts.add(p)
        p *= 2
    counts.add(max_tokens)
    return sorted(counts)


def register_layer_weights(key: Tuple, layer, l1, l2) -> None:
    """Record a layer's kernel-layout weights (at load) for the warm-up of the buffer with
    this buffer_key; registering the layer again replaces its weights and key (a layer whose
    weights were rebuilt, e.g. with its shared experts, keeps no reference to the old ones)."""
    with _lock:
        for layers in _layer_weights.values():
            layers.pop(layer, None)
        _layer_weights.setdefault(key, weakref.WeakKeyDictionary())[layer] = (tuple(l1), tuple(l2))


def _weights_key(l1, l2) -> Tuple[int, ...]:
    return (l1[0].data_ptr(), l1[1].data_ptr(), l2[0].data_ptr(), l2[1].data_ptr())


def maybe_warmup(buf, key: Tuple, l1, l2, token_counts: Iterable[int], numerics: Optional[Numerics] = None) -> None:
    """Before a layer's first kernel call on `buf` (buffer_key `key`): ops.warmup with every
    kernel variant these token counts select in `numerics` mode (one mode per process), for this layer's weights and those of every registered layer of the buffer not
    warmed up yet; it ends with the group barrier."""
    import megamoe_plugin.ops as ops

    if (id(buf), _weights_key(l1, l2)) in _warmed:
        return
    with _lock:
        layers = {_weights_key(l1, l2): (tuple(l1), tuple(l2))}
        for weights in list(_layer_weights.get(key, {}).values()):
            layers.setdefault(_weights_key(*weights), weights)
        pending = [weights for wkey, weights in layers.items() if (id(buf), wkey) not in _warmed]
        counts = list(token_counts)
        t0 = time.perf_counter()
        logger.info("megamoe_sm90: compiling the kernel variants for %d batch sizes (%d..%d tokens) and building "
                    "the kernel params of %d layer(s)", len(counts), counts[0], counts[-1], len(pending))
        n = ops.warmup(buf, l1, l2, counts, numerics=numerics, other_layers=pending[1:])
        _warmed.update((id(buf), wkey) for wkey in layers)
        logger.info("megamoe_sm90: %s kernel variant(s) ready in %.1fs", n, time.perf_counter() - t0)


# ------------------------------------------------------------------ the two executors


def run_kernel(output: torch.Tensor, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor, l1, l2, buf, activation_clamp: Optional[float],
               numerics: Optional[Numerics] = None, rank_equal_num_tokens: Callable[[int], int] = int,
               shared_scale: float = 1.0) -> None:
    """`rank_equal_num_tokens(n)`: a token count equal on every EP rank (the framework knows
    the other ranks' batch sizes), so that every rank picks the same kernel config.
    shared_scale: the routing weight of the buffer's shared experts (stage_inputs')."""
    import megamoe_plugin as mm

    n = mm.stage_inputs(buf, hidden_states, topk_ids, topk_weights, shared_scale=shared_scale)
    # Through the registered op, so that the framework's torch.compile keeps the layer in one graph.
    mm.custom_op.fp8_mega_moe(output[:n], l1, l2, buf, activation_clamp=activation_clamp, fast_math=True,
                              config_num_tokens=rank_equal_num_tokens(n), numerics=numerics)


def run_reference(output: torch.Tensor, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, l1, l2, buf, activation_clamp: Optional[float],
                  shared_scale: float = 1.0) -> None:
    """The same staging, then the float32 reference on the staged inputs, as the kernel sees
    them (its expert numbering, shared experts included). The kernel layout is inverted per
    call (no second copy of the weights is kept)."""
    import megamoe_plugin as mm

    n = mm.stage_inputs(buf, hidden_states, topk_ids, topk_weights, shared_scale=shared_scale)
    (w13, w13_scale), (w2, w2_scale) = mm.untransform_weights(tuple(l1), tuple(l2))
    ranks = [dict(x=buf.x[:n], x_sf=buf.x_sf[:n], topk_idx=buf.topk_idx[:n], topk_weights=buf.topk_weights[:n])]
    weights = [dict(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale)]
    (y,) = mm.reference.mega_moe(ranks, weights, buf.shape.num_experts, activation_clamp=activation_clamp)
    output[:n].copy_(y)


# ------------------------------------------------------------------ shared experts beside the kernel


class SharedExpertsAfterKernel:
    """Runs a layer's shared experts beside the kernel, launched after it: on a side stream that
    starts where the layer's stream stood before the kernel and that the layer's stream joins after
    the shared experts (for shared experts the kernel does not run in its call). Launched before the
    kernel (vLLM's auxiliary stream; SGLang's mega-MoE forward while it captures CUDA graphs), their
    GEMM blocks hold SMs that the persistent grid's CTAs must all have before its first grid barrier.
    Measured on an H100 (tools/aux_stream_stall.py, v3's routed shape with a shared expert of I 2048,
    FP8): the layer took 207 us at 1 token this way, 245 with the GEMMs before the kernel on one
    stream, 263 with them launched first on another; 480-552 us at 8-64 tokens, against 515-590 and
    528-600. One side stream and event pair per layer stream (dual-batch ubatches run on streams of
    their own), made on the first call, before any CUDA-graph capture. The shared experts' output is
    allocated on the side stream and read on the layer's after the join; the side stream reuses its
    memory only after its next fork, which follows that read."""

    def __init__(self):
        self._by_stream = {}

    def run(self, kernel: Callable[[], torch.Tensor], shared: Callable[[], Optional[torch.Tensor]],
            on_cuda: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """kernel() on the current stream, then shared() beside it; returns both their outputs, ready
        on the current stream. on_cuda=False (the layer's tensors on the CPU, as in the CPU tests):
        one after the other."""
        if not on_cuda:
            shared_out = shared()
            return kernel(), shared_out
        layer_stream = torch.cuda.current_stream()
        if layer_stream not in self._by_stream:
            self._by_stream[layer_stream] = (torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event())
        side, inputs_ready, shared_done = self._by_stream[layer_stream]
        inputs_ready.record(layer_stream)
        out = kernel()
        with torch.cuda.stream(side):
            side.wait_event(inputs_ready)
            shared_out = shared()
            shared_done.record(side)
        layer_stream.wait_event(shared_done)
        return out, shared_out
