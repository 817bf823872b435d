"""What a long-running server relies on in the op layer, on the CPU with the host runtime
replaced by a recording fake: warm-up builds every layer's params and ends with a group
barrier, capture never compiles or builds params (it raises instead), the params cache
follows the peer pointers and frees itself with the buffer, bad expert ids are raised
once per new count, and the watchdog logs a kernel failure and dropped ids without any
synchronize."""
import contextlib
import gc
import logging
import threading
import time
import types

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin import native, ops, reports, validation
from megamoe_plugin.buffer import BufferShape, SymmBuffer, get_symm_buffer_size
from megamoe_plugin.serving import PACKAGE_LOGGER
from megamoe_plugin.testing import random_layer
from megamoe_plugin.watchdog import Watchdog

E, N, K, H, I = 8, 256, 2, 256, 256
# Token counts that select more than one BLOCK_M tier on an H200 (the heuristic's table).
COUNTS = [1, 8, 64, 256]


class FakeRuntime:
    """Records what the op layer asks the host runtime for; the host words are plain fields."""

    def __init__(self, events):
        self.events = events
        self.kernels = []
        self.window_names = []  # per kernel: its window kernel's entry, "" for none
        self.params = {}
        self.freed = []
        self.launches = []
        self.window_launches = []
        self.error_word = 0
        self.bad_expert_ids = 0
        self.error_detail = 0

    def load_kernel(self, cubin_path, name, smem_bytes, window_name=""):
        self.events.append(("load", cubin_path))
        self.kernels.append(cubin_path)
        self.window_names.append(window_name)
        return len(self.kernels) - 1

    def make_params(self, peer_ptrs, rank, offsets, pool_capacity, hidden, intermediate_size, num_local_experts,
                    block_m, w13, w13_scale, w2, w2_scale, timeout_s, mxfp4_weights=False):
        handle = len(self.params) + len(self.freed)
        self.events.append(("params", handle))
        self.params[handle] = dict(peer_ptrs=tuple(peer_ptrs), rank=rank, block_m=block_m, w13=w13,
                                   mxfp4_weights=mxfp4_weights)
        return handle

    def free_params(self, handle):
        del self.params[handle]
        self.freed.append(handle)

    def launch(self, kernel, params, *args):
        self.launches.append((kernel, params))
        self.window_launches.append(args[-1])  # launch's last argument: the window kernel's launches

    def read_error_word(self):
        return self.error_word

    def read_bad_expert_ids(self):
        return self.bad_expert_ids

    def read_error_detail(self):
        return self.error_detail


@pytest.fixture
def fake(monkeypatch):
    """The op layer on the CPU: a fake runtime and compiler, an H200's name and grid, fresh
    caches, and a switch for 'the current stream is capturing'."""
    events = []
    runtime = FakeRuntime(events)
    capturing = types.SimpleNamespace(on=False)

    def compiled(variant):
        return types.SimpleNamespace(variant=variant, cubin=f"/cache/{variant.name()}.cubin", smem_bytes=1)

    monkeypatch.setattr(native, "runtime", lambda: runtime)
    monkeypatch.setattr(validation, "require_sm90", lambda device: None)
    monkeypatch.setattr(ops, "_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(ops, "_grid_size", lambda buf: 132)
    monkeypatch.setattr(ops, "compile_variant", lambda variant, verbose=False: compiled(variant))
    monkeypatch.setattr(ops, "compile_variants", lambda variants, on_done=None: [compiled(v) for v in variants])
    monkeypatch.setattr(ops, "_kernels", {})
    monkeypatch.setattr(ops, "_launches", {})
    monkeypatch.setattr(ops, "_variants", {})
    monkeypatch.setattr(reports, "_bad_expert_ids_raised", 0)
    monkeypatch.setattr(reports, "_kernel_names", {})
    watchdog = Watchdog(runtime.read_error_word, runtime.read_bad_expert_ids, reports.describe_error,
                        reports.describe_bad_expert_ids, interval_s=0.02)
    monkeypatch.setattr(reports, "watchdog", watchdog)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing.on)
    monkeypatch.delenv("MEGAMOE_BLOCK_M", raising=False)
    yield types.SimpleNamespace(runtime=runtime, events=events, capturing=capturing, watchdog=watchdog)
    watchdog.stop()


def _layer(seed):
    return random_layer(E, H, I, "cpu", torch.Generator().manual_seed(seed))


def _buffer(num_ranks=1, group=None, pool_rows=None):
    """This rank's (0) buffer; for num_ranks > 1 the peers' addresses are stand-ins."""
    shape = BufferShape(num_ranks, E * num_ranks, N, K, H, I, pool_rows)
    storage = torch.zeros(get_symm_buffer_size(num_ranks, E * num_ranks, N, K, H, I, pool_rows), dtype=torch.uint8)
    peers = (storage.data_ptr(),) + tuple(0x7000_0000 + r for r in range(1, num_ranks))
    return SymmBuffer(shape, storage, 0, peers, group=group)


def _call(buf, layer, n):
    return mm.fp8_mega_moe(torch.zeros(n, H, dtype=torch.bfloat16), layer.l1, layer.l2, buf)


def test_counts_select_several_tiers(fake):
    tiers = {ops.select_variant(_buffer(), n, True).block_m for n in COUNTS}
    assert len(tiers) > 1, "COUNTS must exercise params of more than one BLOCK_M tier"


def test_warmup_builds_every_layers_params_so_capture_builds_nothing(fake):
    buf, layers = _buffer(), [_layer(s) for s in range(3)]
    ops.warmup(buf, layers[0].l1, layers[0].l2, COUNTS, other_layers=[(la.l1, la.l2) for la in layers[1:]])
    tiers = {ops.select_variant(buf, n, True).block_m for n in COUNTS}
    built = {(p["w13"], p["block_m"]) for p in fake.runtime.params.values()}
    assert built == {(la.l1[0].data_ptr(), bm) for la in layers for bm in tiers}
    loaded, params = len(fake.runtime.kernels), len(fake.runtime.params)
    fake.capturing.on = True
    for layer in layers:
        for n in COUNTS:
            _call(buf, layer, n)
    assert (len(fake.runtime.kernels), len(fake.runtime.params)) == (loaded, params)
    assert len(fake.runtime.launches) == len(layers) * len(COUNTS)


def test_windowed_buffers_load_and_launch_the_window_kernel(fake):
    """On pools that hold fewer rows than the worst routing, the op loads each variant with its
    window kernel and launches it as often as BufferShape.window_kernel_launches says for the tier;
    on other pools neither."""
    from megamoe_plugin.kernel_variant import WINDOW_KERNEL_NAME

    layer = _layer(0)
    for buf in (_buffer(), _buffer(pool_rows=128)):
        for n in COUNTS:
            _call(buf, layer, n)
            variant = ops.select_variant(buf, n, True)
            assert variant.windowed == buf.shape.windowed
            expected = buf.shape.window_kernel_launches(variant.block_m)
            assert fake.runtime.window_launches[-1] == expected and (expected > 0) == buf.shape.windowed
    windowed = {name for name in fake.runtime.window_names if name}
    assert windowed == {WINDOW_KERNEL_NAME} and "" in fake.runtime.window_names


def test_capture_that_would_compile_or_build_params_raises(fake):
    buf, layer, other = _buffer(), _layer(0), _layer(1)
    fake.capturing.on = True
    with pytest.raises(RuntimeError, match=r"would compile and load kernel h256.*inside CUDA-graph capture.*warmup"):
        _call(buf, layer, 8)
    assert not fake.runtime.kernels
    fake.capturing.on = False
    ops.warmup(buf, layer.l1, layer.l2, [8])
    fake.capturing.on = True
    _call(buf, layer, 8)
    with pytest.raises(RuntimeError, match=r"would build kernel parameters.*inside CUDA-graph capture.*other_layers"):
        _call(buf, other, 8)
    assert len(fake.runtime.params) == 1


def test_params_key_covers_the_peer_pointers(fake):
    buf, layer = _buffer(num_ranks=2), _layer(0)
    first = ops._params_handle(buf, layer.l1, layer.l2, 64)
    assert ops._params_handle(buf, layer.l1, layer.l2, 64) == first
    buf.peer_ptrs = (buf.peer_ptrs[0], buf.peer_ptrs[1] + 4096)  # a peer's buffer moved
    second = ops._params_handle(buf, layer.l1, layer.l2, 64)
    assert second != first and fake.runtime.params[second]["peer_ptrs"] == buf.peer_ptrs


def test_close_frees_the_params_and_refuses_calls(fake):
    buf, layer = _buffer(), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, COUNTS)
    handles = set(fake.runtime.params)
    assert handles and id(buf) in ops._launches
    buf.close()
    assert set(fake.runtime.freed) == handles and not fake.runtime.params and id(buf) not in ops._launches
    buf.close()  # again: nothing left to free
    assert len(fake.runtime.freed) == len(handles)
    with pytest.raises(ValueError, match="buf was closed"):
        _call(buf, layer, 1)


def test_a_collected_buffer_frees_its_params(fake):
    buf, layer = _buffer(), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, [1])
    buffer_id = id(buf)
    del buf
    gc.collect()
    assert len(fake.runtime.freed) == 1 and not fake.runtime.params and buffer_id not in ops._launches


@pytest.fixture
def group_of_two(fake, monkeypatch):
    """A stand-in two-rank group (this is rank 0) whose all-reduce records its calls and adds
    the peer's warm-up flag, `peer_failed`."""
    import torch.distributed as dist

    group = types.SimpleNamespace(peer_failed=False, reduced=[])
    monkeypatch.setattr(dist, "get_backend", lambda g: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda g: 2)
    monkeypatch.setattr(dist, "get_rank", lambda g: 0)

    def all_reduce(tensor, group=None):
        fake.events.append(("all_reduce", group))
        group.reduced.append(tensor.tolist())
        tensor[1] += int(group.peer_failed)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return group


def test_warmup_ends_with_the_group_agreement(fake, group_of_two):
    buf, layer, other = _buffer(num_ranks=2, group=group_of_two), _layer(0), _layer(1)
    ops.warmup(buf, layer.l1, layer.l2, COUNTS, other_layers=[(other.l1, other.l2)])
    assert fake.events[-1] == ("all_reduce", group_of_two)  # after every load and params build
    assert group_of_two.reduced == [[0, 0]]


def test_warmup_raises_on_every_rank_when_one_rank_fails(fake, group_of_two, monkeypatch):
    buf, layer = _buffer(num_ranks=2, group=group_of_two), _layer(0)
    group_of_two.peer_failed = True
    with pytest.raises(RuntimeError, match=r"the warm-up failed on rank 1 of the buffer's group"):
        ops.warmup(buf, layer.l1, layer.l2, COUNTS)
    # This rank's own failure: it tells the peer (its flag), then raises its own error.
    group_of_two.peer_failed = False
    monkeypatch.setattr(ops, "_kernels", {})
    monkeypatch.setattr(ops, "compile_variants", lambda variants, on_done=None: [RuntimeError("nvcc: boom")])
    with pytest.raises(RuntimeError, match="nvcc: boom"):
        ops.warmup(buf, layer.l1, layer.l2, [COUNTS[0]])
    assert group_of_two.reduced[-1] == [1, 0]


def test_warmup_without_a_group_has_no_agreement(fake, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("a one-rank buffer needs no agreement"))
    layer = _layer(0)
    ops.warmup(_buffer(), layer.l1, layer.l2, COUNTS)


def test_bad_expert_ids_raise_once_per_new_count_and_wait_out_a_capture(fake):
    buf, layer = _buffer(), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, [4])
    fake.runtime.bad_expert_ids = 3
    with pytest.raises(ValueError, match=r"3 topk_idx entries outside \[-1, num_experts\)"):
        _call(buf, layer, 4)
    _call(buf, layer, 4)  # reported: the counter is not cleared, the raise remembers
    fake.runtime.bad_expert_ids = 4
    fake.capturing.on = True
    _call(buf, layer, 4)  # a graph replay's error waits for the next eager call
    fake.capturing.on = False
    with pytest.raises(ValueError, match=r"1 topk_idx entry outside"):
        _call(buf, layer, 4)
    _call(buf, layer, 4)


def test_describe_error_names_the_wait_the_rank_and_the_variant(fake):
    buf, layer = _buffer(num_ranks=2), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, [1, 64])
    variant = ops.select_variant(buf, 64, True)
    tag = ops._kernels[(None, variant)]
    message = reports.describe_error((16 + 0) | 1 << 8 | tag << 16)  # kErrRankNotArrived + 0, seen by rank 1
    assert message.startswith("megamoe kernel timed out waiting on the cross-rank barrier: rank 0 never arrived")
    assert f"rank 1, kernel {variant.name()}" in message and "restart the process" in message


@pytest.mark.parametrize("own, other, differs, made", [
    (reports.call_tag(5, "fast", True), reports.call_tag(6, "fast", True), "the layer", "rank 0 made layer 6"),
    (reports.call_tag(5, "fast", True), reports.call_tag(5, "exact", True), "the numerics mode", "numerics exact"),
    (reports.call_tag(5, "fast", True), reports.call_tag(0, "fast", False, refused=True), "a refused call",
     "rank 0 made a refused call"),
])
def test_describe_error_names_both_ranks_of_a_call_mismatch(fake, own, other, differs, made):
    fake.runtime.error_detail = 8 | 0 << 8 | own << 16 | other << 40  # abi.h kDetail*: code, peer, the two tags
    message = reports.describe_error(8 | 1 << 8)
    assert message.startswith("megamoe kernel stopped at the cross-rank barrier's call check; rank 1")
    assert f"differ in {differs}: rank 1 made " in message and made in message


def test_a_mismatch_stored_by_another_rank_of_the_process_names_only_the_peer(fake):
    """Side-by-side ranks share the host words: the error word may be rank 1's and the detail
    rank 2's, naming rank 1 as its peer. The report then does not call rank 1 the maker of the
    other call."""
    own, other = reports.call_tag(6, "fast", True), reports.call_tag(5, "fast", True)
    fake.runtime.error_detail = 8 | 1 << 8 | own << 16 | other << 40
    message = reports.describe_error(8 | 1 << 8)
    assert "differ in the layer: another rank (ranks in this process share the report) made layer 6" in message
    assert "; rank 1 made layer 5" in message


def _wait_for(records, predicate, timeout_s=2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(predicate(r) for r in records):
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def package_records(caplog, monkeypatch):
    """caplog with the package logger's ERROR records: it propagates to caplog's root handler here
    even after a framework plugin's registration in this process routed it (route_logs_to)."""
    monkeypatch.setattr(logging.getLogger(PACKAGE_LOGGER), "propagate", True)
    caplog.set_level(logging.ERROR, logger=PACKAGE_LOGGER)
    return caplog


def test_watchdog_starts_with_the_first_kernel_and_logs_a_failure_once(fake, package_records):
    caplog = package_records
    buf, layer = _buffer(num_ranks=2), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, [8])
    tag = ops._kernels[(None, ops.select_variant(buf, 8, True))]
    fake.runtime.error_word = 17 | 0 << 8 | tag << 16  # as a trapped kernel leaves it; nobody synchronizes
    assert _wait_for(caplog.records, lambda r: "cross-rank barrier" in r.getMessage())
    time.sleep(0.1)
    failures = [r for r in caplog.records if "timed out" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.ERROR and failures[0].name == "megamoe_plugin"
    assert "rank 0, kernel h256" in failures[0].getMessage()


@pytest.fixture
def device_wait(monkeypatch):
    """torch.cuda.synchronize on the CPU: it returns once `done` is set, raising `error` if one is given."""
    state = types.SimpleNamespace(done=threading.Event(), error=None)

    def synchronize(device=None):
        state.done.wait()
        if state.error is not None:
            raise state.error

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return state


def test_synchronize_raises_a_failed_kernels_report_while_the_driver_still_holds_it(fake, device_wait):
    buf, layer = _buffer(num_ranks=2), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, [8])
    tag = ops._kernels[(None, ops.select_variant(buf, 8, True))]
    threading.Timer(0.2, lambda: setattr(fake.runtime, "error_word", 17 | 1 << 8 | tag << 16)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 never arrived.*rank 1, kernel h256"):
        mm.ops.synchronize()  # the device wait never ends: the kernel's own report is raised
    assert 0.2 + reports._FAULT_GRACE_S <= time.monotonic() - start < 0.2 + reports._FAULT_GRACE_S + 1.0
    device_wait.done.set()


def test_synchronize_turns_the_drivers_error_into_the_kernels_report(fake, device_wait):
    buf, layer = _buffer(num_ranks=2), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, [8])
    tag = ops._kernels[(None, ops.select_variant(buf, 8, True))]
    fake.runtime.error_word = 18 | 0 << 8 | tag << 16
    device_wait.error = RuntimeError("CUDA error: unspecified launch failure")
    device_wait.done.set()
    with pytest.raises(RuntimeError, match="rank 2 never arrived.*rank 0, kernel h256") as raised:
        mm.ops.synchronize()
    assert "unspecified launch failure" in str(raised.value.__cause__)


def test_synchronize_passes_other_errors_and_raises_bad_ids_after_a_clean_wait(fake, device_wait):
    device_wait.error = RuntimeError("CUDA error: out of memory")
    device_wait.done.set()
    with pytest.raises(RuntimeError, match="out of memory"):
        mm.ops.synchronize()
    device_wait.error = None
    mm.ops.synchronize()
    fake.runtime.bad_expert_ids = 3
    with pytest.raises(ValueError, match="megamoe: 3 topk_idx entries"):
        mm.ops.synchronize()
    mm.ops.synchronize()  # reported once


def test_watchdog_logs_each_new_count_of_bad_expert_ids(fake, package_records):
    caplog = package_records
    fake.watchdog.poll()
    fake.runtime.bad_expert_ids = 5
    fake.watchdog.poll()
    fake.watchdog.poll()
    fake.runtime.bad_expert_ids = 7
    fake.watchdog.poll()
    assert [r.getMessage().split(" topk_idx")[0] for r in caplog.records] == ["megamoe: 5", "megamoe: 2"]


def test_symm_buffer_constructor_names_bad_arguments():
    shape = BufferShape(2, 2 * E, N, K, H, I)
    storage = torch.zeros(get_symm_buffer_size(2, 2 * E, N, K, H, I), dtype=torch.uint8)
    with pytest.raises(ValueError, match="storage must be a 1-D uint8 tensor of at least"):
        SymmBuffer(shape, storage[:-1], 0, (storage.data_ptr(), 1))
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, num_ranks=2\)"):
        SymmBuffer(shape, storage, 2, (storage.data_ptr(), 1))
    with pytest.raises(ValueError, match="peer_ptrs must hold num_ranks=2 addresses, got 1"):
        SymmBuffer(shape, storage, 0, (storage.data_ptr(),))
