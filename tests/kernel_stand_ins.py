"""Stand-ins for the kernel and its compiler, for tests on a CPU.

Recording stand-ins for the kernel's op and warm-up, for the framework layer tests that run
the glue's "kernel" executor (tests/vllm_plugin, tests/sglang_plugin): the op computes the
float32 reference from the staged buffer and the weights it is handed, so the glue's staging,
weights and buffer are what a test checks; the warm-up only records its arguments.

A stand-in toolchain for the kernel cache's tests (tests/test_jit_*.py, tests/test_prebuilt.py):
an nvcc script that writes a small cubin in no time, and a CUTLASS include folder of a given
version, so that jit.compile_variant runs its whole path (cache, manifest, install) without a
real compile."""
from pathlib import Path

import pytest

import megamoe_plugin as mm
import megamoe_plugin.ops as ops
from megamoe_plugin import jit


def record_kernel_calls(monkeypatch) -> dict:
    """Installs both stand-ins; returns {"op": [per call: n, l1, l2, buf, clamp, config,
    numerics], "warmup": [per call: (buf, counts, numerics, [l1, l2], [[l1, l2] of the other
    layers])]}."""
    calls = {"op": [], "warmup": []}

    def fake_op(y, l1, l2, buf, activation_clamp=None, fast_math=True, cumulative_local_expert_recv_stats=None,
                config_num_tokens=None, numerics=None):
        n = y.shape[0]
        calls["op"].append(dict(n=n, l1=l1, l2=l2, buf=buf, clamp=activation_clamp, config=config_num_tokens,
                                numerics=numerics))
        if n:
            (w13, s13), (w2, s2) = mm.untransform_weights(tuple(l1), tuple(l2))
            ranks = [dict(x=buf.x[:n], x_sf=buf.x_sf[:n], topk_idx=buf.topk_idx[:n],
                          topk_weights=buf.topk_weights[:n])]
            (ref,) = mm.reference.mega_moe(ranks, [dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)],
                                           buf.shape.num_experts, activation_clamp=activation_clamp)
            y.copy_(ref)
        return y

    def fake_warmup(buf, l1, l2, counts, fast_math=True, numerics=None, other_layers=()):
        calls["warmup"].append((buf, list(counts), numerics, [tuple(l1), tuple(l2)], [list(w) for w in other_layers]))
        return 1

    # The glue calls torch.ops.megamoe.fp8_mega_moe, whose eager implementation calls ops.fp8_mega_moe.
    monkeypatch.setattr(ops, "fp8_mega_moe", fake_op)
    monkeypatch.setattr(ops, "warmup", fake_warmup)
    return calls


STAND_IN_NVCC = """#!/bin/sh
# A stand-in nvcc {version}: a compile records its command line in {calls}, runs the test's lines,
# then writes a small cubin to its -o path and says what ptxas -v would.
if [ "$1" = --version ]; then echo "Cuda compilation tools, V{version}"; exit 0; fi
echo "$@" >> {calls}
{before_compile}
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then out="$2"; fi; shift; done
printf '\\177ELF stand-in cubin of nvcc {version}' > "$out"
echo "ptxas info    : Used 168 registers, 0 bytes spill stores, 0 bytes spill loads" >&2
"""


def write_cutlass_headers(include: Path, version: str) -> None:
    """cutlass/cutlass.h and the version.h of CUTLASS `version` ("4.2.0") in the include folder
    `include`."""
    (include / "cutlass").mkdir(parents=True, exist_ok=True)
    (include / "cutlass" / "cutlass.h").write_text("")
    (include / "cutlass" / "version.h").write_text("".join(
        f"#define CUTLASS_{part} {n}\n" for part, n in zip(("MAJOR", "MINOR", "PATCH"), version.split("."))))


@pytest.fixture
def fresh_toolchain():
    """The toolchain look-ups are memoized per process: forget what a test changed."""
    memoized = (jit.cutlass_include_dir, jit.cutlass_version, jit.nvcc_version)
    for fn in memoized:
        fn.cache_clear()
    yield
    for fn in memoized:
        fn.cache_clear()


@pytest.fixture
def stand_in_toolchain(tmp_path, monkeypatch, fresh_toolchain):
    """use(nvcc_version, cutlass_version, before_compile): a stand-in toolchain as MEGAMOE_NVCC and
    MEGAMOE_CUTLASS_INCLUDE from then on (`before_compile`: shell lines its nvcc runs in a compile);
    returns the file where its nvcc records each compile, one line each."""
    made = []

    def use(nvcc_version: str = "12.8.93", cutlass_version: str = "4.2.0", before_compile: str = "") -> Path:
        folder = tmp_path / f"toolchain{len(made)}"
        folder.mkdir()
        made.append(folder)
        calls = folder / "compiles"
        calls.touch()
        nvcc = folder / "nvcc"
        nvcc.write_text(STAND_IN_NVCC.format(version=nvcc_version, calls=calls, before_compile=before_compile))
        nvcc.chmod(0o755)
        write_cutlass_headers(folder / "include", cutlass_version)
        monkeypatch.setenv("MEGAMOE_NVCC", str(nvcc))
        monkeypatch.setenv("MEGAMOE_CUTLASS_INCLUDE", str(folder / "include"))
        jit.cutlass_include_dir.cache_clear()  # memoized: it reads MEGAMOE_CUTLASS_INCLUDE once
        return calls

    return use


def compiles(calls: Path) -> int:
    """How many compiles a stand-in toolchain's nvcc ran (`calls`: what stand_in_toolchain returned)."""
    return len(calls.read_text().splitlines())
