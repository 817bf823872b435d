"""The cross-rank protocol over real NVLink: `torchrun --nproc-per-node 2 -m
tests.gpu.multi_rank` (symmetric memory, one process per GPU), judged against the exact reference."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() != (9, 0),
    reason="needs two SM90 GPUs with NVLink")


@pytest.fixture(scope="module")
def torchrun_lines():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "tests.gpu.multi_rank"], capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    print("\n".join(lines))
    assert lines, f"torchrun produced no result lines:\n{proc.stderr[-4000:]}"
    return lines


def test_two_gpus(torchrun_lines):
    failures = [line for line in torchrun_lines if not line.endswith(" ok")]
    assert not failures, "\n".join(failures)
