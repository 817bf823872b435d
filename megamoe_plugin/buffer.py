"""The symmetric buffer: one per (process group, shape), shared by every MoE layer of
that shape.

Its byte layout is defined here and only here; the host runtime receives the region
offsets from `BufferLayout` and passes them to the kernel, so the kernel and Python
never disagree about where anything lives.

Per rank, in order (every region 256-byte aligned):
  inputs      x [N, H] fp8, x_sf [N, H/128] f32, topk_idx [N, K] i64, topk_weights [N, K] f32
              (filled by the caller for the first n tokens; peers read them over NVLink)
  send side   send_count / send_cursor / send_offset [2, E] i32, send_list [N*K] i32:
              this rank's (token, slot) entries grouped by global expert, which the
              expert's owner pulls. A call uses half (its cross-rank barrier's round) & 1 of the
              first three; a peer reads that half until it ends the call, and the next call zeroes
              its counts and cursors after its own cross-rank barrier.
  signals     barrier state that lives across calls (SIGNAL_WORDS, u32 each; wrap-safe,
              csrc/megamoe/sync.cuh), the call's count of claimed L2 tiles, and what the next
              call zeroes first (the last call's m-blocks and tokens)
  l1_done     [ceil(M / MIN_BLOCK_M)] i32: per m-block of the call, how many L1 tiles have stored
              their act rows; an L2 tile of that m-block starts when all have (no grid
              barrier between L1 and L2). Zeroed by the next call.
  rows_arrived [ceil(M / MIN_BLOCK_M)] i32: per m-block of the call, how many of its rows the
              pull has copied; an L1 tile starts when all have (no grid barrier between the
              pull and L1). Zeroed by the next call.
  L1 pool     pool_x [P, H] fp8, pool_sf [H/128, P] f32 (MN-major for TMA),
              pool_weight [P] f32, pool_src [P, 2] i32 (source rank, token*K + slot)
  L2 pool     act [P, I] fp8, act_sf [I/128, P] f32
  combine     combine [N, K, H] bf16: expert outputs scattered here by whichever rank
              computed them, summed over k by the owner of the token.
  combine_arrived [N] i32: per token, the L2 tiles that have stored one of its rows here (each
              slot's row comes in H / 256 column blocks); the token is combined when all have
              (no cross-rank barrier before the combine). Zeroed by the next call.
M (max_pool_rows) bounds every routing: all R*N*K entries plus per-expert padding to
POOL_ALIGN_M rows. P (pool_capacity) is what the pools hold: by default a balanced routing's rows
and half as many again (POOL_ROWS_PER_OWN_ENTRY), at most M. Where P < M (BufferShape.windowed) a
call whose rows do not fit runs its m-blocks in windows of P / BLOCK_M (csrc/megamoe/kernel.cuh
mega_moe_windows), so no routing needs more memory.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import abi
from .heuristics import IMPLEMENTED_BLOCK_M, TIER_OF

# Every expert's rows start on a multiple of this in the pools; no BLOCK_M tier exceeds it.
POOL_ALIGN_M = 128
# The smallest BLOCK_M tier the kernel has: the most m-blocks a pool can be cut into.
MIN_BLOCK_M = min(IMPLEMENTED_BLOCK_M)
_REGION_ALIGN = 256
# The signals region's words and their indices (csrc/megamoe/abi.h SignalWord, which says what each holds).
NUM_SIGNAL_WORDS = abi.kNumSignalWords
SIGNAL_WORDS = abi.SIGNAL_WORDS
# The pools' default rows, as a multiple of the entries one rank's own tokens make (N * K), plus
# the per-expert padding: the rows of a balanced routing at any EP width and half as many again.
# A rank that receives more runs its call in pool windows (BufferShape.windowed). With it the
# buffer is at most 1 GiB (v4flash) / 2 GiB (v3) per rank at EP8 with 8192 tokens (README table).
POOL_ROWS_PER_OWN_ENTRY = 1.5
# Section 2 limits of docs/design.md.
MAX_TOPK = 16
MAX_LOCAL_EXPERTS = 512
SUPPORTED_NUM_RANKS = (1, 2, 4, 8)


def window_loop(block_m: int) -> bool:
    """Whether the window kernel of a tier loops over the pool windows (config.cuh kWindowLoop; the
    JIT source checks it): all but the rebalanced tier, where the host launches it per window."""
    return not TIER_OF[block_m].rebalanced


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclasses.dataclass(frozen=True)
class BufferShape:
    num_ranks: int
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_size: int
    # Rows of the pools (pool_capacity); None: the default (POOL_ROWS_PER_OWN_ENTRY). Fewer rows
    # than the worst routing needs make calls that receive more run in windows (tests force small
    # pools with it).
    pool_rows: Optional[int] = None
    # Shared experts S (docs/design.md section 2) the kernel runs as local experts of every rank:
    # num_experts and num_topk above are the kernel's, S of each rank's local experts (after its
    # routed ones) and S of each token's slots (after its routed ones) are theirs (of_routed).
    num_shared_experts: int = 0

    @classmethod
    def of_routed(cls, num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                  intermediate_size: int, pool_rows: Optional[int] = None, num_shared_experts: int = 0
                  ) -> "BufferShape":
        """The shape for `num_experts` routed experts, `num_topk` routed slots per token and
        `num_shared_experts` shared experts."""
        for name, value in (("num_experts", num_experts), ("num_topk", num_topk),
                            ("num_shared_experts", num_shared_experts)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={num_shared_experts} is invalid: expected >= 0")
        if num_shared_experts and num_topk + num_shared_experts > MAX_TOPK:
            raise ValueError(f"num_topk={num_topk} routed plus num_shared_experts={num_shared_experts} shared slots per "
                             f"token is more than the kernel's {MAX_TOPK}")
        if num_ranks in SUPPORTED_NUM_RANKS and num_experts > 0 and num_experts % num_ranks == 0:
            num_experts += num_ranks * num_shared_experts
        return cls(num_ranks, num_experts, num_max_tokens_per_rank, num_topk + num_shared_experts, hidden,
                   intermediate_size, pool_rows, num_shared_experts)

    def __post_init__(self):
        def need(cond, name, what):
            if not cond:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected {what}")

        for name in ("num_ranks", "num_experts", "num_max_tokens_per_rank", "num_topk", "hidden", "intermediate_size",
                     "num_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        need(self.num_ranks in SUPPORTED_NUM_RANKS, "num_ranks", f"one of {SUPPORTED_NUM_RANKS}")
        need(self.num_experts > 0 and self.num_experts % self.num_ranks == 0, "num_experts",
             f"a positive multiple of num_ranks={self.num_ranks}")
        need(self.num_experts // self.num_ranks <= MAX_LOCAL_EXPERTS, "num_experts",
             f"at most {MAX_LOCAL_EXPERTS} experts per rank (num_experts / num_ranks)")
        need(self.num_max_tokens_per_rank > 0, "num_max_tokens_per_rank", "> 0")
        need(1 <= self.num_topk <= MAX_TOPK, "num_topk", f"in [1, {MAX_TOPK}]")
        need(self.num_topk <= self.num_experts, "num_topk", f"<= num_experts={self.num_experts}")
        need(self.hidden > 0 and self.hidden % 128 == 0, "hidden", "a positive multiple of 128")
        need(self.intermediate_size > 0 and self.intermediate_size % 128 == 0, "intermediate_size",
             "a positive multiple of 128")
        need(0 <= self.num_shared_experts < min(self.num_topk, self.num_local_experts), "num_shared_experts",
             f"in [0, {min(self.num_topk, self.num_local_experts)}): fewer than the slots and the local experts, "
             "so that every token has a routed slot and every rank a routed expert")
        if self.pool_rows is not None:
            if not isinstance(self.pool_rows, int) or isinstance(self.pool_rows, bool):
                raise TypeError(f"pool_rows must be an int or None, got {type(self.pool_rows).__name__}")
            need(self.pool_rows % POOL_ALIGN_M == 0 and POOL_ALIGN_M <= self.pool_rows <= self.max_pool_rows,
                 "pool_rows", f"a multiple of {POOL_ALIGN_M} in [{POOL_ALIGN_M}, {self.max_pool_rows}] (the rows "
                 "the worst routing needs)")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts - self.num_ranks * self.num_shared_experts

    @property
    def num_routed_topk(self) -> int:
        return self.num_topk - self.num_shared_experts

    @property
    def num_max_recv_entries(self) -> int:
        """Most (token, slot) entries one rank can receive: every slot of every rank."""
        return self.num_ranks * self.num_max_tokens_per_rank * self.num_topk

    def _padded_rows(self, entries: int) -> int:
        """Pool rows that `entries` rows need in any split over the local experts: each expert's
        m-blocks round its rows up (by less than POOL_ALIGN_M, the largest tier)."""
        return _round_up(entries + min(self.num_local_experts, entries) * (POOL_ALIGN_M - 1), POOL_ALIGN_M)

    @property
    def max_pool_rows(self) -> int:
        """The rows the worst routing needs (every entry of every rank to this rank's experts):
        the call's m-blocks, whose counters (l1_done, rows_arrived) are sized by it."""
        return self._padded_rows(self.num_max_recv_entries)

    @property
    def pool_capacity(self) -> int:
        """Rows of the pools: pool_rows, else a balanced routing's rows and half as many again
        (POOL_ROWS_PER_OWN_ENTRY), at most max_pool_rows."""
        if self.pool_rows is not None:
            return self.pool_rows
        own = self.num_max_tokens_per_rank * self.num_topk
        return min(self.max_pool_rows, self._padded_rows(int(own * POOL_ROWS_PER_OWN_ENTRY)))

    def window_kernel_launches(self, block_m: int) -> int:
        """Launches of the window kernel per call of a variant of tier `block_m` on this buffer
        (csrc/megamoe/kernel.cuh mega_moe_windows): none where the pools hold every routing, one
        where it loops over the windows (window_loop), else (the rebalanced tier) one per window
        after the first that the worst routing can make; those past a call's windows return at once.
        Every call asks (ops.fp8_mega_moe): computed once per shape, for every tier."""
        return self._window_kernel_launches[block_m]

    @functools.cached_property
    def _window_kernel_launches(self) -> Dict[int, int]:
        def launches(block_m: int) -> int:
            if not self.windowed:
                return 0
            if window_loop(block_m):
                return 1
            entries = self.num_max_recv_entries
            max_mblocks = (entries + min(self.num_local_experts, entries) * (block_m - 1)) // block_m
            per_window = self.pool_capacity // block_m
            return -(-max_mblocks // per_window) - 1

        return {block_m: launches(block_m) for block_m in IMPLEMENTED_BLOCK_M}

    @property
    def windowed(self) -> bool:
        """Whether some routing needs more rows than the pools hold: its calls then run the pool
        in windows (csrc/megamoe/kernel.cuh mega_moe_windows; its variants are built for it)."""
        return self.pool_capacity < self.max_pool_rows


@dataclasses.dataclass(frozen=True)
class Region:
    offset: int
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class BufferLayout:
    """Byte offsets of every region of one rank's symmetric buffer."""

    def __init__(self, shape: BufferShape):
        self.shape = shape
        n, k, h, i = shape.num_max_tokens_per_rank, shape.num_topk, shape.hidden, shape.intermediate_size
        e, p = shape.num_experts, shape.pool_capacity
        num_mblocks = _round_up(shape.max_pool_rows, MIN_BLOCK_M) // MIN_BLOCK_M
        specs = [
            ("x", (n, h), torch.float8_e4m3fn),
            ("x_sf", (n, h // 128), torch.float32),
            ("topk_idx", (n, k), torch.int64),
            ("topk_weights", (n, k), torch.float32),
            ("send_count", (2, e), torch.int32),
            ("send_cursor", (2, e), torch.int32),
            ("send_offset", (2, e), torch.int32),
            ("send_list", (n * k,), torch.int32),
            ("signals", (NUM_SIGNAL_WORDS,), torch.int32),
            # One counter per m-block of the smallest BLOCK_M tier: max_pool_rows >= every entry plus
            # POOL_ALIGN_M - 1 rows per expert that has any, so this is >= any routing's m-blocks.
            ("l1_done", (num_mblocks,), torch.int32),
            ("rows_arrived", (num_mblocks,), torch.int32),
            ("pool_x", (p, h), torch.float8_e4m3fn),
            ("pool_sf", (h // 128, p), torch.float32),
            ("pool_weight", (p,), torch.float32),
            ("pool_src", (p, 2), torch.int32),
            ("act", (p, i), torch.float8_e4m3fn),
            ("act_sf", (i // 128, p), torch.float32),
            ("combine", (n, k, h), torch.bfloat16),
            ("combine_arrived", (n,), torch.int32),
        ]
        self.regions: Dict[str, Region] = {}
        offset = 0
        for name, dims, dtype in specs:
            region = Region(offset, dims, dtype)
            self.regions[name] = region
            offset = _round_up(offset + region.nbytes, _REGION_ALIGN)
        self.total_bytes = offset

    def offsets(self) -> Dict[str, int]:
        return {name: r.offset for name, r in self.regions.items()}


def get_symm_buffer_size(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                         hidden: int, intermediate_size: int, pool_rows: Optional[int] = None,
                         num_shared_experts: int = 0) -> int:
    """Bytes of symmetric memory each rank allocates for this shape (the kernel's whole workspace:
    it allocates nothing else). pool_rows, num_shared_experts: see BufferShape."""
    shape = BufferShape.of_routed(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                  intermediate_size, pool_rows, num_shared_experts)
    return BufferLayout(shape).total_bytes


class SymmBuffer:
    """One rank's symmetric buffer plus the peers' addresses of theirs.

    `x`, `x_sf`, `topk_idx`, `topk_weights` are views the caller fills for the first n
    tokens before `fp8_mega_moe` (or lets `stage_inputs` fill them); `mark_staged(n)` lets
    the call check that y has no more rows than were filled.

    Usually made by `get_symm_buffer`; constructed directly, `storage` is this rank's
    zeroed uint8 buffer of `get_symm_buffer_size(...)` bytes and `peer_ptrs[r]` the address
    at which this process sees rank r's (its own at `rank`), e.g. mapped through CUDA IPC.
    `group` is the process group the ranks belong to (warmup ends with a barrier over it).
    """

    def __init__(self, shape: BufferShape, storage: torch.Tensor, rank: int, peer_ptrs: Tuple[int, ...],
                 group=None, symm_handle=None, num_sms: Optional[int] = None):
        layout = BufferLayout(shape)
        if storage.dtype != torch.uint8 or storage.dim() != 1 or storage.numel() < layout.total_bytes:
            raise ValueError(f"storage must be a 1-D uint8 tensor of at least {layout.total_bytes} bytes, got "
                             f"{storage.dtype} {list(storage.shape)}")
        if not 0 <= rank < shape.num_ranks:
            raise ValueError(f"rank={rank} is outside [0, num_ranks={shape.num_ranks})")
        if len(peer_ptrs) != shape.num_ranks:
            raise ValueError(f"peer_ptrs must hold num_ranks={shape.num_ranks} addresses, got {len(peer_ptrs)}")
        self.shape = shape
        # CTAs of this rank's persistent grid; None: every SM (or MEGAMOE_NUM_SMS).
        self.num_sms = num_sms
        self.layout = layout
        self.storage = storage
        self.rank = rank
        self.peer_ptrs = tuple(int(p) for p in peer_ptrs)
        self.group = group
        self._symm_handle = symm_handle  # keeps the symmetric allocation's handle alive
        for name in ("x", "x_sf", "topk_idx", "topk_weights"):
            setattr(self, name, self.view(name))
        self.closed = False
        self._staged_tokens: Optional[int] = None  # mark_staged's count, until the next call takes it
        self._last_stream: Optional[torch.cuda.Stream] = None  # of the latest eager work (order_after_last_use)
        # What others built for this buffer (ops: kernel params and their device memory) is
        # released through these, at close() or when the buffer is collected. Not at exit:
        # the process frees everything then, and the CUDA context may already be gone.
        self._releasers: List[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, _run_releasers, self._releasers)
        self._finalizer.atexit = False
        # An int that names this buffer where a Python object cannot go: the arguments of the
        # torch custom op (megamoe_plugin/custom_op.py), which resolves it with buffer_of.
        self.key = next(_buffer_keys)
        _live_buffers[self.key] = self

    def mark_staged(self, num_tokens: int) -> None:
        """Records that the first `num_tokens` rows of x / x_sf / topk_idx / topk_weights hold the next
        call's inputs; the next `fp8_mega_moe` on this buffer refuses a y with more rows (they would
        run on stale inputs). `stage_inputs` calls it; a caller that writes the views itself may."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        self._staged_tokens = num_tokens

    def take_staged_tokens(self) -> Optional[int]:
        """The count of the latest mark_staged since the previous call, or None; the call takes it
        (a later call on inputs written without mark_staged is not held to it)."""
        staged, self._staged_tokens = self._staged_tokens, None
        return staged

    def on_close(self, release: Callable[[], None]) -> None:
        """Runs `release()` when the buffer is closed or garbage-collected. It must not refer
        to the buffer (that would keep it alive)."""
        self._releasers.append(release)

    def close(self, graphs_released: bool = False) -> None:
        """Frees what was built for this buffer and drops its memory. No kernel that uses
        the buffer may still be running, and no CUDA graph that captured a call on it be
        replayed afterwards: a buffer that graph capture used (ops.fp8_mega_moe marks it) is
        refused unless `graphs_released` says every such graph is gone, since a replay would
        read freed memory and write into memory reused by then. Until then such a buffer also
        outlives its last reference. Calls on a closed buffer raise; closing again does nothing.
        Per rank: in a group, every rank closes its own, after a point that every rank's last
        call on it has passed (e.g. a barrier after a synchronize), since peers read it."""
        if self.closed:
            return
        if self.key in _captured_buffers and not graphs_released:
            raise RuntimeError("close(): a CUDA graph captured calls on this buffer; replaying it after close would "
                               "read freed memory. Drop every such graph, then call close(graphs_released=True)")
        _captured_buffers.pop(self.key, None)
        self._finalizer()
        self.closed = True
        self.storage = self._symm_handle = None
        for name in ("x", "x_sf", "topk_idx", "topk_weights"):
            setattr(self, name, None)

    def order_after_last_use(self) -> None:
        """Work on the buffer (staging inputs, a call) must not overlap other work on it: a call
        zeroes what the previous one still counts, and staging overwrites the inputs a call reads.
        Eager work issued on another stream than the buffer's previous work waits (an event) for
        all that stream has issued so far, so two streams or threads that share a buffer use it
        one after another. Nothing inside graph capture: replays run in the replaying streams' order."""
        if torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(self.device)
        if self._last_stream is not None and self._last_stream != stream:
            event = torch.cuda.Event()
            event.record(self._last_stream)
            stream.wait_event(event)
        self._last_stream = stream

    def mark_captured(self) -> None:
        """A CUDA graph captured a call on this buffer: it stays alive, and close() refuses, until
        close(graphs_released=True)."""
        _captured_buffers[self.key] = self

    def view(self, name: str) -> torch.Tensor:
        region = self.layout.regions[name]
        raw = self.storage[region.offset: region.offset + region.nbytes]
        return raw.view(region.dtype).view(region.shape)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    # Shape accessors, named as in the public API: the routed experts and slots (the kernel's, shared
    # ones included, are the shape's).
    num_ranks = property(lambda self: self.shape.num_ranks)
    num_experts = property(lambda self: self.shape.num_routed_experts)
    num_local_experts = property(lambda self: self.shape.num_local_experts - self.shape.num_shared_experts)
    num_shared_experts = property(lambda self: self.shape.num_shared_experts)
    num_max_tokens_per_rank = property(lambda self: self.shape.num_max_tokens_per_rank)
    num_topk = property(lambda self: self.shape.num_routed_topk)
    hidden = property(lambda self: self.shape.hidden)
    intermediate_size = property(lambda self: self.shape.intermediate_size)

    def __repr__(self) -> str:
        s = self.shape
        return (f"SymmBuffer(rank={self.rank}/{s.num_ranks}, experts={s.num_experts}, "
                f"max_tokens={s.num_max_tokens_per_rank}, topk={s.num_topk}, hidden={s.hidden}, "
                f"intermediate={s.intermediate_size}, bytes={self.layout.total_bytes}, device={self.device})")


_buffer_keys = itertools.count()
# Weak: the registry must not keep a buffer (and its GPU memory) alive.
_live_buffers: "weakref.WeakValueDictionary[int, SymmBuffer]" = weakref.WeakValueDictionary()
# Strong: a buffer that a CUDA graph captured calls on, whose replays need its memory (SymmBuffer.mark_captured).
_captured_buffers: Dict[int, SymmBuffer] = {}


def check_open_buffer(buf) -> None:
    """`buf` as a call or its staging takes it: a SymmBuffer (else TypeError) that is not closed
    (else ValueError)."""
    if not isinstance(buf, SymmBuffer):
        raise TypeError(f"buf must be a SymmBuffer from get_symm_buffer, got {type(buf).__name__}")
    if buf.closed:
        raise ValueError("buf was closed (SymmBuffer.close); allocate a new one")


def buffer_of(key: int) -> SymmBuffer:
    """The live SymmBuffer whose `key` this is."""
    buf = _live_buffers.get(key)
    if buf is None:
        raise ValueError(f"buffer_key={key} names no live SymmBuffer (it was garbage-collected, or the key is not one)")
    return buf


def _run_releasers(releasers: List[Callable[[], None]]) -> None:
    while releasers:
        releasers.pop()()


def get_local_rank_buffers(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                           hidden: int, intermediate_size: int, device=None, pool_rows: Optional[int] = None,
                           num_shared_experts: int = 0) -> Tuple[SymmBuffer, ...]:
    """R ranks' buffers on one GPU, for testing the cross-rank protocol without more GPUs:
    rank r's kernel must run concurrently with the others (its own stream) on its share of
    the SMs, which each buffer's `num_sms` records. pool_rows, num_shared_experts: see BufferShape."""
    shape = BufferShape.of_routed(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                  intermediate_size, pool_rows, num_shared_experts)
    layout = BufferLayout(shape)
    device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
    storages = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(num_ranks)]
    peer_ptrs = tuple(s.data_ptr() for s in storages)
    sms = torch.cuda.get_device_properties(device).multi_processor_count // num_ranks
    return tuple(SymmBuffer(shape, storage, r, peer_ptrs, num_sms=sms) for r, storage in enumerate(storages))


def get_symm_buffer(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                    intermediate_size: int, device: Optional[torch.device] = None,
                    pool_rows: Optional[int] = None, num_shared_experts: int = 0) -> SymmBuffer:
    """Allocate (collectively, when `group` is given) the symmetric buffer for this shape.

    group: a torch.distributed ProcessGroup whose ranks share NVLink, or None for one GPU.
    num_experts, num_topk: the routed experts and slots per token.
    device: where the buffer lives; defaults to the current CUDA device. A CPU buffer is
    accepted for staging tests only: `fp8_mega_moe` refuses it.
    pool_rows: the pools' rows (BufferShape); the default bounds the memory of any routing.
    num_shared_experts: shared experts every token passes through (docs/design.md section 2), of
    the routed experts' intermediate size; the call's weights then hold them after the routed
    ones (transform_weights(..., shared=...)) and stage_inputs adds their slots.
    """
    if group is None:
        num_ranks, rank = 1, 0
    else:
        import torch.distributed as dist

        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None (one GPU), got "
                            f"{type(group).__name__}")
        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = BufferShape.of_routed(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                  intermediate_size, pool_rows, num_shared_experts)
    layout = BufferLayout(shape)
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("get_symm_buffer: no CUDA device is available; pass device='cpu' "
                               "only for staging tests (the kernel needs an SM90 GPU)")
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)

    if group is None:
        storage = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        return SymmBuffer(shape, storage, 0, (storage.data_ptr(),))

    if device.type != "cuda":
        raise ValueError(f"get_symm_buffer: a multi-rank buffer must live on a CUDA device, got {device}")
    import torch.distributed._symmetric_memory as symm_mem

    storage = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(storage, group)
    storage.zero_()
    handle.barrier()
    peer_ptrs = tuple(int(p) for p in handle.buffer_ptrs)
    return SymmBuffer(shape, storage, rank, peer_ptrs, group=group, symm_handle=handle)
