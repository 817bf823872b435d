"""The raw API's buffer lifetime on the CPU (issue: a buffer used wrongly fails by name, never
silently): arguments that are no buffer or group are named; a buffer that graph capture used
refuses close() until its graphs are released, and lives until then; a buffer refuses to grow
its kernel params without bound. tests/gpu/test_buffer_lifetime.py runs the GPU side (two
streams on one buffer, close after capture)."""
import gc

import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin import buffer, ops

from test_serving import _buffer, _call, _layer, fake  # noqa: F401  (the fake op layer and its fixture)


def test_get_symm_buffer_names_a_group_that_is_no_process_group():
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None .*got str"):
        mm.get_symm_buffer("x", 8, 16, 2, 256, 256, device="cpu")


def test_stage_inputs_names_a_buf_that_is_no_buffer():
    hs, ids, weights = torch.zeros(2, 256), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    with pytest.raises(TypeError, match="buf must be a SymmBuffer from get_symm_buffer, got NoneType"):
        mm.stage_inputs(None, hs, ids, weights)
    buf = mm.get_symm_buffer(None, 8, 16, 2, 256, 256, device="cpu")
    buf.close()
    with pytest.raises(ValueError, match="buf was closed"):
        mm.stage_inputs(buf, hs, ids, weights)


def test_a_captured_buffer_refuses_close_and_lives_until_its_graphs_are_released():
    buf = mm.get_symm_buffer(None, 8, 16, 2, 256, 256, device="cpu")
    buf.mark_captured()
    with pytest.raises(RuntimeError, match=r"a CUDA graph captured calls on this buffer.*close\(graphs_released=True\)"):
        buf.close()
    assert not buf.closed
    key = buf.key
    del buf
    gc.collect()
    live = buffer.buffer_of(key)  # a graph may still replay it: its memory stays
    live.close(graphs_released=True)
    assert live.closed and key not in buffer._captured_buffers


def test_a_call_inside_capture_marks_the_buffer_captured(fake):
    buf, layer = _buffer(), _layer(0)
    ops.warmup(buf, layer.l1, layer.l2, [4])
    fake.capturing.on = True
    _call(buf, layer, 4)
    fake.capturing.on = False
    with pytest.raises(RuntimeError, match="a CUDA graph captured calls on this buffer"):
        buf.close()
    buf.close(graphs_released=True)


def test_params_are_bounded_per_buffer(fake, monkeypatch):
    monkeypatch.setattr(ops, "MAX_PARAMS_PER_BUFFER", 2)
    buf = _buffer()
    for seed in range(2):
        layer = _layer(seed)
        _call(buf, layer, 4)
    with pytest.raises(RuntimeError, match="Reloading weights on a buffer is not supported"):
        _call(buf, _layer(2), 4)
