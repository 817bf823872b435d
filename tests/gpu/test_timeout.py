"""A protocol failure ends in a Python RuntimeError that names the wait, within the
timeout, never a hang. Rank 0 of a two-rank group runs alone, so its cross-rank
barrier can never complete. Runs in a subprocess: the trap ends that CUDA context."""
import os
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import torch, megamoe_plugin as mm
    from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer
    gen = torch.Generator(device="cuda").manual_seed(0)
    bufs = mm.buffer.get_local_rank_buffers(2, 8, 16, 2, 384, 256)
    layer = random_layer(4, 384, 256, "cuda", gen)
    fill_buffer(bufs[0], random_inputs(16, 384, 8, 2, "uniform", "cuda", gen))
    y = torch.empty(16, 384, dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, bufs[0])  # rank 1 never runs
    mm.ops.synchronize()
""")


def test_missing_peer_times_out_with_named_wait():
    env = dict(os.environ, MEGAMOE_TIMEOUT_S="2")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.monotonic() - start
    print(proc.stderr[-2000:])
    assert proc.returncode != 0
    assert "RuntimeError: megamoe kernel timed out waiting on the cross-rank barrier" in proc.stderr
    assert elapsed < 60
