"""A cache pre-built with `python -m megamoe_plugin.jit --build` loads where nvcc is not
(a serving container), and a variant it lacks fails before any launch with the command
that builds it. One small variant is really compiled (nvcc is on CI's machine); the rest
of the cache is laid out by hand where only its lookup is under test."""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megamoe_plugin as mm
from kernel_stand_ins import compiles, fresh_toolchain, stand_in_toolchain  # noqa: F401
from megamoe_plugin import jit, kernel_variant, ops, progress, validation
from megamoe_plugin.jit import cli, command
from megamoe_plugin.variants import build_variants_for, deployment_variants
from megamoe_plugin.model_config import MoEShape, shape_from_args

HAVE_NVCC = shutil.which("nvcc") is not None or os.path.exists(os.path.join(jit.STANDARD_CUDA_HOME, "bin", "nvcc"))
TINY = MoEShape(hidden=384, intermediate_size=256, num_experts=4, num_topk=2, name="tiny")
TINY_ARGS = ["--hidden", "384", "--intermediate-size", "256", "--num-experts", "4", "--topk", "2"]


def build_command_variants(command_line):
    """The variants the printed --build command line compiles."""
    argv = shlex.split(command_line)
    assert argv[:4] == ["python", "-m", "megamoe_plugin.jit", "--build"]
    parser = cli.parser()
    args = parser.parse_args(argv[3:])
    shape = shape_from_args(args, parser, required=True)
    return args, build_variants_for(shape, args.ep_size, command.parse_batch_sizes(args.batch_sizes), args.gpu,
                                    tuple(args.numerics.split(",")), args.fast_math)


def test_cache_key_needs_no_toolkit_and_each_toolchain_has_its_build(jit_cache, stand_in_toolchain, request):
    """The entry is found from the sources, instantiation and flags alone; inside it, the build
    is per toolchain, so new CUTLASS headers (or a new nvcc) do not reuse an old cubin where they
    can compile, while a machine without them takes the newest toolchain's build that verifies."""
    variant = kernel_variant.KernelVariant(384, 256, 2, 4, 1, 8, 2, True)
    built = {}
    for cutlass in ("4.2.0", "4.10.1"):
        stand_in_toolchain(cutlass_version=cutlass)
        built[cutlass] = jit.compile_variant(variant).cubin
        assert built[cutlass] == jit.entry_dir(variant) / f"nvcc12.8.93-cutlass{cutlass}" / "kernel.cubin"
    calls = stand_in_toolchain(cutlass_version="4.2.0")
    assert jit.compile_variant(variant).cubin == built["4.2.0"] and compiles(calls) == 0
    stand_in_toolchain(cutlass_version="4.3.0")
    assert jit.variants_to_compile([variant]) == [variant]
    request.getfixturevalue("no_nvcc")
    assert jit.missing_variants([variant])[0] == []
    assert jit.compile_variant(variant).cubin == built["4.10.1"]  # 4.10.1 is newer than 4.2.0 (numbers, not text)
    assert jit.entry_dir(variant) == jit_cache / f"{variant.name()}_{jit.cache_key(variant)}"


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed: the pre-build compiles one small variant")
def test_build_then_load_without_nvcc(jit_cache, fresh_toolchain, request):
    """--build compiles what the runtime selects for a tiny shape at one batch size; with nvcc
    hidden, the op layer's lookup then hands out that cubin."""
    proc = subprocess.run([sys.executable, "-m", "megamoe_plugin.jit", "--build", *TINY_ARGS, "--batch-sizes", "1",
                           "--numerics", "fast", "--cache-dir", str(jit_cache)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 of 1 variants built in " + str(jit_cache) in proc.stdout
    (variant,) = deployment_variants(TINY, 1, [1], command.DEFAULT_GPU, ("fast",))
    toolchain, _ = jit.find_toolchain()
    built = jit.entry_dir(variant) / toolchain.build_name()
    assert (built / "kernel.cubin").exists()

    request.getfixturevalue("no_nvcc")
    compiled = jit.compile_variant(variant)
    assert compiled.cubin == built / "kernel.cubin"
    cubin = compiled.cubin.read_bytes()
    assert cubin[:4] == b"\x7fELF" and kernel_variant.KERNEL_NAME.encode() in cubin
    assert "Used" in compiled.ptxas_log  # --check's report works from the pre-built cache too
    other = kernel_variant.KernelVariant(384, 256, 2, 4, 1, 16, 2, True)
    assert jit.missing_variants([variant, other]) == ([other], "megamoe: nvcc not found (needed once per kernel "
                                                               "variant); install the CUDA toolkit or set MEGAMOE_NVCC")


def test_missing_variant_without_nvcc_names_the_build_command(jit_cache, no_nvcc):
    variant = kernel_variant.KernelVariant(384, 256, 2, 4, 1, 16, 2, True, "exact")
    with pytest.raises(jit.KernelMissingError) as info:
        jit.compile_variant(variant)
    message = str(info.value)
    assert variant.name() in message and str(jit_cache) in message and "nvcc not found" in message
    args, variants = build_command_variants(info.value.command)
    assert variant in variants and args.numerics == "exact" and args.cache_dir == str(jit_cache)


def test_warmup_without_nvcc_fails_before_compiling_and_says_how_to_build(jit_cache, no_nvcc, fake_build,
                                                                          monkeypatch):
    """ops.warmup names every variant its batch sizes select that the cache lacks, in one
    error, and its command builds exactly what was missing (for this GPU's table)."""
    monkeypatch.setattr(validation, "require_sm90", lambda device: None)
    monkeypatch.setattr(ops, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(ops, "_grid_size", lambda buf: 132)
    compiled = []
    monkeypatch.setattr(jit, "compile_variant", lambda variant, verbose=False: compiled.append(variant))
    buf = mm.get_symm_buffer(None, 4, 64, 2, 384, 256, device="cpu")
    counts = [1, 2, 3, 64]
    selected = list(dict.fromkeys(ops.select_variant(buf, n, True, "fast") for n in counts))
    assert len(selected) > 1
    fake_build(selected[0])
    with pytest.raises(jit.KernelMissingError) as info:
        ops.warmup(buf, None, None, counts, numerics="fast")
    assert info.value.variants == selected[1:] and not compiled
    args, variants = build_command_variants(info.value.command)
    assert (args.gpu, args.batch_sizes, args.numerics) == ("NVIDIA H100 80GB HBM3", "1-3,64", "fast")
    assert variants == selected


def test_build_cli_compiles_the_selected_variants_with_progress(jit_cache, monkeypatch, capsys):
    """In both numerics modes by default, for an EP size, from a config.json; each variant
    once; the summary names the folder to serve from."""
    import json

    config = jit_cache.parent / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                                  "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8}))
    built = []
    monkeypatch.setattr(jit, "find_toolchain", lambda: (object(), ""))
    monkeypatch.setattr(jit, "compile_variant", lambda variant, verbose=False: built.append(variant))
    monkeypatch.setattr("megamoe_plugin.jit.build.progress_bar",
                        lambda total, desc, unit: progress._Lines(total, desc, unit))
    assert cli.main(["--build", "--model", str(config), "--ep-size", "2", "--batch-sizes", "0-512",
                     "--cache-dir", str(jit_cache)]) == 0
    shape = MoEShape(2048, 768, 128, 8)
    expected = deployment_variants(shape, 2, range(513), command.DEFAULT_GPU)
    assert sorted(built, key=expected.index) == expected and len(set(built)) == len(built)
    assert {v.numerics for v in built} == {"fast", "exact"} and {v.num_ranks for v in built} == {2}
    out, err = capsys.readouterr()
    assert f"megamoe: building kernels: {len(expected)}/{len(expected)} variants" in err
    assert f"{len(expected)} of {len(expected)} variants built in {jit_cache}" in out
    assert f"MEGAMOE_CACHE_DIR={jit_cache}" in out


def test_deployment_variants_run_the_shared_experts_as_local_experts(jit_cache):
    """S = 1 on 8 ranks: every variant is of the kernel's shape, E + 8 experts and K + 1 slots
    (BufferShape.of_routed), which is what a routed-only shape of that size selects."""
    counts = [0, 1, 64, 512, 4096]
    variants = deployment_variants(MoEShape(7168, 2048, 256, 8, num_shared_experts=1), 8, counts, command.DEFAULT_GPU)
    assert variants and all("_k9_e264_r8_" in v.name() for v in variants)
    assert variants == deployment_variants(MoEShape(7168, 2048, 264, 9), 8, counts, command.DEFAULT_GPU)
    assert not set(variants) & set(deployment_variants(MoEShape(7168, 2048, 256, 8), 8, counts, command.DEFAULT_GPU))


def test_build_command_names_the_shared_experts(jit_cache):
    """The routed E and K with S: the command builds the variants of the shape with S shared
    experts; without S it names none."""
    gpu, counts = "NVIDIA H100 80GB HBM3", [1, 64]
    text = command.build_command(7168, 2048, 256, 8, 8, counts, gpu, ("fast",), num_shared_experts=1)
    assert "--num-experts 256 --topk 8 --shared-experts 1 --ep-size 8" in text
    _, variants = build_command_variants(text)
    in_the_call = deployment_variants(MoEShape(7168, 2048, 256, 8, num_shared_experts=1), 8, counts, gpu, ("fast",))
    beside = deployment_variants(MoEShape(7168, 2048, 256, 8), 8, counts, gpu, ("fast",))
    assert variants == in_the_call + beside
    assert "--shared-experts" not in command.build_command(7168, 2048, 256, 8, 8, counts, gpu)


def test_build_cli_builds_a_models_shared_experts(jit_cache, monkeypatch, capsys):
    """From the e2e DeepSeek-V3 model's config.json (n_shared_experts 1, 128 routed experts, top-8): the
    calls with the shared experts in them, and the routed-only ones (a framework that runs them beside)."""
    built = []
    monkeypatch.setattr(jit, "find_toolchain", lambda: (object(), ""))
    monkeypatch.setattr(jit, "compile_variant", lambda variant, verbose=False: built.append(variant))
    monkeypatch.setattr("megamoe_plugin.jit.build.progress_bar",
                        lambda total, desc, unit: progress._Lines(total, desc, unit))
    model = Path(__file__).resolve().parents[1] / "tools" / "e2e" / "models" / "deepseek_v3_fp8"
    assert cli.main(["--build", "--model", str(model), "--ep-size", "8", "--batch-sizes", "0-256", "--numerics",
                     "fast", "--cache-dir", str(jit_cache)]) == 0
    assert built and {(v.num_experts, v.num_topk, v.num_ranks) for v in built} == {(128 + 8, 8 + 1, 8), (128, 8, 8)}
    assert "top-8, 1 shared expert, EP 8" in capsys.readouterr().out


def test_build_without_a_toolchain_is_one_line(jit_cache, no_nvcc):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(mm.__file__).parents[1]), env.get("PYTHONPATH", "")])
    script = ("import sys; from megamoe_plugin import jit; jit.STANDARD_CUDA_HOME = sys.argv[1]; "
              "from megamoe_plugin.jit.cli import main; sys.exit(main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", script, str(no_nvcc), "--build", *TINY_ARGS],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["python -m megamoe_plugin.jit --build: nvcc not found (needed once per kernel "
                                        "variant); install the CUDA toolkit or set MEGAMOE_NVCC"]


@pytest.mark.parametrize("text, counts", [("8", [8]), ("0-3,8,2", [0, 1, 2, 3, 8]), (" 1 , 4-5", [1, 4, 5])])
def test_batch_sizes(text, counts):
    assert command.parse_batch_sizes(text) == counts
    assert command.parse_batch_sizes(command.format_batch_sizes(counts)) == counts


@pytest.mark.parametrize("text", ["", "a", "1-", "-4", "3-1x"])
def test_bad_batch_sizes(text):
    with pytest.raises(ValueError, match="batch sizes"):
        command.parse_batch_sizes(text)


@pytest.mark.parametrize("cached", [True, False])
def test_warmup_progress_says_compiling_only_when_something_compiles(jit_cache, fake_build, monkeypatch, cached):
    """A start-up from a warm cache shows a "loading" bar; one that runs nvcc a "compiling" one,
    counting every variant the batch sizes select."""
    monkeypatch.setattr(validation, "require_sm90", lambda device: None)
    monkeypatch.setattr(ops, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(ops, "_grid_size", lambda buf: 132)
    monkeypatch.setattr(ops, "_kernel_handle", lambda device, variant: None)
    monkeypatch.setattr(ops, "_params_handle", lambda *args: None)
    toolchain = jit.Toolchain("nvcc", "include")
    monkeypatch.setattr(jit.Toolchain, "build_name", lambda self: "nvcc12.8.93-cutlass4.2.0")
    monkeypatch.setattr(jit, "find_toolchain", lambda: (toolchain, ""))
    monkeypatch.setattr(jit, "compile_variant", lambda variant, verbose=False: variant)  # no nvcc run here
    bars = []
    monkeypatch.setattr(ops, "progress_bar", lambda total, desc, unit: bars.append((total, desc)) or
                        progress._Lines(total, desc, unit))
    buf = mm.get_symm_buffer(None, 4, 64, 2, 384, 256, device="cpu")
    counts = [1, 2, 3, 64]
    selected = list(dict.fromkeys(ops.select_variant(buf, n, True, "fast") for n in counts))
    for variant in selected[:len(selected) if cached else 1]:
        fake_build(variant)
    w13, s13, w2, s2 = (torch.zeros(1) for _ in range(4))  # stand-ins: only their addresses are read
    assert ops.warmup(buf, (w13, s13), (w2, s2), counts, numerics="fast") == len(selected)
    assert bars == [(len(selected), "megamoe: loading kernels" if cached else "megamoe: compiling kernels")]
    assert set(jit.variants_to_compile(selected)) == (set() if cached else set(selected[1:]))
