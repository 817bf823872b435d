"""Op layer: picks a call's kernel variant, builds once what its calls need, launches it. The
checks before a launch are validation's; what kernels report back, reports'.

Everything that does not change between calls (the compiled kernel, TMA descriptors
over the buffer and the weights, the launch configuration) is built by `warmup` (or the
first eager call) for a (buffer, weights, variant) and cached, so a call is argument
checks plus one launch on the current stream: no host sync, no allocation, capturable in
a CUDA graph. A call inside graph capture that would still have to build something
raises instead (compiling or allocating there would break the capture or stall it).

What kernels report without anyone waiting for them (a timed-out wait, dropped routing
entries) reaches the log through `reports.watchdog`, started with the first kernel load.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from . import native, reports, validation
from .buffer import SymmBuffer
from .heuristics import DEFAULT_NUMERICS, Numerics, check_weights_numerics
from .jit import (KernelMissingError, compile_variant, compile_variants, missing_variants,
                  variants_to_compile)
from .kernel_variant import KERNEL_NAME, NUM_THREADS, WINDOW_KERNEL_NAME, KernelVariant
from .jit.command import build_command
from .progress import progress_bar
from . import settings, timeline
from .variants import variant_for
from .weights import weight_format
# The op layer's public surface beside its own functions (README: mm.ops.synchronize()).
from .reports import synchronize  # noqa: F401
from .validation import resolve_numerics  # noqa: F401

WeightPair = Tuple[torch.Tensor, torch.Tensor]


def select_variant(buf: SymmBuffer, num_tokens: int, fast_math: bool, numerics: Numerics = DEFAULT_NUMERICS,
                   weights: str = "fp8") -> KernelVariant:
    """The kernel variant a call with `num_tokens` (per rank) runs on expert weights of format
    `weights` (weights.weight_format): the shipped table, else the heuristic; MEGAMOE_BLOCK_M and
    MEGAMOE_NUM_STAGES force the tier and the depth. Memoized, as it runs on every call; the
    environment variables it reads are part of the key."""
    device_name, grid_size = _device_name(buf.device), _grid_size(buf)
    forced_block_m, forced_num_stages = settings.forced_block_m(), settings.forced_num_stages()
    key = (buf.shape, device_name, grid_size, num_tokens, fast_math, numerics, forced_block_m, forced_num_stages,
           settings.configs_dir(), weights)
    variant = _variants.get(key)
    if variant is None:
        variant = _variants[key] = variant_for(buf.shape, device_name, grid_size, num_tokens, fast_math, numerics,
                                               forced_block_m, forced_num_stages, weights)
    return variant


# (buffer shape, device name, grid size, tokens, fast_math, numerics, MEGAMOE_BLOCK_M, MEGAMOE_NUM_STAGES,
#  MEGAMOE_CONFIGS_DIR, weight format) -> variant.
_variants: Dict[Tuple, KernelVariant] = {}


_device_names: Dict[int, str] = {}
_device_sms: Dict[int, int] = {}


def _device_name(device: torch.device) -> str:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _device_names:
        _device_names[idx] = torch.cuda.get_device_name(idx)
    return _device_names[idx]


def _timeline_shape(buf: SymmBuffer) -> Tuple[int, ...]:
    return (_grid_size(buf), len(timeline.SLOTS), timeline.RECORDS, timeline.WORDS)


def timeline_for(buf: SymmBuffer) -> torch.Tensor:
    """A zeroed `_timeline` for calls on `buf` (megamoe_plugin.timeline; debugging)."""
    return torch.zeros(_timeline_shape(buf), dtype=torch.int64, device=buf.device)


def _grid_size(buf: SymmBuffer) -> int:
    """CTAs of the persistent grid: the buffer's share of SMs if it has one, else every SM
    unless MEGAMOE_NUM_SMS reserves some. All CTAs must be resident at once (grid
    barriers), so leave SMs to concurrent kernels here."""
    if buf.num_sms is not None:
        return buf.num_sms
    device = buf.device
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _device_sms:
        total = torch.cuda.get_device_properties(idx).multi_processor_count
        forced = settings.num_sms()
        _device_sms[idx] = total if forced is None else min(total, forced)
    return _device_sms[idx]


# (device index, variant) -> kernel handle (loaded modules live as long as the process).
_kernels: Dict[Tuple[int, KernelVariant], int] = {}


@dataclasses.dataclass
class _BufferLaunches:
    """What the op layer keeps for one buffer, freed with it (SymmBuffer.on_close: device memory
    included, and before a later buffer can get the same id)."""
    # (rank, peer pointers, shape, weight pointers, block_m) -> kernel params handle.
    params: Dict[Tuple, int] = dataclasses.field(default_factory=dict)
    # Weight pointers -> the layer's ordinal, in the order the buffer met them (warmup's layers, then
    # calls): the layer part of a call's tag (reports.call_tag), equal on every rank that meets its
    # layers in the same order.
    layer_ordinals: Dict[Tuple[int, int, int, int], int] = dataclasses.field(default_factory=dict)
    # (kernel, params) of the latest launch: what a refused call launches (_refuse_call).
    latest_launch: Optional[Tuple[int, int]] = None


# id(buffer) -> its _BufferLaunches.
_launches: Dict[int, _BufferLaunches] = {}
# Kernel params a buffer may hold (one per layer and tier; a 94-layer model with every tier needs
# 470): past it, weights are being re-allocated between calls, which would grow device memory
# without bound (weight reloading, as RL does, is not supported on a buffer).
MAX_PARAMS_PER_BUFFER = 4096


def _refuse_in_capture(what: str) -> None:
    """Raises if the current stream is capturing a CUDA graph: `what` (a compile, a module load,
    a device allocation) cannot be captured, and would stall or break the capture."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"megamoe: fp8_mega_moe would {what} inside CUDA-graph capture; call "
                           "megamoe_plugin.ops.warmup(buf, l1, l2, token_counts, other_layers=...) with every "
                           "layer's weights and every batch size the graphs use before capturing")


def _kernel_handle(device: torch.device, variant: KernelVariant) -> int:
    key = (device.index, variant)
    handle = _kernels.get(key)
    if handle is None:
        _refuse_in_capture(f"compile and load kernel {variant.name()}")
        compiled = compile_variant(variant, verbose=True)
        with torch.cuda.device(device):
            handle = native.runtime().load_kernel(str(compiled.cubin), KERNEL_NAME, compiled.smem_bytes,
                                                  WINDOW_KERNEL_NAME if variant.windowed else "")
        _kernels[key] = handle
        reports.name_kernel(handle, variant.name())
        reports.watchdog.start()  # before the first launch of any kernel
    return handle


def _launches_of(buf: SymmBuffer) -> _BufferLaunches:
    launches = _launches.get(id(buf))
    if launches is None:
        launches = _launches[id(buf)] = _BufferLaunches()
        buf.on_close(functools.partial(_forget_buffer, id(buf)))
    return launches


def _params_handle(buf: SymmBuffer, l1: WeightPair, l2: WeightPair, block_m: int) -> int:
    key = (buf.rank, buf.peer_ptrs, buf.shape, l1[0].data_ptr(), l1[1].data_ptr(), l2[0].data_ptr(),
           l2[1].data_ptr(), block_m)
    launches = _launches.get(id(buf))
    handle = None if launches is None else launches.params.get(key)
    if handle is None:
        _refuse_in_capture("build kernel parameters (TMA descriptors in device memory) for these weights")
        params = _launches_of(buf).params
        if len(params) >= MAX_PARAMS_PER_BUFFER:
            raise RuntimeError(f"megamoe: the buffer already holds kernel params for {MAX_PARAMS_PER_BUFFER} (layer, "
                               "tier) pairs; new weight tensors keep coming (weights re-allocated between calls?). "
                               "Reloading weights on a buffer is not supported: make a new buffer after a reload")
        s = buf.shape
        with torch.cuda.device(buf.device):
            handle = native.runtime().make_params(
                list(buf.peer_ptrs), buf.rank, buf.layout.offsets(), s.pool_capacity, s.hidden, s.intermediate_size,
                s.num_local_experts, block_m, l1[0].data_ptr(), l1[1].data_ptr(), l2[0].data_ptr(),
                l2[1].data_ptr(), settings.timeout_s(), weight_format(l1[0]) == "mxfp4")
        params[key] = handle
    return handle


def _forget_buffer(buffer_id: int) -> None:
    for handle in _launches.pop(buffer_id, _BufferLaunches()).params.values():
        native.runtime().free_params(handle)


def _layer_ordinal(buf: SymmBuffer, l1: WeightPair, l2: WeightPair) -> int:
    """The layer's ordinal on this buffer (_BufferLaunches.layer_ordinals)."""
    ordinals = _launches_of(buf).layer_ordinals
    return ordinals.setdefault((l1[0].data_ptr(), l1[1].data_ptr(), l2[0].data_ptr(), l2[1].data_ptr()),
                               len(ordinals))


def warmup(buf: SymmBuffer, l1: WeightPair, l2: WeightPair, num_tokens_list: Iterable[int],
           fast_math: bool = True, numerics: Optional[Numerics] = None,
           other_layers: Iterable[Tuple[WeightPair, WeightPair]] = ()) -> int:
    """Compiles (several at once) and loads every kernel variant the given token counts
    select, and builds their params for the weights (l1, l2) and every (l1, l2) pair of
    `other_layers` (the further layers that share this buffer). Call it before CUDA-graph
    capture: a capture that would compile, load or build params raises.

    On every rank of the buffer's group, before the first call: it ends with an agreement over
    the group (_agree_on_warmup), which holds every rank until all arrive, so a rank that had to
    compile (a cold cache) holds the others here, not inside a kernel whose wait would time out;
    and where a rank's warm-up failed (a compile error, a bad cubin, a missing variant), every
    rank raises at once, the others naming that rank, instead of waiting for it until the process
    group's timeout. Returns how many distinct variants it loaded.

    Where nvcc is missing, every variant must be in the cache (a folder pre-built with
    `python -m megamoe_plugin.jit --build`, as MEGAMOE_CACHE_DIR): else it raises
    jit.KernelMissingError, which names the missing variants and the command that builds them."""
    try:
        loaded = _load_for_calls(buf, l1, l2, num_tokens_list, fast_math, numerics, other_layers)
    except BaseException:
        if isinstance(buf, SymmBuffer) and buf.group is not None:
            _agree_on_warmup(buf, failed=True)
        raise
    if buf.group is not None:
        _agree_on_warmup(buf, failed=False)
    return loaded


def load_kernels(variants: Iterable[KernelVariant], device: Optional[torch.device] = None) -> None:
    """Compiles those of `variants` the kernel cache lacks (several at once, where this process can
    compile) and loads every one into `device` (default: the current one), as warmup does for the
    variants its calls select; a variant that cannot be had raises (jit.KernelMissingError)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    torch.empty(0, device=device)  # the device's CUDA context, which a process that allocated nothing yet lacks
    variants = list(dict.fromkeys(variants))
    missing = [v for v in variants if (device.index, v) not in _kernels]
    # The bar says which it is: a start-up from a warm cache only loads (a "compiling" bar there
    # read as an nvcc run in the logs).
    action = "compiling" if variants_to_compile(missing) else "loading"
    progress = progress_bar(len(variants), f"megamoe: {action} kernels", "variant")
    for compiled in compile_variants(missing, on_done=lambda v, result: progress.update()):
        if isinstance(compiled, RuntimeError):
            raise compiled
    progress.update(len(variants) - len(missing))
    progress.close()
    for v in variants:  # cached cubins now: loading them is quick
        _kernel_handle(device, v)


def _load_for_calls(buf: SymmBuffer, l1: WeightPair, l2: WeightPair, num_tokens_list: Iterable[int],
                    fast_math: bool, numerics: Optional[Numerics], other_layers: Iterable[Tuple[WeightPair, WeightPair]]
                    ) -> int:
    """warmup's work on this rank: compile, load, build params; the number of variants."""
    validation.require_sm90(buf.device)
    numerics = validation.resolve_numerics(numerics)
    num_tokens_list = [int(n) for n in num_tokens_list]
    weights = weight_format(l1[0]) if l1 is not None else "fp8"
    variants = []
    for n in num_tokens_list:
        v = select_variant(buf, n, fast_math, numerics, weights)
        if v not in variants:
            variants.append(v)
    _raise_if_not_buildable(buf, [v for v in variants if (buf.device.index, v) not in _kernels], num_tokens_list,
                            numerics, fast_math, weights)
    load_kernels(variants, buf.device)
    for layer_l1, layer_l2 in [(l1, l2), *other_layers]:
        for block_m in dict.fromkeys(v.block_m for v in variants):
            _params_handle(buf, tuple(layer_l1), tuple(layer_l2), block_m)
        _layer_ordinal(buf, tuple(layer_l1), tuple(layer_l2))
    return len(variants)


def _agree_on_warmup(buf: SymmBuffer, failed: bool) -> None:
    """Every rank of the buffer's group learns which ranks' warm-up failed: an all-reduce of one
    flag per rank, read on the host, so it also holds each rank until all have arrived (what the
    barrier after the warm-up is for). A rank whose own warm-up went right raises a RuntimeError
    naming the failed ranks (its first call would wait for them until the timeout); a failed rank
    returns, to raise its own error."""
    import torch.distributed as dist

    group = buf.group
    on_device = dist.get_backend(group) == "nccl"  # NCCL reduces device memory only
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=buf.device if on_device else "cpu")
    flags[dist.get_rank(group)] = int(failed)
    dist.all_reduce(flags, group=group)
    failed_ranks = flags.nonzero().flatten().tolist()
    if failed_ranks and not failed:
        raise RuntimeError(f"megamoe: the warm-up failed on rank{'s' if len(failed_ranks) > 1 else ''} "
                           f"{', '.join(map(str, failed_ranks))} of the buffer's group (that rank's error says why); "
                           "every rank stops here, since their calls would wait for it until the timeout")


def _raise_if_not_buildable(buf: SymmBuffer, variants, num_tokens_list: List[int], numerics: Numerics,
                            fast_math: bool, weights: str) -> None:
    """KernelMissingError, before anything is compiled, naming every variant that is neither
    in the cache nor compilable here (no nvcc) and the --build command for these calls."""
    unbuildable, why = missing_variants(variants)
    if unbuildable:
        s = buf.shape
        raise KernelMissingError(unbuildable, why, build_command(
            s.hidden, s.intermediate_size, s.num_routed_experts, s.num_routed_topk, s.num_ranks, num_tokens_list,
            _device_name(buf.device), (numerics,), fast_math, num_shared_experts=s.num_shared_experts,
            weights=weights))


def fp8_mega_moe(y: torch.Tensor, l1: WeightPair, l2: WeightPair, buf: SymmBuffer,
                 activation_clamp: Optional[float] = None, fast_math: bool = True,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 config_num_tokens: Optional[int] = None, numerics: Optional[Numerics] = None,
                 _stop_after_phase: int = 0, _timeline: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fused MoE of docs/design.md section 2 for this rank's first y.shape[0] tokens,
    whose inputs the caller wrote into buf.x / x_sf / topk_idx / topk_weights (stage_inputs does, and
    records how many: a y with more rows than that is refused, SymmBuffer.mark_staged).
    Every rank of the buffer's group calls it each step (also with 0 tokens), with the same
    layers in the same order, in the same numerics mode and fast_math: the ranks compare each
    call's identity (the layer's ordinal on the buffer, numerics, fast_math) at the kernel's
    cross-rank barrier, and calls that differ stop every rank with an error naming both ranks
    (the CUDA context is lost) instead of pairing different layers. Writes y.
    topk_idx values must lie in [-1, E) (-1: empty slot); the kernel drops and counts any
    other value, the watchdog logs it, and this function (after launching its call, so the call
    has taken part) or synchronize() raises ValueError for it. Invalid arguments raise
    ValueError or TypeError; in a group the call still takes part as a refused call, which
    stops every rank at once naming this one (docs/design.md section 3).

    `config_num_tokens` is the token count the kernel variant is chosen by (default
    y.shape[0]); pass a value equal on every rank (vLLM: the DP-padded batch size).
    `numerics` is "fast" (L1 on FP8 tensor cores) or "exact" (L1 on FP16 tensor cores,
    float32-faithful and batch-invariant), docs/design.md section 2; None reads MEGAMOE_NUMERICS
    (default "fast"). Every rank must pass the same mode.
    `_stop_after_phase` is for phase-by-phase kernel debugging (csrc/megamoe/kernel.cuh
    numbers the phases); the next call zeroes what a stopped call left counting.
    `_timeline` (ops.timeline_for(buf); megamoe_plugin.timeline reads it) is for finding where a GEMM tile's time
    goes: the call runs its variant built with per-tile clock records, which it writes there."""
    try:
        validation.validate_call(y, l1, l2, buf, activation_clamp, fast_math, cumulative_local_expert_recv_stats,
                                 config_num_tokens, buf.take_staged_tokens() if isinstance(buf, SymmBuffer) else None)
        numerics = validation.resolve_numerics(numerics)
        weights = weight_format(l1[0])
        check_weights_numerics(weights, numerics)  # every rank refuses at once (_refuse_call)
        if _timeline is not None:
            validation.check_tensor(_timeline, "_timeline (ops.timeline_for)", torch.int64, _timeline_shape(buf),
                                    buf.device)
    except (TypeError, ValueError):
        _refuse_call(buf)
        raise
    validation.require_sm90(buf.device)
    num_tokens = y.shape[0]
    variant = select_variant(buf, num_tokens if config_num_tokens is None else config_num_tokens, fast_math,
                             numerics, weights)
    if _timeline is not None:
        variant = dataclasses.replace(variant, timeline=True)
    kernel = _kernel_handle(buf.device, variant)
    params = _params_handle(buf, tuple(l1), tuple(l2), variant.block_m)
    tag = reports.call_tag(_layer_ordinal(buf, tuple(l1), tuple(l2)), numerics, fast_math)
    if torch.cuda.is_current_stream_capturing():
        buf.mark_captured()
    buf.order_after_last_use()
    stats = cumulative_local_expert_recv_stats
    _launch(buf, kernel, params, tag, y.data_ptr(), num_tokens, 0 if stats is None else stats.data_ptr(),
            math.inf if activation_clamp is None else float(activation_clamp), _stop_after_phase,
            0 if _timeline is None else _timeline.data_ptr(),
            buf.shape.window_kernel_launches(variant.block_m) if variant.windowed else 0)
    _launches_of(buf).latest_launch = (kernel, params)
    # After the launch: the call has taken part, so no rank skips a call its peers make.
    reports.raise_input_errors()
    return y


def _launch(buf: SymmBuffer, kernel: int, params: int, tag: int, y_ptr: int, num_tokens: int, stats_ptr: int,
            activation_clamp: float, stop_after_phase: int, timeline_ptr: int, window_launches: int) -> None:
    try:
        native.runtime().launch(kernel, params, y_ptr, num_tokens, stats_ptr, activation_clamp, _grid_size(buf),
                                NUM_THREADS, torch.cuda.current_stream(buf.device).cuda_stream, tag, stop_after_phase,
                                timeline_ptr, window_launches)
    except RuntimeError as exc:  # the runtime refuses to launch after a kernel failed: say which wait
        reason = reports.kernel_error()
        if reason is not None:
            raise RuntimeError(reason) from exc
        raise


def _refuse_call(buf) -> None:
    """A call this rank refuses (invalid arguments) still takes part in a group's cross-rank
    barrier, with the refused bit in its tag: every rank then stops at once with an error that names
    this rank (the kernel's call check), instead of waiting for it until the timeout, or pairing this
    rank's next call with the peers' current one for the rest of the run. It launches the buffer's
    latest kernel and params with no tokens; where the buffer has launched nothing yet, or inside
    graph capture, it launches nothing and the peers' timeout names this rank."""
    launches = _launches.get(id(buf)) if isinstance(buf, SymmBuffer) else None
    if (launches is None or launches.latest_launch is None or buf.closed or buf.shape.num_ranks == 1
            or torch.cuda.is_current_stream_capturing()):
        return
    kernel, params = launches.latest_launch
    try:
        _launch(buf, kernel, params, reports.call_tag(0, "fast", False, refused=True), 0, 0, 0, math.inf, 0, 0, 0)
    except RuntimeError:
        pass  # an earlier kernel failed: the group has stopped already; the caller's error is the one to raise
