"""A protocol failure names its wait, never a hang. Rank 0 of a two-rank group runs alone,
so its cross-rank barrier can never complete. Each case runs in a subprocess: the trap
ends that CUDA context.

- With ops.synchronize(): a Python RuntimeError that names the wait.
- With no synchronize at all (what a server replaying CUDA graphs does): the watchdog's
  ERROR line on the "megamoe_plugin" logger names the wait, the rank and the kernel
  variant within a few seconds of the bound, while the process just sleeps.
"""
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

BOUND_S = 2  # MEGAMOE_TIMEOUT_S for both cases

SETUP = textwrap.dedent("""
    import logging, sys, time
    import torch, megamoe_plugin as mm
    from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bufs = mm.buffer.get_local_rank_buffers(2, 8, 16, 2, 384, 256)
    layer = random_layer(4, 384, 256, "cuda", gen)
    fill_buffer(bufs[0], random_inputs(16, 384, 8, 2, "uniform", "cuda", gen))
    y = torch.empty(16, 384, dtype=torch.bfloat16, device="cuda")
    mm.ops.warmup(bufs[0], layer.l1, layer.l2, [16])  # compiling and loading are not part of the timing
    torch.cuda.synchronize()
    mm.fp8_mega_moe(y, layer.l1, layer.l2, bufs[0])  # rank 1 never runs
    variant = mm.ops.select_variant(bufs[0], 16, True, mm.ops.resolve_numerics(None))
    print("launched", variant.name(), file=sys.stderr, flush=True)
""")

WITH_SYNCHRONIZE = SETUP + "mm.ops.synchronize()\n"
WITHOUT_SYNCHRONIZE = SETUP + "time.sleep(60)\n"  # no CUDA call after the launch


def _env():
    return dict(os.environ, MEGAMOE_TIMEOUT_S=str(BOUND_S), PYTHONUNBUFFERED="1")


def test_missing_peer_times_out_with_named_wait():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WITH_SYNCHRONIZE], capture_output=True, text=True, env=_env(),
                          timeout=120)
    elapsed = time.monotonic() - start
    print(proc.stderr[-2000:])
    assert proc.returncode != 0
    assert "RuntimeError: megamoe kernel timed out waiting on the cross-rank barrier: rank 1 never arrived" in proc.stderr
    assert elapsed < 60


def test_timeout_is_logged_without_synchronize():
    """The named ERROR line reaches stderr from the watchdog thread alone."""
    proc = subprocess.Popen([sys.executable, "-c", WITHOUT_SYNCHRONIZE], stderr=subprocess.PIPE, text=True,
                            env=_env())
    lines = []  # (seconds since start, line)
    start = time.monotonic()

    def read():
        for line in proc.stderr:
            lines.append((time.monotonic() - start, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = start + 120
        while time.monotonic() < deadline and not any("ERROR megamoe_plugin:" in line for _, line in lines):
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
    print("\n".join(f"{t:7.2f}s {line}" for t, line in lines[-30:]))
    launched = [(t, line.split()[1]) for t, line in lines if line.startswith("launched ")]
    errors = [(t, line) for t, line in lines if line.startswith("ERROR megamoe_plugin:")]
    assert launched, "the subprocess never launched the kernel"
    assert errors, "no ERROR line from the watchdog"
    (t_launch, variant), (t_error, line) = launched[0], errors[0]
    assert re.search(r"timed out waiting on the cross-rank barrier.*; rank 0, kernel " + re.escape(variant), line), line
    assert "restart the process" in line
    print(f"\n  ERROR line {t_error - t_launch:.2f} s after the launch (bound {BOUND_S} s)")
    assert t_error - t_launch < 2 * BOUND_S + 2
