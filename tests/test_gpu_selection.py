"""Kernel selection on SM90 parts this project has not measured, with mocked device properties: an
H20's 78 SMs, an H100 PCIe's 114, the 132 of the H100 SXM and the H200, and a MIG slice of 60. The
GPU's name picks a tuned table only where one ships for that exact name; every other part runs the
heuristic, its grid is the GPU's own SM count (MEGAMOE_NUM_SMS may only lower it), and every
selected variant fits the shared memory the GPU offers a block."""
import json
import types

import pytest
import torch

from megamoe_plugin import configs, heuristics, ops
from megamoe_plugin.buffer import BufferShape, SymmBuffer, get_symm_buffer_size
from megamoe_plugin.configs import REFERENCE_SHAPES, REFERENCE_TOKENS_PER_RANK

# (name as torch reports it, SMs); the opt-in shared memory per block is 227 KiB on every SM90 part.
GPUS = [("NVIDIA H20", 78), ("NVIDIA H100 PCIe", 114), ("NVIDIA H100 80GB HBM3", 132), ("NVIDIA H200", 132),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 60)]  # a MIG slice: its own name, so no table
SMEM_OPTIN = 232448
TOKENS = sorted(set(REFERENCE_TOKENS_PER_RANK) | {3, 17, 100, 300, 1000, 5000})


@pytest.fixture
def gpu(monkeypatch, request):
    name, sms = request.param
    props = types.SimpleNamespace(name=name, multi_processor_count=sms, shared_memory_per_block_optin=SMEM_OPTIN)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda idx=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx=None: props)
    for cache in ("_device_names", "_device_sms", "_variants"):
        monkeypatch.setattr(ops, cache, {})
    for var in ("MEGAMOE_NUM_SMS", "MEGAMOE_BLOCK_M", "MEGAMOE_NUM_STAGES", "MEGAMOE_CONFIGS_DIR"):
        monkeypatch.delenv(var, raising=False)
    return props


def _buffer(shape: configs.TableShape, max_tokens: int) -> SymmBuffer:
    """One rank's buffer of a reference shape (its local experts are the whole set at R = 1)."""
    args = (1, shape.num_local_experts, max_tokens, shape.num_topk, shape.hidden, shape.intermediate_size)
    storage = torch.zeros(get_symm_buffer_size(*args), dtype=torch.uint8)
    return SymmBuffer(BufferShape(*args), storage, 0, (storage.data_ptr(),))


def _shipped_table(name: str, shape: configs.TableShape, numerics: str):
    path = configs.table_path(name)
    if not path.exists():
        return None
    return configs.validate_table(json.loads(path.read_text()), str(path)).find(shape, numerics)


@pytest.mark.parametrize("gpu", GPUS, indirect=True, ids=[f"{name}-{sms}" for name, sms in GPUS])
@pytest.mark.parametrize("numerics", heuristics.NUMERICS_MODES)
def test_selection_follows_the_gpus_table_or_the_heuristic(gpu, numerics):
    for config_name, shape in REFERENCE_SHAPES.items():
        buf = _buffer(shape, 8)  # the selection reads the shape, not max_tokens
        table = _shipped_table(gpu.name, shape, numerics)
        for tokens in TOKENS:
            variant = ops.select_variant(buf, tokens, True, numerics)
            expected = heuristics.expected_tokens_per_expert(tokens, 1, shape.num_topk, shape.num_local_experts)
            if table is not None:
                entry = table.nearest(expected)
                want = (entry.block_m, entry.num_stages)
            else:
                heuristic = heuristics.default_config(1, shape.num_local_experts, shape.num_topk, shape.hidden,
                                                      shape.intermediate_size, tokens, gpu.multi_processor_count,
                                                      numerics)
                want = (heuristic.block_m, heuristic.num_stages)
            assert (variant.block_m, variant.num_stages) == want, (config_name, tokens)
            assert variant.block_m in heuristics.implemented_block_m(numerics)
            assert heuristics.smem_bytes(variant.block_m, variant.num_stages, shape.num_local_experts,
                                         numerics) <= gpu.shared_memory_per_block_optin
        buf.close()


def test_only_the_measured_gpus_ship_tables():
    shipped = {path.name for path in configs.CONFIGS_DIR.glob("*.json")}
    assert shipped == {"NVIDIA_H200.json", "NVIDIA_H100_80GB_HBM3.json"}
    assert configs.load_table("NVIDIA H20") is None and configs.load_table("NVIDIA H100 PCIe") is None


@pytest.mark.parametrize("gpu", GPUS, indirect=True, ids=[f"{name}-{sms}" for name, sms in GPUS])
def test_the_grid_is_the_gpus_sm_count_and_num_sms_only_lowers_it(gpu, monkeypatch):
    buf = _buffer(REFERENCE_SHAPES["v4flash"], 64)
    assert ops._grid_size(buf) == gpu.multi_processor_count
    for forced, grid in ((gpu.multi_processor_count - 8, gpu.multi_processor_count - 8), (1, 1),
                         (1000, gpu.multi_processor_count)):
        monkeypatch.setattr(ops, "_device_sms", {})
        monkeypatch.setenv("MEGAMOE_NUM_SMS", str(forced))
        assert ops._grid_size(buf) == grid
    buf.close()
