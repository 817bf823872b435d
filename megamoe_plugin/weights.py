"""Expert weights: the checkpoint layout, its validation, and the SM90 kernel layout.

Checkpoint layout (vLLM FP8 128x128 block quantization, docs/design.md section 2), per rank:
    w13       float8_e4m3fn [E_l, 2I, H]         rows: I gate rows, then I up rows
    w13_scale float32       [E_l, 2I/128, H/128]
    w2        float8_e4m3fn [E_l, H, I]
    w2_scale  float32       [E_l, H/128, I/128]
or MXFP4 (section 2, "FP4 experts"; megamoe_plugin.mxfp4), the rows the same:
    w13       uint8 [E_l, 2I, H/2]   two E2M1 codes per byte
    w13_scale E8M0  [E_l, 2I, H/32]  torch.float8_e8m0fnu, or uint8 holding its bits
    w2        uint8 [E_l, H, I/2]
    w2_scale  E8M0  [E_l, H, I/32]
The reference and `transform_weights` take both; the kernel reads MXFP4 weights at 4 bits in the
tiers up to BLOCK_M 64 of fast numerics so far (csrc/megamoe/fp4_weights.cuh).

Kernel layout produced by `transform_weights` (a pure permutation, bit-exact):
    w13_t       [E_l, 2I, H]: gate and up rows interleaved in runs of 8. For j < I/8,
                rows [16j, 16j+8) are gate rows [8j, 8j+8) and rows [16j+8, 16j+16)
                are up rows [8j, 8j+8) (checkpoint rows I+8j ..).
    w13_scale_t [E_l, I/128, 2, H/128]: [e, g, 0, kb] is the scale of gate block g,
                [e, g, 1, kb] the scale of up block g (checkpoint block I/128 + g).
    w2_t, w2_scale_t: the checkpoint tensors, made contiguous.
MXFP4 (`kernel_layout_shapes` gives every shape), in the kernel's tiles of 256 rows (abi.kBlockN)
by 128 inputs, each tile's k-block in one piece: its 16 KB of codes one sequential read (TMA), its
1 KB of scales and 16 bytes of their largest per 128-row block one bulk copy, both at the same tile
index (csrc/megamoe/pipeline.cuh load_b):
    w13_t       uint8 [E_l, 2I/256, H/128, 256, 64]: [e, n, k] is the tile of (interleaved, as
                above) rows [256n, 256n + 256) and inputs [128k, 128k + 128), row by row, the
                sign bits within each 4-byte word in the kernel's order (mxfp4.to_kernel_codes).
    w13_scale_t uint8 [E_l, 2I/256, H/128, 260, 4]: the same tiles of the rows' E8M0 codes, then
                16 bytes: the largest code of the tile's rows [0, 128) and of [128, 256) in bytes 0
                and 1 (abi.kFp4BlockCodeBytes; the kernel folds each such block by it), the rest 0.
    w2_t        uint8 [E_l, ceil(H/256), I/128, 256, 64]: the same tiles of w2's rows,
    w2_scale_t  uint8 [E_l, ceil(H/256), I/128, 260, 4]   and of their scales.
Rows past H (a last tile of fewer rows) are zero: the tiles past H read them and drop their outputs.

Why this layout:
- The L1 epilogue computes silu(gate) * up per output column (a w13 row is an L1
  output column). In a WGMMA accumulator fragment a thread owns the same two columns of
  every 8-column chunk; interleaving at granularity 8 makes chunk 2j gate columns
  [8j, 8j+8) and chunk 2j+1 the matching up columns, so each thread holds gate and up
  of the same outputs in its registers and SwiGLU needs no shared-memory exchange.
- Every 256-row block g of w13_t holds exactly gate rows [128g, 128g+128) and up rows
  [I+128g, I+128g+128): one gate and one up 128x128 scale block, which is what
  w13_scale_t[:, g] stores side by side. An L1 tile of 256 rows therefore produces 128
  complete outputs, i.e. whole requant groups (G = 128 or 64), and the epilogue can
  quantize them without waiting for another tile.
- L2 (down projection) needs no change: its K dimension is I in output order.

The transform runs with views and one copy per tensor on the input's device.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from . import abi, mxfp4
from .fp8 import FP8_DTYPE, dequantize_weight_blocks

BLOCK = 128
GATE_UP_INTERLEAVE = 8

WeightPair = Tuple[torch.Tensor, torch.Tensor]


def weight_format(w: torch.Tensor) -> str:
    """"mxfp4" for packed E2M1 codes (uint8), else "fp8"."""
    return "mxfp4" if isinstance(w, torch.Tensor) and w.dtype == torch.uint8 else "fp8"


def kernel_layout_shapes(weights: str, num_local_experts: int, hidden: int, intermediate: int) -> dict:
    """{name: (shape, dtype, layout text)} of the four tensors `transform_weights` makes for weights of
    format `weights` ("fp8" or "mxfp4"), for the call's validation."""
    el, h, i = num_local_experts, hidden, intermediate
    if weights == "mxfp4":
        per_row, rows = abi.kFp4ScaleBytesPerRow, abi.kBlockN
        scale_rows = rows + abi.kFp4BlockCodeBytes // per_row  # the rows', then their blocks' largest
        padded_h = -(-h // rows) * rows
        return {"w13": ((el, 2 * i // rows, h // BLOCK, rows, BLOCK // 2), torch.uint8,
                        f"[E_local, 2I/{rows}, H/128, {rows}, 64]"),
                "w13_scale": ((el, 2 * i // rows, h // BLOCK, scale_rows, per_row), torch.uint8,
                              f"[E_local, 2I/{rows}, H/128, {scale_rows}, {per_row}]"),
                "w2": ((el, padded_h // rows, i // BLOCK, rows, BLOCK // 2), torch.uint8,
                       f"[E_local, ceil(H/{rows}), I/128, {rows}, 64]"),
                "w2_scale": ((el, padded_h // rows, i // BLOCK, scale_rows, per_row), torch.uint8,
                             f"[E_local, ceil(H/{rows}), I/128, {scale_rows}, {per_row}]")}
    return {"w13": ((el, 2 * i, h), FP8_DTYPE, "[E_local, 2I, H]"),
            "w13_scale": ((el, i // BLOCK, 2, h // BLOCK), torch.float32, "[E_local, I/128, 2, H/128]"),
            "w2": ((el, h, i), FP8_DTYPE, "[E_local, H, I]"),
            "w2_scale": ((el, h // BLOCK, i // BLOCK), torch.float32, "[E_local, H/128, I/128]")}


def _in_tiles(rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """[E, N, C] (a row's C bytes: chunk per k-block) -> [E, ceil(N/256), C/chunk, 256, chunk], the
    padding rows zero."""
    e, n, columns = rows.shape
    tile_rows = abi.kBlockN
    padded = torch.zeros((e, -(-n // tile_rows) * tile_rows, columns), dtype=torch.uint8, device=rows.device)
    padded[:, :n] = rows
    return padded.reshape(e, -1, tile_rows, columns // chunk, chunk).transpose(2, 3).contiguous()


def _with_block_largest(scale_tiles: torch.Tensor) -> torch.Tensor:
    """MXFP4 scale tiles [E, T, KB, 256, 4] -> [E, T, KB, 260, 4]: each tile's k-block followed by the
    largest code of its rows [0, 128) and [128, 256) in bytes 0 and 1 of 16 (abi.kFp4BlockCodeBytes)."""
    e, t, kb, rows, per_row = scale_tiles.shape
    blocks = rows // BLOCK  # a math warpgroup converts one block of 128 rows
    largest = scale_tiles.reshape(e, t, kb, blocks, BLOCK * per_row).amax(dim=-1)  # [E, T, KB, 2]
    record = torch.zeros((e, t, kb, abi.kFp4BlockCodeBytes), dtype=torch.uint8, device=scale_tiles.device)
    record[..., :blocks] = largest
    return torch.cat([scale_tiles, record.view(e, t, kb, -1, per_row)], dim=3).contiguous()


def _from_tiles(tiles: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of _in_tiles: [E, N/256, C/chunk, 256, chunk] -> [E, rows, C]."""
    e, blocks, k_blocks, tile_rows, chunk = tiles.shape
    return tiles.transpose(2, 3).reshape(e, blocks * tile_rows, k_blocks * chunk)[:, :rows].contiguous()


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's checkpoint-layout weight [N, K] (FP8 with 128x128 block scales, or MXFP4 with
    its packed [N, K/2] codes) as float32 [N, K], exactly."""
    if weight_format(w) == "mxfp4":
        return mxfp4.dequantize_mxfp4(w, scale)
    return dequantize_weight_blocks(w, scale)


def _arg_name(key: str, where: Optional[str]) -> str:
    return key if where is None else f"{where}[{key!r}]"


def unpack_pair(pair, name: str) -> WeightPair:
    if not isinstance(pair, Sequence) or len(pair) != 2:
        raise TypeError(f"{name} must be a (weight, scale) pair of tensors, got {type(pair).__name__}")
    return pair[0], pair[1]


def _validate(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
              *, transformed: bool, where: Optional[str] = None) -> Tuple[int, int, int]:
    names = {key: _arg_name(key, where) for key in ("w13", "w13_scale", "w2", "w2_scale")}
    tensors = {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{names[key]} must be a torch.Tensor, got {type(tensor).__name__}")
    packed = weight_format(w13) == "mxfp4"
    for key in ("w13", "w2"):
        if tensors[key].dtype != (torch.uint8 if packed else FP8_DTYPE):
            raise ValueError(f"{names[key]} must be {torch.uint8 if packed else FP8_DTYPE}, got {tensors[key].dtype}"
                             + (f" ({names['w13']} is MXFP4: w2 must be too)" if packed else ""))
    for key in ("w13_scale", "w2_scale"):
        if packed:
            mxfp4.scale_bits(tensors[key], names[key])
        elif tensors[key].dtype != torch.float32:
            raise ValueError(f"{names[key]} must be torch.float32 (128x128 block scales), got {tensors[key].dtype}")
    for key, tensor in tensors.items():
        if tensor.device != w13.device:
            raise ValueError(f"{names[key]} is on {tensor.device} but {names['w13']} is on {w13.device}; "
                             "all weights must be on one device")

    if packed and transformed:
        if w13.dim() != 5:
            raise ValueError(f"{names['w13']} must be MXFP4 in the kernel layout [E_local, 2I/256, H/128, 256, 64] "
                             f"(transform_weights), got shape {tuple(w13.shape)}")
        num_local_experts = w13.shape[0]
        hidden, intermediate = w13.shape[2] * BLOCK, w13.shape[1] * abi.kBlockN // 2
        shapes = kernel_layout_shapes("mxfp4", num_local_experts, hidden, intermediate)
        for key in ("w2", "w13_scale", "w2_scale"):
            if tuple(tensors[key].shape) != shapes[key][0]:
                raise ValueError(f"{names[key]} must have the kernel layout {shapes[key][2]} = {shapes[key][0]} "
                                 f"(transform_weights), got {tuple(tensors[key].shape)}")
        return num_local_experts, hidden, intermediate
    # Columns per stored element along K: MXFP4 packs two.
    per_byte = 2 if packed else 1
    w13_layout, w2_layout = ("[E_local, 2*I, H/2]", "[E_local, H, I/2]") if packed else ("[E_local, 2*I, H]",
                                                                                      "[E_local, H, I]")
    if w13.dim() != 3:
        raise ValueError(f"{names['w13']} must be 3-D {w13_layout}, got shape {tuple(w13.shape)}")
    num_local_experts, rows, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * per_byte
    if rows % 2 != 0:
        raise ValueError(f"{names['w13']}.shape[1]={rows} must be even (I gate rows then I up rows)")
    intermediate = rows // 2
    if intermediate % BLOCK != 0:
        raise ValueError(f"intermediate size I = {names['w13']}.shape[1] / 2 = {intermediate} "
                         f"must be a multiple of {BLOCK}")
    if hidden % BLOCK != 0:
        raise ValueError(f"hidden size H = {names['w13']}.shape[2]{' * 2' if packed else ''} = {hidden} "
                         f"must be a multiple of {BLOCK}")
    if w2.dim() != 3:
        raise ValueError(f"{names['w2']} must be 3-D {w2_layout}, got shape {tuple(w2.shape)}")
    if w2.shape[0] != num_local_experts:
        raise ValueError(f"{names['w2']}.shape[0]={w2.shape[0]} must equal {names['w13']}.shape[0]="
                         f"{num_local_experts} (number of local experts)")
    w2_shape = (num_local_experts, hidden, intermediate // per_byte)
    if tuple(w2.shape) != w2_shape:
        raise ValueError(f"{names['w2']} must have shape {w2_layout} = {w2_shape} "
                         f"to match {names['w13']} of shape {tuple(w13.shape)}, got {tuple(w2.shape)}")

    if packed:
        group = mxfp4.MXFP4_GROUP
        expected_scales = {
            "w13_scale": ((num_local_experts, 2 * intermediate, hidden // group), f"[E_local, 2*I, H/{group}]"),
            "w2_scale": ((num_local_experts, hidden, intermediate // group), f"[E_local, H, I/{group}]"),
        }
        for key, (expected, layout) in expected_scales.items():
            if tuple(tensors[key].shape) != expected:
                raise ValueError(f"{names[key]} must have shape {layout} = {expected}, got "
                                 f"{tuple(tensors[key].shape)}: one E8M0 scale per {group} input elements")
        return num_local_experts, hidden, intermediate
    if transformed:
        expected_w13_scale = (num_local_experts, intermediate // BLOCK, 2, hidden // BLOCK)
        w13_scale_layout = "[E_local, I/128, 2, H/128]"
    else:
        expected_w13_scale = (num_local_experts, 2 * intermediate // BLOCK, hidden // BLOCK)
        w13_scale_layout = "[E_local, 2I/128, H/128]"
    expected_scales = {
        "w13_scale": (expected_w13_scale, w13_scale_layout),
        "w2_scale": ((num_local_experts, hidden // BLOCK, intermediate // BLOCK), "[E_local, H/128, I/128]"),
    }
    for key, (expected, layout) in expected_scales.items():
        if tuple(tensors[key].shape) != expected:
            raise ValueError(f"{names[key]} must have shape {layout} = {expected}, got {tuple(tensors[key].shape)}: "
                             f"128x128 block quantization is required (no per-tensor, per-channel or other block sizes)")
    return num_local_experts, hidden, intermediate


def validate_checkpoint_weights(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                                w2_scale: torch.Tensor, *, where: Optional[str] = None) -> Tuple[int, int, int]:
    """Check one rank's checkpoint-layout expert weights; return (E_local, H, I).

    Raises TypeError/ValueError naming the offending argument; `where` (e.g. "weights[1]")
    makes the names read `weights[1]['w13']` for callers that take dicts.
    """
    return _validate(w13, w13_scale, w2, w2_scale, transformed=False, where=where)


def _validate_shared(shared: Mapping[str, torch.Tensor], hidden: int, intermediate: int,
                     routed_w13: torch.Tensor) -> int:
    """The number of experts in `shared` (checkpoint layout), checked against the routed experts'
    H, I, weight format and device."""
    missing = [key for key in ("w13", "w13_scale", "w2", "w2_scale") if not isinstance(shared, Mapping)
               or key not in shared]
    if missing:
        raise ValueError(f"shared must be a dict with keys w13, w13_scale, w2, w2_scale; missing {missing}")
    num_shared, shared_hidden, shared_intermediate = validate_checkpoint_weights(
        shared["w13"], shared["w13_scale"], shared["w2"], shared["w2_scale"], where="shared")
    if (shared_hidden, shared_intermediate) != (hidden, intermediate):
        raise ValueError(f"shared experts have H={shared_hidden}, I={shared_intermediate}; the kernel runs them as "
                         f"local experts, so they need the routed experts' H={hidden}, I={intermediate}")
    if weight_format(shared["w13"]) != weight_format(routed_w13) or shared["w13"].device != routed_w13.device:
        raise ValueError(f"shared experts must be {weight_format(routed_w13).upper()} weights on {routed_w13.device}, "
                         "as the routed ones")
    return num_shared


def transform_weights(l1: WeightPair, l2: WeightPair,
                      shared: Optional[Mapping[str, torch.Tensor]] = None) -> Tuple[WeightPair, WeightPair]:
    """Checkpoint layout -> SM90 kernel layout (see the module docstring).

    l1 = (w13, w13_scale), l2 = (w2, w2_scale); returns ((w13_t, w13_scale_t), (w2_t, w2_scale_t)),
    all contiguous and on the input device.
    shared: the model's shared experts in the same layout and format, {w13, w13_scale, w2, w2_scale}
    with S experts of the routed experts' H and I (reference.mega_moe's `shared`). The kernel runs
    them as local experts: the result holds E_l + S experts, the shared ones last, for a buffer made
    with num_shared_experts=S.
    """
    w13, w13_scale = unpack_pair(l1, "l1")
    w2, w2_scale = unpack_pair(l2, "l2")
    num_local_experts, hidden, intermediate = _validate(w13, w13_scale, w2, w2_scale, transformed=False)
    packed = weight_format(w13) == "mxfp4"
    if shared is not None:
        num_shared = _validate_shared(shared, hidden, intermediate, w13)
        w13, w13_scale, w2, w2_scale = (torch.cat([routed, shared[key]]) for routed, key in (
            (w13, "w13"), (w13_scale, "w13_scale"), (w2, "w2"), (w2_scale, "w2_scale")))
        num_local_experts += num_shared
    runs = intermediate // GATE_UP_INTERLEAVE

    def interleave(rows: torch.Tensor) -> torch.Tensor:  # [E, (gate|up), run, 8, C] -> [E, run, (gate|up), 8, C]
        columns = rows.shape[-1]
        return (rows.reshape(num_local_experts, 2, runs, GATE_UP_INTERLEAVE, columns)
                .transpose(1, 2).reshape(num_local_experts, 2 * intermediate, columns).contiguous())

    if packed:
        for scale, name in ((w13_scale, "w13_scale"), (w2_scale, "w2_scale")):
            mxfp4.check_no_nan_scales(scale, f"MXFP4 scales {name}")
        per_row = abi.kFp4ScaleBytesPerRow
        return ((_in_tiles(interleave(mxfp4.to_kernel_codes(w13)), BLOCK // 2),
                 _with_block_largest(_in_tiles(interleave(mxfp4.scale_bits(w13_scale)), per_row))),
                (_in_tiles(mxfp4.to_kernel_codes(w2), BLOCK // 2),
                 _with_block_largest(_in_tiles(mxfp4.scale_bits(w2_scale), per_row))))
    w13_t = interleave(w13)
    # [E, (gate|up), I/128, H/128] -> [E, I/128, (gate|up), H/128]
    w13_scale_t = (w13_scale.reshape(num_local_experts, 2, intermediate // BLOCK, hidden // BLOCK)
                   .transpose(1, 2).contiguous())
    return (w13_t, w13_scale_t), (w2.contiguous(), w2_scale.contiguous())


def append_experts(l1: WeightPair, l2: WeightPair,
                   shared: Mapping[str, torch.Tensor]) -> Tuple[WeightPair, WeightPair]:
    """Kernel-layout weights (transform_weights' output) with `shared` (its checkpoint-layout
    argument of that name) appended: exactly transform_weights(checkpoint, shared=shared), for a
    framework that builds the routed experts' kernel layout before it reaches the shared experts.
    The layout is per expert, so the result is the concatenation; new tensors, inputs untouched."""
    w13_t, w13_scale_t = unpack_pair(l1, "l1")
    w2_t, w2_scale_t = unpack_pair(l2, "l2")
    _, hidden, intermediate = _validate(w13_t, w13_scale_t, w2_t, w2_scale_t, transformed=True)
    _validate_shared(shared, hidden, intermediate, w13_t)
    (s13, s13_scale), (s2, s2_scale) = transform_weights((shared["w13"], shared["w13_scale"]),
                                                         (shared["w2"], shared["w2_scale"]))
    return ((torch.cat([w13_t, s13]), torch.cat([w13_scale_t, s13_scale])),
            (torch.cat([w2_t, s2]), torch.cat([w2_scale_t, s2_scale])))


def split_mlp(gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
              intermediate: int) -> Dict[str, torch.Tensor]:
    """One SwiGLU MLP of intermediate S*I (gate_up [2SI, H]: S*I gate rows then S*I up rows; down
    [H, S*I]; 128x128 block scales) as S experts of intermediate I in the checkpoint layout of
    transform_weights' `shared`. Expert s takes intermediate channels [s*I, (s+1)*I): exact, since
    SwiGLU is per channel, so the MLP is the sum of its channel slices' outputs."""
    two_si, hidden = gate_up.shape
    num = two_si // (2 * intermediate)
    gate, up = gate_up.view(2, num, intermediate, hidden).unbind(0)
    gate_s, up_s = gate_up_scale.view(2, num, intermediate // BLOCK, hidden // BLOCK).unbind(0)
    return dict(
        w13=torch.cat([gate, up], dim=1).contiguous(),
        w13_scale=torch.cat([gate_s, up_s], dim=1).contiguous(),
        w2=down.view(hidden, num, intermediate).transpose(0, 1).contiguous(),
        w2_scale=down_scale.view(hidden // BLOCK, num, intermediate // BLOCK).transpose(0, 1).contiguous(),
    )


def untransform_weights(l1: WeightPair, l2: WeightPair) -> Tuple[WeightPair, WeightPair]:
    """Exact inverse of `transform_weights`: SM90 kernel layout -> checkpoint layout."""
    w13_t, w13_scale_t = unpack_pair(l1, "l1")
    w2, w2_scale = unpack_pair(l2, "l2")
    num_local_experts, hidden, intermediate = _validate(w13_t, w13_scale_t, w2, w2_scale, transformed=True)
    runs = intermediate // GATE_UP_INTERLEAVE

    def deinterleave(rows: torch.Tensor) -> torch.Tensor:  # transform_weights' interleave, undone
        columns = rows.shape[-1]
        return (rows.reshape(num_local_experts, runs, 2, GATE_UP_INTERLEAVE, columns)
                .transpose(1, 2).reshape(num_local_experts, 2 * intermediate, columns).contiguous())

    if weight_format(w13_t) == "mxfp4":
        tile_rows = abi.kBlockN  # the scale tiles' rows, without their blocks' largest codes after them
        return ((mxfp4.from_kernel_codes(deinterleave(_from_tiles(w13_t, 2 * intermediate))),
                 deinterleave(_from_tiles(w13_scale_t[..., :tile_rows, :], 2 * intermediate))),
                (mxfp4.from_kernel_codes(_from_tiles(w2, hidden)), _from_tiles(w2_scale[..., :tile_rows, :], hidden)))
    w13 = deinterleave(w13_t)
    w13_scale = (w13_scale_t.transpose(1, 2)
                 .reshape(num_local_experts, 2 * intermediate // BLOCK, hidden // BLOCK).contiguous())
    return (w13, w13_scale), (w2.contiguous(), w2_scale.contiguous())
