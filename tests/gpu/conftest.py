"""Every test in tests/gpu needs an SM90 (Hopper) GPU: on any other machine they are
skipped with that reason (test_two_gpus.py also needs a second GPU)."""
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if has_sm90():
        return
    skip = pytest.mark.skip(reason="needs an SM90 (Hopper) GPU")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
