"""The float32 reference of the MegaMoE operation (docs/design.md section 2) and the
accuracy check every kernel test uses.

`mega_moe` runs all R ranks of an expert-parallel layer in one process. It is the
definition the kernel is measured against, so it follows the contract step by step
rather than the kernel's schedule: dequantize, L1 GEMM, optional clamp, SwiGLU times
the routing weight, per-G requant, L2 GEMM, bf16 rounding, and a float32 combine over
slots in ascending k. It is vectorized by expert (all (token, slot) rows routed to an
expert, from every rank, go through one matmul per GEMM, and each expert's weights are
dequantized once) so it also serves as the oracle for large GPU test shapes: a
4096-token, 32-expert, H=4096 layer takes about 12 s on a 2-core CPU, and 8192 tokens of
the v3 shape (H=7168, I=2048, K=8, 32 experts) about 0.12 s on one H200.

On CUDA the matmuls accumulate in float64 and round to float32: that is at least as
accurate as a float32 GEMM and, unlike one, cannot be silently degraded to TF32 by the
process's global precision flags (vLLM and user code set them; toggling them here would
clash with torch's legacy/new flag APIs). On CPU float32 GEMMs are full precision unless
a caller explicitly asked for lower, and twice as fast as float64.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .fp8 import FP8_DTYPE, dequantize_per_token_group, requant_tie_deltas, requantize_groups
from .weights import dequantize_weight, validate_checkpoint_weights, weight_format

INPUT_GROUP = 128
SUPPORTED_REQUANT_GROUPS = (64, 128)
_RANK_KEYS = ("x", "x_sf", "topk_idx", "topk_weights")
_WEIGHT_KEYS = ("w13", "w13_scale", "w2", "w2_scale")


def _matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 a @ b.T for float32 a [M, K] and b [N, K] (see the module docstring)."""
    if a.is_cuda:
        return (a.double() @ b.double().T).float()
    return a @ b.T


def _require_keys(entry, keys: Sequence[str], name: str) -> None:
    if not isinstance(entry, Mapping):
        raise TypeError(f"{name} must be a dict with keys {list(keys)}, got {type(entry).__name__}")
    missing = [key for key in keys if key not in entry]
    if missing:
        raise ValueError(f"{name} is missing keys {missing} (expected {list(keys)})")


def _require_tensor(tensor, name: str, dtype: torch.dtype, shape: Tuple[int, ...], layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {tuple(tensor.shape)}")


def _validate(ranks, weights, num_experts, activation_clamp, requant_group) -> Tuple[int, int, int]:
    """Check every argument; return (hidden, intermediate, topk)."""
    if not isinstance(ranks, Sequence) or len(ranks) == 0:
        raise ValueError("ranks must be a non-empty list with one input dict per rank")
    if not isinstance(weights, Sequence) or len(weights) != len(ranks):
        raise ValueError(f"weights must be a list with one weight dict per rank ({len(ranks)}), "
                         f"got {len(weights) if isinstance(weights, Sequence) else type(weights).__name__}")
    num_ranks = len(ranks)
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks {num_ranks}")
    if activation_clamp is not None and not (
            isinstance(activation_clamp, numbers.Real) and not isinstance(activation_clamp, bool)
            and math.isfinite(activation_clamp) and activation_clamp > 0):
        raise ValueError(f"activation_clamp must be None or a positive finite number, got {activation_clamp!r}")
    if requant_group not in SUPPORTED_REQUANT_GROUPS:
        raise ValueError(f"requant_group must be one of {SUPPORTED_REQUANT_GROUPS}, got {requant_group!r}")

    for r, inputs in enumerate(ranks):
        _require_keys(inputs, _RANK_KEYS, f"ranks[{r}]")
    num_local_experts = num_experts // num_ranks
    shapes = set()
    for r, w in enumerate(weights):
        _require_keys(w, _WEIGHT_KEYS, f"weights[{r}]")
        local, hidden, intermediate = validate_checkpoint_weights(*(w[key] for key in _WEIGHT_KEYS),
                                                                  where=f"weights[{r}]")
        if local != num_local_experts:
            raise ValueError(f"weights[{r}]['w13'].shape[0]={local} must be num_experts / num_ranks = "
                             f"{num_experts} / {num_ranks} = {num_local_experts}")
        shapes.add((hidden, intermediate))
    if len(shapes) != 1:
        raise ValueError(f"weights of all ranks must have the same (H, I), got {sorted(shapes)}")
    formats = [weight_format(w["w13"]) for w in weights]
    if len(set(formats)) != 1:
        raise ValueError(f"weights of all ranks must have one format, got {formats} by rank")
    # I % 128 == 0 (checked above) makes every supported requant_group divide I.
    hidden, intermediate = shapes.pop()

    device = weights[0]["w13"].device
    for where, entries, keys in (("ranks", ranks, _RANK_KEYS), ("weights", weights, _WEIGHT_KEYS)):
        for r, entry in enumerate(entries):
            for key in keys:
                if isinstance(entry[key], torch.Tensor) and entry[key].device != device:
                    raise ValueError(f"{where}[{r}][{key!r}] is on {entry[key].device} but weights[0]['w13'] is on "
                                     f"{device}; all inputs and weights must be on one device")

    topk = None
    for r, inputs in enumerate(ranks):
        x = inputs["x"]
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"ranks[{r}]['x'] must be a 2-D tensor [T, H]")
        num_tokens = x.shape[0]
        _require_tensor(x, f"ranks[{r}]['x']", FP8_DTYPE, (num_tokens, hidden), "[T, H]")
        _require_tensor(inputs["x_sf"], f"ranks[{r}]['x_sf']", torch.float32,
                        (num_tokens, hidden // INPUT_GROUP), "[T, H/128]")
        topk_idx = inputs["topk_idx"]
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
            raise ValueError(f"ranks[{r}]['topk_idx'] must be a 2-D tensor [T, K] with T={num_tokens}")
        if topk is None:
            topk = topk_idx.shape[1]
            if topk < 1:
                raise ValueError(f"ranks[{r}]['topk_idx'] must have K >= 1 columns, got {topk}")
        _require_tensor(topk_idx, f"ranks[{r}]['topk_idx']", torch.int64, (num_tokens, topk),
                        "[T, K] (K equal on all ranks)")
        _require_tensor(inputs["topk_weights"], f"ranks[{r}]['topk_weights']", torch.float32,
                        (num_tokens, topk), "[T, K]")
        if num_tokens > 0 and not bool(((topk_idx >= -1) & (topk_idx < num_experts)).all()):
            raise ValueError(f"ranks[{r}]['topk_idx'] values must lie in [-1, num_experts={num_experts}), "
                             f"got min {int(topk_idx.min())} max {int(topk_idx.max())}")
    return hidden, intermediate, topk


def _after_l1(l1_out: torch.Tensor, routing_weight: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
              activation_clamp: Optional[float], requant_group: int):
    """Steps 2-5 of one expert's rows from their L1 output [n, 2I] (gate columns, then up): the
    clamped SwiGLU times each row's routing weight, its requantization and the L2 output before the
    bf16 rounding. Returns (act, act_q, act_sf, l2_out)."""
    intermediate = l1_out.shape[1] // 2
    gate, up = l1_out[:, :intermediate], l1_out[:, intermediate:]
    if activation_clamp is not None:
        gate = gate.clamp(max=activation_clamp)
        up = up.clamp(-activation_clamp, activation_clamp)
    act = F.silu(gate) * up * routing_weight.unsqueeze(1)
    act_q, act_sf = requantize_groups(act, requant_group)
    l2_out = _matmul_nt(dequantize_per_token_group(act_q, act_sf, requant_group), dequantize_weight(w2, w2_scale))
    return act, act_q, act_sf, l2_out


def _validate_shared(shared, shared_scale, hidden: int, device: torch.device) -> None:
    """Check the shared experts (replicated weights, checkpoint layout; their own intermediate size)
    and their routing weight."""
    if shared is None:
        return
    _require_keys(shared, _WEIGHT_KEYS, "shared")
    _, shared_hidden, _ = validate_checkpoint_weights(*(shared[key] for key in _WEIGHT_KEYS), where="shared")
    if shared_hidden != hidden:
        raise ValueError(f"shared['w13'] has H={shared_hidden}, the routed experts H={hidden}: they must be equal")
    for key in _WEIGHT_KEYS:
        if shared[key].device != device:
            raise ValueError(f"shared[{key!r}] is on {shared[key].device} but weights[0]['w13'] is on {device}")
    if not (isinstance(shared_scale, numbers.Real) and not isinstance(shared_scale, bool)
            and math.isfinite(shared_scale)):
        raise ValueError(f"shared_scale must be a finite number, got {shared_scale!r}")


def mega_moe(ranks: Sequence[Dict[str, torch.Tensor]], weights: Sequence[Dict[str, torch.Tensor]],
             num_experts: int, activation_clamp: Optional[float] = None, requant_group: int = 128,
             return_intermediates: bool = False, l1_gemm: Optional[Callable] = None,
             shared: Optional[Mapping[str, torch.Tensor]] = None, shared_scale: float = 1.0):
    """Float32 reference of docs/design.md section 2 for R = len(ranks) ranks in one process.

    ranks[r]:   {x fp8 [T_r, H], x_sf f32 [T_r, H/128], topk_idx i64 [T_r, K] in [-1, E),
                 topk_weights f32 [T_r, K]}
    weights[r]: {w13 fp8 [E/R, 2I, H], w13_scale f32 [E/R, 2I/128, H/128],
                 w2 fp8 [E/R, H, I], w2_scale f32 [E/R, H/128, I/128]} (checkpoint layout),
                or MXFP4 in the same keys (megamoe_plugin.weights), one format on every rank
    Global expert e lives on rank e // (E/R) as local expert e % (E/R).
    shared:     the model's shared experts, replicated on every rank (docs/design.md section 2,
                "Shared experts"): {w13 fp8 [S, 2Is, H], w13_scale f32 [S, 2Is/128, H/128],
                w2 fp8 [S, H, Is], w2_scale f32 [S, H/128, Is/128]}. Every token passes through
                each of them with routing weight `shared_scale`; their outputs are summed after
                the routed slots.

    l1_gemm, if given, replaces step 1's exact GEMM: l1_gemm(x, x_sf, w13, w13_scale) ->
    float32 [rows, 2I] from the FP8 operands of one expert (used to judge a kernel against
    the FP8 tensor cores' own accumulation numerics, see megamoe_plugin.testing).

    Returns ys, the list of bf16 [T_r, H] outputs, on the inputs' device. With
    return_intermediates=True returns (ys, intermediates): one dict per global expert e
    with the rows it received, for checking a kernel phase by phase:
        src     i64 [n_e, 3]  (source rank, token, slot), sorted lexicographically
        l1_out  f32 [n_e, 2I] L1 output before the clamp (gate columns, then up)
        act     f32 [n_e, I]  clamped SwiGLU times the routing weight
        act_q   fp8 [n_e, I], act_sf f32 [n_e, I/G]  its requantization
        l2_out  f32 [n_e, H]  L2 output before bf16 rounding
    """
    hidden, intermediate, topk = _validate(ranks, weights, num_experts, activation_clamp, requant_group)
    num_local_experts = num_experts // len(ranks)
    device = weights[0]["w13"].device
    _validate_shared(shared, shared_scale, hidden, device)
    tokens_per_rank = [inputs["x"].shape[0] for inputs in ranks]

    # All ranks' tokens stacked rank-major; entry t * K + k is slot k of stacked token t.
    a = torch.cat([dequantize_per_token_group(inputs["x"], inputs["x_sf"], INPUT_GROUP) for inputs in ranks])
    if l1_gemm is not None:
        x_all = torch.cat([inputs["x"] for inputs in ranks])
        x_sf_all = torch.cat([inputs["x_sf"] for inputs in ranks])
    entry_expert = torch.cat([inputs["topk_idx"] for inputs in ranks]).reshape(-1)
    entry_weight = torch.cat([inputs["topk_weights"] for inputs in ranks]).reshape(-1)
    source_rank = torch.cat([torch.full((n,), r, dtype=torch.int64, device=device)
                             for r, n in enumerate(tokens_per_rank)])
    source_token = torch.cat([torch.arange(n, dtype=torch.int64, device=device) for n in tokens_per_rank])

    # Valid entries in (rank, token, slot) order; a stable sort by expert keeps that
    # order within each expert.
    valid_entries = torch.nonzero(entry_expert >= 0).squeeze(1)
    by_expert = valid_entries[torch.sort(entry_expert[valid_entries], stable=True).indices]
    counts = torch.bincount(entry_expert[by_expert], minlength=num_experts).tolist()

    expert_out = torch.zeros(a.shape[0] * topk, hidden, dtype=torch.bfloat16, device=device)
    intermediates: List[Dict[str, torch.Tensor]] = []
    for expert, entries in enumerate(torch.split(by_expert, counts)):
        if entries.numel() == 0 and not return_intermediates:
            continue
        w = weights[expert // num_local_experts]
        local = expert % num_local_experts
        tokens = entries // topk

        if l1_gemm is None:
            l1_out = _matmul_nt(a[tokens], dequantize_weight(w["w13"][local], w["w13_scale"][local]))
        else:
            l1_out = l1_gemm(x_all[tokens], x_sf_all[tokens], w["w13"][local], w["w13_scale"][local])
        act, act_q, act_sf, l2_out = _after_l1(l1_out, entry_weight[entries], w["w2"][local], w["w2_scale"][local],
                                               activation_clamp, requant_group)
        expert_out[entries] = l2_out.to(torch.bfloat16)

        if return_intermediates:
            src = torch.stack([source_rank[tokens], source_token[tokens], entries % topk], dim=1)
            intermediates.append(dict(src=src, l1_out=l1_out, act=act, act_q=act_q, act_sf=act_sf, l2_out=l2_out))

    # Combine: float32 sum over slots in ascending k; empty slots hold zeros.
    slot_out = expert_out.view(a.shape[0], topk, hidden)
    combined = torch.zeros(a.shape[0], hidden, dtype=torch.float32, device=device)
    for k in range(topk):
        combined += slot_out[:, k].float()
    for e in range(0 if shared is None else shared["w13"].shape[0]):
        if l1_gemm is None:
            l1_out = _matmul_nt(a, dequantize_weight(shared["w13"][e], shared["w13_scale"][e]))
        else:
            l1_out = l1_gemm(x_all, x_sf_all, shared["w13"][e], shared["w13_scale"][e])
        routing_weight = torch.full((a.shape[0],), float(shared_scale), dtype=torch.float32, device=device)
        l2_out = _after_l1(l1_out, routing_weight, shared["w2"][e], shared["w2_scale"][e], activation_clamp,
                           requant_group)[3]
        combined += l2_out.to(torch.bfloat16).float()
    ys = list(combined.to(torch.bfloat16).split(tokens_per_rank))
    return (ys, intermediates) if return_intermediates else ys


# Step 4 rounds act / s to the nearest e4m3 value. A float32-faithful kernel sums the L1 GEMM in
# another order than the reference, so its act differs by a little, and where the reference's act / s
# lies that close to the midpoint of two e4m3 values the kernel may round it the other way. On a
# token's dominant element that moves the token by up to 1/16 of the element: a slot 1.29e-2 off in a
# 64-token call (H 2048, I 768) on an H100. How far the kernel's act may be (tie_allowances):
# - the L1 output h_j within L1_SUM_ERROR * sum_k |a_k B_jk| (float32 sums of products of either
#   sign; cancellation makes a small h_j's relative error large),
# - silu, the products and the scale within ACT_ROUNDING_ERROR * |act| (a few float32 roundings).
# Measured on an H100 in exact mode (H 2048, I 768, 2 x 12288 rows): 139 of 18.9M codes rounded
# otherwise than the reference, all to the neighbouring value; beside the rounding term, none needed
# more than 2^-28 of sum |a b|, so L1_SUM_ERROR leaves a margin of 16.
L1_SUM_ERROR = 2.0 ** -24
ACT_ROUNDING_ERROR = 2.0 ** -19
SILU_MAX_SLOPE = 1.1  # |d silu(g) / dg| <= 1.0998


def act_error_bound(l1_out: torch.Tensor, l1_magnitude: torch.Tensor, routing_weight: torch.Tensor,
                    act: torch.Tensor) -> torch.Tensor:
    """How far (absolute, float64 [n, I]) a float32-faithful evaluation's act may be from this one:
    l1_out [n, 2I] the L1 output (gate, up), l1_magnitude [n, 2I] its sum_k |a_k B_jk|, routing_weight
    [n], act [n, I] (see L1_SUM_ERROR)."""
    intermediate = l1_out.shape[1] // 2
    gate, up = l1_out[:, :intermediate].double(), l1_out[:, intermediate:].double()
    gate_error, up_error = (L1_SUM_ERROR * l1_magnitude.double()).split(intermediate, dim=1)
    weight = routing_weight.double().abs().unsqueeze(1)
    return (weight * (SILU_MAX_SLOPE * up.abs() * gate_error + F.silu(gate).abs() * up_error)
            + ACT_ROUNDING_ERROR * act.double().abs())


def tie_allowances(ranks: Sequence[Dict[str, torch.Tensor]], weights: Sequence[Dict[str, torch.Tensor]],
                   num_experts: int, activation_clamp: Optional[float] = None,
                   requant_group: int = 128) -> List[torch.Tensor]:
    """Per rank, float64 [T_r]: how far (L2) each token's output may move from the reference's when a
    float32-faithful evaluation rounds step 4's ties (act_error_bound) the other way: the sum, over its
    slots' tie codes, of the code's change times the norm of the L2 weight column it multiplies. 0 for
    a token with no tie. Arguments as mega_moe's (routed experts only)."""
    num_local_experts = num_experts // len(ranks)
    _, per_expert = mega_moe(ranks, weights, num_experts, activation_clamp, requant_group, return_intermediates=True)
    # All ranks' tokens stacked rank-major, as mega_moe does: row first_row[r] + t is token t of rank r.
    a_abs = torch.cat([dequantize_per_token_group(inputs["x"], inputs["x_sf"], INPUT_GROUP).abs() for inputs in ranks])
    topk_weights = torch.cat([inputs["topk_weights"] for inputs in ranks])
    tokens_per_rank = [inputs["x"].shape[0] for inputs in ranks]
    first_row = torch.cumsum(torch.tensor([0] + tokens_per_rank[:-1], device=a_abs.device), 0)
    allowances = torch.zeros(a_abs.shape[0], dtype=torch.float64, device=a_abs.device)
    for expert, rows in enumerate(per_expert):
        if rows["src"].shape[0] == 0:
            continue
        w = weights[expert // num_local_experts]
        local = expert % num_local_experts
        src_rank, src_token, src_slot = rows["src"].unbind(1)
        stacked = first_row[src_rank] + src_token
        magnitude = _matmul_nt(a_abs[stacked], dequantize_weight(w["w13"][local], w["w13_scale"][local]).abs())
        routing_weight = topk_weights[stacked, src_slot]
        error = act_error_bound(rows["l1_out"], magnitude, routing_weight, rows["act"])
        deltas = requant_tie_deltas(rows["act"], rows["act_q"], rows["act_sf"], requant_group, error)
        column_norms = dequantize_weight(w["w2"][local], w["w2_scale"][local]).double().norm(dim=0)
        allowances.index_add_(0, stacked, deltas.abs() @ column_norms)
    return list(allowances.split(tokens_per_rank))


# docs/design.md section 2's bounds per numerics mode, (calc_diff, every token's relative L2 error),
# against the exact reference. Fast mode has a second check at full strictness, against the
# reference whose L1 is FP8 tensor cores per 128-K block (testing.fp8_tensor_core_l1): it is
# what catches a wrong scale, a missing K block or a race in an FP8 L1.
NUMERICS_BOUNDS = {"exact": (2e-4, 1e-2), "fast": (5e-5, 3e-2)}
FAST_VS_FP8_TENSOR_CORE_BOUNDS = (2e-4, 1e-2)


def calc_diff(y: torch.Tensor, ref: torch.Tensor) -> float:
    """1 - 2 * sum(y * ref) / sum(y^2 + ref^2) in float64; 0.0 when both are all zero."""
    y64, ref64 = y.double(), ref.double()
    denominator = float((y64 * y64 + ref64 * ref64).sum())
    if denominator == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((y64 * ref64).sum()) / denominator


def token_rel_errors(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||y_t - ref_t|| / ||ref_t|| per token (row of the first dim), in float64. A token whose
    reference row is exactly zero scores 0 only if its row is exactly zero too; NaN scores inf."""
    y64, ref64 = y.double().flatten(1), ref.double().flatten(1)
    ref_norm = ref64.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.nan_to_num((y64 - ref64).norm(dim=1) / ref_norm, nan=math.inf)


def error_summary(y: torch.Tensor, ref: torch.Tensor, max_token_rel: float = 1e-2) -> str:
    """One line on how far y is from ref: calc_diff, and the 99th percentile and maximum
    of the per-token relative L2 error with how many tokens exceed max_token_rel (the
    numerics tools in tools/ print it)."""
    y64, ref64 = y.double(), ref.double()
    rel = token_rel_errors(y64, ref64)
    return (f"calc_diff {calc_diff(y64, ref64):.2e}, per-token p99 {float(rel.quantile(0.99)):.2e} "
            f"max {float(rel.max()):.2e}, {int((rel > max_token_rel).sum())} of {y.shape[0]} tokens over "
            f"{max_token_rel:.0e}")


def check_close(y: torch.Tensor, ref: torch.Tensor, max_diff: float = 2e-4, max_token_rel: float = 1e-2) -> None:
    """Assert that y matches ref: calc_diff <= max_diff and, for every token (row of the
    first dim), ||y_t - ref_t|| / ||ref_t|| <= max_token_rel. A token whose reference row
    is exactly zero must be exactly zero; NaN or Inf anywhere never passes."""
    if tuple(y.shape) != tuple(ref.shape):
        raise AssertionError(f"shape mismatch: y {tuple(y.shape)} vs ref {tuple(ref.shape)}")
    if y.dim() < 2:
        raise ValueError(f"check_close expects [T, ...] tensors with at least 2 dims, got shape {tuple(y.shape)}")
    y64, ref64 = y.double().flatten(1), ref.double().flatten(1)
    problems = []
    for name, tensor in (("y", y64), ("ref", ref64)):
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        if nan or inf:
            problems.append(f"{name} has {nan} NaN and {inf} Inf values")
    diff = calc_diff(y64, ref64)
    if not diff <= max_diff:
        problems.append(f"calc_diff={diff:.3e} > max_diff={max_diff:.1e}")
    worst_token = "no tokens"
    if y64.shape[0] > 0:
        token_rel = token_rel_errors(y64, ref64)
        worst = int(token_rel.argmax())
        worst_token = (f"worst token {worst}: relative L2 error {float(token_rel[worst]):.3e}, "
                       f"|ref_t|={float(ref64[worst].norm()):.3e}")
        over = int((token_rel > max_token_rel).sum())
        if over:
            problems.append(f"{over} of {y64.shape[0]} tokens have relative L2 error > max_token_rel={max_token_rel:.1e}")
    if problems:
        raise AssertionError(f"y does not match the reference (global calc_diff={diff:.3e}; {worst_token}): "
                             + "; ".join(problems))
