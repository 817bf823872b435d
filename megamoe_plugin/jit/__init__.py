"""Run-time specialization of the kernel: nvcc to an sm_90a cubin, cached on disk.

A cache entry is a folder named by the variant and a key, a hash of what the cubin computes:
every kernel source (as the compiler sees it: comments and whitespace do not count, so a cubin
built before such a change keeps its -lineinfo line table, which a profiler may then show off by
a few lines), the generated instantiation and the nvcc flags (NVCC_PREPEND_FLAGS and
NVCC_APPEND_FLAGS among them, where set). Inside it, one build per toolchain, in a folder named
by nvcc's version and the CUTLASS headers' version (`nvcc13.0.88-cutlass4.2.0`), with a manifest
of its cubin (megamoe_plugin.jit.cache: a cache folder is code, so a build loads only from a
folder no other user can write, and only where its manifest verifies).

Where this process can compile (nvcc and the CUTLASS headers found, the cache folder writable),
a variant uses its own toolchain's build, compiling it if missing or if it fails verification,
so a changed source, header or toolkit never reuses a stale cubin. Where it cannot (a serving
container has the driver, not the toolkit; a pre-built cache may be mounted read-only), the
build of the newest toolchain that verifies loads: a cache folder pre-built with
`python -m megamoe_plugin.jit --build` (megamoe_plugin.variants picks the variants,
megamoe_plugin.jit.build compiles them) and copied there as MEGAMOE_CACHE_DIR runs without
nvcc. A variant it lacks raises KernelMissingError, one whose builds all fail verification
UnverifiedBuildError; both name the --build command.

Several ranks may compile the same variant at once: each compiles into its own temp
directory and atomically renames the build into place. nvcc runs at most
MEGAMOE_NVCC_TIMEOUT_S seconds (default 900).

`python -m megamoe_plugin.jit --check` compiles every variant the heuristics can pick
for the reference configs of docs/design.md section 8 (no GPU needed) and prints registers,
spills, stack frame and shared memory; it exits non-zero on a spill or compile error.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

from .. import abi
from ..buffer import BufferShape, window_loop
from ..heuristics import DEFAULT_NUMERICS, TIER_OF, implemented_block_m
from ..paths import CSRC_DIR
from ..settings import cache_dir, cache_dir_setting, cutlass_include, nvcc as chosen_nvcc
from . import cache
from .cpp_text import code_only
# What compile_variant raises besides KernelMissingError, as megamoe_plugin.jit's.
from .cache import CacheWriteError, NvccError, NvccTimeoutError, UntrustedCacheError  # noqa: F401

_log = logging.getLogger(__name__)

KERNEL_NAME = "megamoe_fused_kernel"
# Windowed variants' second entry (csrc/megamoe/kernel.cuh mega_moe_windows), launched after the first.
WINDOW_KERNEL_NAME = "megamoe_window_kernel"
NUM_THREADS = abi.kNumThreads


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """Template arguments of one compiled kernel."""

    hidden: int
    intermediate_size: int
    num_topk: int
    num_experts: int
    num_ranks: int
    block_m: int
    num_stages: int
    fast_math: bool
    numerics: str = DEFAULT_NUMERICS  # heuristics.NUMERICS_MODES
    # Debugging: per-tile clock records (csrc/megamoe/timeline.cuh, megamoe_plugin/timeline.py).
    timeline: bool = False
    # The buffer's pools hold fewer rows than the worst routing needs (buffer.BufferShape.windowed):
    # a call whose rows do not fit runs the rest in the window kernel (WINDOW_KERNEL_NAME).
    windowed: bool = False

    def __post_init__(self):
        if self.block_m not in implemented_block_m(self.numerics):
            raise ValueError(f"block_m={self.block_m} is not implemented in {self.numerics!r} numerics "
                             f"(tiers {implemented_block_m(self.numerics)})")
        if TIER_OF[self.block_m].rebalanced and not self.fast_math:
            raise ValueError(f"block_m={self.block_m} needs fast_math=True (heuristics.Tier.rebalanced)")

    def source(self) -> str:
        cpp_bool = {True: "true", False: "false"}
        cfg = (f"megamoe::KernelConfig<{self.hidden}, {self.intermediate_size}, {self.num_topk}, {self.num_experts}, "
               f"{self.num_ranks}, {self.block_m}, {self.num_stages}, {cpp_bool[self.fast_math]}, "
               f"{cpp_bool[self.numerics == 'exact']}, {cpp_bool[self.windowed]}>")
        return (
            ("#define MEGAMOE_TIMELINE 1\n" if self.timeline else "")
            + '#include "megamoe/kernel.cuh"\n'
            f"using Cfg = {cfg};\n"
            f'extern "C" __global__ void __launch_bounds__(Cfg::kNumThreads, 1)\n'
            f"{KERNEL_NAME}(const __grid_constant__ megamoe::KernelParams p) {{ megamoe::mega_moe<Cfg>(p); }}\n"
            + (f'extern "C" __global__ void __launch_bounds__(Cfg::kNumThreads, 1)\n'
               f"{WINDOW_KERNEL_NAME}(const __grid_constant__ megamoe::KernelParams p) "
               f"{{ megamoe::mega_moe_windows<Cfg>(p); }}\n"
               f"static_assert(Cfg::kWindowLoop == {cpp_bool[window_loop(self.block_m)]}, "
               f"\"buffer.window_loop\");\n" if self.windowed else "")
        )

    def name(self) -> str:
        return (f"h{self.hidden}_i{self.intermediate_size}_k{self.num_topk}_e{self.num_experts}_r{self.num_ranks}"
                f"_bm{self.block_m}_st{self.num_stages}_fm{int(self.fast_math)}_{self.numerics}"
                + ("_win" if self.windowed else "") + ("_timeline" if self.timeline else ""))


# Where the CUDA toolkit is when neither MEGAMOE_NVCC, PATH nor CUDA_HOME says.
STANDARD_CUDA_HOME = "/usr/local/cuda"


def find_nvcc() -> str:
    """The nvcc to compile with: MEGAMOE_NVCC where set (that one, or a ValueError naming it: never
    another), else the one on PATH, in CUDA_HOME or in the standard place. It must run: an nvcc
    whose `--version` fails raises NvccError (MEGAMOE_NVCC's, ValueError)."""
    chosen = chosen_nvcc()
    if chosen:
        try:
            nvcc_version(chosen)
        except NvccError as exc:
            raise ValueError(f"MEGAMOE_NVCC must be the path of an nvcc executable, got {chosen!r}: "
                             f"{str(exc).removeprefix('megamoe: ')}") from None
        return chosen
    cuda_homes = (os.environ.get("CUDA_HOME"), STANDARD_CUDA_HOME)
    for candidate in (shutil.which("nvcc"), *(os.path.join(home, "bin", "nvcc") for home in cuda_homes if home)):
        if candidate and os.path.exists(candidate):
            nvcc_version(candidate)
            return candidate
    raise RuntimeError("megamoe: nvcc not found (needed once per kernel variant); install the CUDA toolkit "
                       "or set MEGAMOE_NVCC")


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    proc = cache.run_nvcc([nvcc, "--version"], f"for `{nvcc} --version`")
    if proc.returncode != 0:
        raise NvccError(f"megamoe: `{nvcc} --version` exited with status {proc.returncode}")
    match = re.search(r"V(\d+\.\d+\.\d+)", proc.stdout)
    return match.group(1) if match else proc.stdout.strip().splitlines()[-1]


@functools.lru_cache(maxsize=None)
def cutlass_include_dir() -> str:
    chosen = cutlass_include()
    if chosen:
        return chosen
    try:
        import cutlass_library
    except ImportError as exc:
        raise RuntimeError("megamoe: CUTLASS/CuTe headers not found; pip install nvidia-cutlass "
                           "(or set MEGAMOE_CUTLASS_INCLUDE)") from exc
    return str(Path(cutlass_library.__file__).parent / "source" / "include")


@functools.lru_cache(maxsize=None)
def cutlass_version(include_dir: str) -> str:
    """The CUTLASS headers' version (cutlass/version.h), e.g. "4.2.0"."""
    path = Path(include_dir) / "cutlass" / "version.h"
    try:
        text = path.read_text()
    except OSError as exc:
        raise RuntimeError(f"megamoe: {path} not found: {include_dir} is not a CUTLASS include folder") from exc
    parts = [re.search(rf"#define CUTLASS_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise RuntimeError(f"megamoe: no CUTLASS_MAJOR/MINOR/PATCH in {path}")
    return ".".join(m.group(1) for m in parts)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """What compiles a variant: nvcc and the CUTLASS headers."""

    nvcc: str
    cutlass_include: str

    def build_name(self) -> str:
        """The folder of this toolchain's build inside a cache entry."""
        return cache.build_name(nvcc_version(self.nvcc), cutlass_version(self.cutlass_include))


def find_toolchain() -> Tuple[Optional[Toolchain], str]:
    """(nvcc and the CUTLASS headers, "") where this process can compile into the cache folder,
    which it creates if missing. Else (None, why not): either is missing, or the folder is
    read-only to this process (a pre-built cache mounted read-only, or root's); then nothing
    here can compile, and the builds there that verify load. Raises ValueError for a setting
    that cannot work (MEGAMOE_NVCC, MEGAMOE_CUTLASS_INCLUDE, MEGAMOE_NVCC_TIMEOUT_S,
    MEGAMOE_CACHE_DIR)."""
    try:
        toolchain = Toolchain(find_nvcc(), cutlass_include_dir())
        toolchain.build_name()  # the CUTLASS headers' version is readable
    except RuntimeError as exc:
        return None, str(exc)
    root = cache_dir()
    problem = cache.cache_dir_problem(root)
    if problem:
        setting = cache_dir_setting()
        raise ValueError(f"MEGAMOE_CACHE_DIR must be a folder this process can create, got {setting!r}: {problem}"
                         if setting else f"the default kernel cache {root} cannot be used: {problem}; set "
                         "MEGAMOE_CACHE_DIR to a folder this process can create")
    if not os.access(root, os.W_OK):
        return None, (f"megamoe: the kernel cache {root} is read-only to this process: nothing compiles into it "
                      "(MEGAMOE_CACHE_DIR can name a folder it can write)")
    return toolchain, ""


def nvcc_flags() -> List[str]:
    return ["-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
            "-Xptxas=-v", "-lineinfo", "-DNDEBUG"]


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    return sources_digest(CSRC_DIR / "megamoe")


def sources_digest(folder: Path) -> str:
    """The hash of the kernel sources in `folder` as the compiler sees them (cpp_text.code_only: a
    comment or whitespace change leaves it, and so every cached kernel, as it was)."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*")):
        h.update(path.name.encode())
        h.update(code_only(path.read_text(encoding="utf-8")).encode())
    return h.hexdigest()


# nvcc adds these variables' flags to every command line: they change the cubin as flags do.
NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")


def nvcc_env_flags() -> List[str]:
    """NAME=value of each of NVCC_ENV_FLAGS set here."""
    return [f"{name}={os.environ[name]}" for name in NVCC_ENV_FLAGS if os.environ.get(name)]


def cache_key(variant: KernelVariant) -> str:
    """What the cubin computes: the kernel sources, the instantiation and the flags (the
    toolchain names the build inside the entry, so that a lookup needs no toolkit). The flags
    from the environment count only where set, so the key of a build without them is the same
    as before they counted."""
    h = hashlib.sha256()
    for part in (_sources_digest(), variant.source(), " ".join(nvcc_flags()), *nvcc_env_flags()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def entry_dir(variant: KernelVariant) -> Path:
    """The cache folder of `variant`'s builds."""
    return cache_dir() / f"{variant.name()}_{cache_key(variant)}"


def _has_build(variant: KernelVariant, toolchain: Optional[Toolchain]) -> bool:
    """Whether the cache holds a build of `variant` to load (verified as it loads): `toolchain`'s
    own, or, without a toolchain, any."""
    if toolchain is not None:
        return (entry_dir(variant) / toolchain.build_name() / cache.CUBIN).exists()
    return bool(cache.builds(entry_dir(variant)))


class KernelMissingError(RuntimeError):
    """Variants without a cubin in the cache, where nothing can compile them; the message
    says how to pre-build them (`command`: `python -m megamoe_plugin.jit --build ...`)."""

    def __init__(self, variants: List[KernelVariant], why: str, command: str):
        names = ", ".join(v.name() for v in variants)
        self._init(variants, command, f"no cubin for kernel variant(s) {names} in {cache_dir()} (MEGAMOE_CACHE_DIR)",
                   why)

    def _init(self, variants: List[KernelVariant], command: str, what: str, why: str) -> None:
        RuntimeError.__init__(
            self, f"megamoe: {what}, and none can be compiled here ({why.removeprefix('megamoe: ')}). Pre-build "
            f"them on a machine with the CUDA toolkit and megamoe_plugin[cutlass], then copy that folder here as "
            f"MEGAMOE_CACHE_DIR:\n    {command}")
        self.variants = variants
        self.command = command


class UnverifiedBuildError(KernelMissingError):
    """A variant whose every build in the cache fails verification against its manifest
    (`problems`: build folder -> why), where nothing can rebuild it. --build replaces such builds."""

    def __init__(self, variant: KernelVariant, problems: Dict[Path, str], why: str, command: str):
        refused = "; ".join(f"{build / cache.CUBIN}: {problem}" for build, problem in problems.items())
        self._init([variant], command, f"refusing to load kernel variant {variant.name()} ({refused})", why)
        self.problems = problems


def variants_to_compile(variants: List[KernelVariant]) -> List[KernelVariant]:
    """The variants that compile_variant would compile: no build of this toolchain in the cache
    (where nothing can compile, no build at all; compile_variant then raises for them)."""
    toolchain, _ = find_toolchain()
    return [v for v in variants if not _has_build(v, toolchain)]


def missing_variants(variants: List[KernelVariant]) -> Tuple[List[KernelVariant], str]:
    """(the variants that cannot be loaded here, why): those without a cached build where
    nothing can compile; none where something can."""
    toolchain, why = find_toolchain()
    return ([], "") if toolchain is not None else (variants_to_compile(variants), why)


@dataclasses.dataclass
class CompiledKernel:
    variant: KernelVariant
    cubin: Path
    ptxas_log: str

    @property
    def smem_bytes(self) -> int:
        return smem_bytes_of(self.variant)


def smem_bytes_of(variant: KernelVariant) -> int:
    """Dynamic shared memory to launch with (heuristics.smem_bytes: csrc/megamoe/abi.h's plan of the
    SharedStorage that the variant's smem.cuh static_asserts against it, and the alignment slack)."""
    from ..heuristics import smem_bytes

    return smem_bytes(variant.block_m, variant.num_stages, variant.num_experts // variant.num_ranks, variant.numerics)


def compile_variant(variant: KernelVariant, verbose: bool = False) -> CompiledKernel:
    """The cubin of `variant`, verified against its manifest. Where this process can compile:
    its toolchain's own build, compiled first if missing or failing verification. Where it
    cannot: the build of the newest toolchain that verifies (others are named in the log), else
    KernelMissingError (no build) or UnverifiedBuildError (none verifies). A cache that other
    users can write raises UntrustedCacheError."""
    toolchain, why = find_toolchain()
    key, entry = cache_key(variant), entry_dir(variant)
    if toolchain is not None:
        build = entry / toolchain.build_name()
        if (build / cache.CUBIN).exists():
            problem = cache.build_problem(build, key)
            if not problem:
                return _loaded(variant, build)
            _log.warning("megamoe: rebuilding %s: %s", build / cache.CUBIN, problem)
        return _loaded(variant, _compile(variant, toolchain, key, verbose))
    verified, problems = cache.check_builds(entry, key)
    for build, problem in problems.items():
        _log.warning("megamoe: not loading %s: %s", build / cache.CUBIN, problem)
    if verified:
        return _loaded(variant, max(verified, key=lambda build: verified[build].toolchain_order()))
    from .command import build_command

    command = build_command(variant.hidden, variant.intermediate_size, variant.num_experts, variant.num_topk,
                            variant.num_ranks, numerics=(variant.numerics,), fast_math=variant.fast_math)
    if problems:
        raise UnverifiedBuildError(variant, problems, why, command)
    raise KernelMissingError([variant], why, command)


def _loaded(variant: KernelVariant, build: Path) -> CompiledKernel:
    log_path = build / cache.PTXAS_LOG
    return CompiledKernel(variant, build / cache.CUBIN, log_path.read_text() if log_path.exists() else "")


def _compile(variant: KernelVariant, toolchain: Toolchain, key: str, verbose: bool) -> Path:
    """Compiles `variant` into its toolchain's build folder (replacing one that fails verification)."""
    root, entry = cache_dir(), entry_dir(variant)
    build = entry / toolchain.build_name()
    try:
        entry.mkdir(mode=0o755, exist_ok=True)
        cache.refuse_untrusted(root, entry)
        cache.remove_stale_temp_folders(root)
        with cache.temp_folder(root) as tmp:
            tmp = Path(tmp)
            src, cubin = tmp / "kernel.cu", tmp / cache.CUBIN
            src.write_text(variant.source())
            cmd = [toolchain.nvcc, *nvcc_flags(), "-cubin", "-I", str(CSRC_DIR), "-I", toolchain.cutlass_include,
                   "-o", str(cubin), str(src)]
            if verbose:
                print(f"megamoe: compiling {variant.name()} ...", file=sys.stderr, flush=True)
            proc = cache.run_nvcc(cmd, f"compiling {variant.name()}")
            if proc.returncode != 0:
                raise NvccError(f"megamoe: nvcc failed for {variant.name()}:\n{proc.stderr[-8000:]}")
            manifest = cache.Manifest(key, nvcc_version(toolchain.nvcc), cutlass_version(toolchain.cutlass_include),
                                      [*nvcc_flags(), *nvcc_env_flags()], *cache.digest(cubin))
            cache.install(cache.stage_build(tmp, cubin, proc.stderr, manifest), build, key)
    except OSError as exc:
        raise CacheWriteError(f"megamoe: cannot write the build of {variant.name()} into the kernel cache {root} "
                              f"({exc}); MEGAMOE_CACHE_DIR can name a folder this process can write") from exc
    return build


def compile_variants(variants: List[KernelVariant], verbose: bool = False,
                     on_done: Optional[Callable[[KernelVariant], None]] = None
                     ) -> List[Union[CompiledKernel, RuntimeError]]:
    """compile_variant for each variant, one nvcc process per CPU at a time (a model with
    several tiers needs several variants at start-up). Results in the order of `variants`;
    a variant that fails to compile gives its RuntimeError instead. `on_done(variant, result)`
    runs as each finishes (from a worker thread), for progress."""
    def one(variant: KernelVariant) -> Union[CompiledKernel, RuntimeError]:
        try:
            result = compile_variant(variant, verbose)
        except RuntimeError as exc:
            result = exc
        if on_done is not None:
            on_done(variant, result)
        return result

    if len(variants) <= 1:
        return [one(v) for v in variants]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(variants), os.cpu_count() or 1)) as pool:
        return list(pool.map(one, variants))


# Fused kernels that may spill, each up to the bytes given: BLOCK_M 64 with fast_math at top-8, where
# the math warps sit at the 168 registers of a 384-thread CTA. Every load of these spills lies outside
# the WGMMA main loops, once per tile: the L1 and L2 loops' tile bounds, reloaded at each tile's check,
# and (h7168 R = 2) an L1 tile's act-row offset and m-block, reloaded in its epilogue; at R = 2 also 12 B
# saved once per call around the cross-rank barrier's call check (sync.cuh rank_sync: one slot per peer)
# (tools/spill_sites.py lists them; it needs nvdisasm, which the compile check does not have everywhere).
# A spill that grows past its allowance fails as any other.
SPILLS_OUTSIDE_MAIN_LOOPS = {
    "h7168_i2048_k8_e32_r1_bm64_st5_fm1_fast": 8,
    "h7168_i2048_k8_e64_r2_bm64_st5_fm1_fast_win": 56,
    "h4096_i1536_k8_e64_r2_bm64_st5_fm1_fast_win": 28,
    "h2048_i768_k8_e64_r2_bm64_st5_fm1_fast_win": 28,
}


WGMMA_SERIALIZED = re.compile(r"\((C\d+)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized")


@dataclasses.dataclass
class ResourceUsage:
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int
    # ptxas serialized the WGMMAs, the whole kernel's (its "Potential Performance Loss" notes, any
    # code: C7518 for a path that leaves a main loop with a batch in flight, csrc/megamoe/mma.cuh;
    # C7511 for too few registers to keep WGMMAs in flight): the tensor pipe then
    # runs one WGMMA at a time, a silent slowdown. The note's code, "" when none.
    wgmma_serialized: str = ""


def parse_ptxas(log: str, entry: str = KERNEL_NAME) -> ResourceUsage:
    """Reads one entry kernel's lines of `ptxas -v` output (`entry`: KERNEL_NAME, or a windowed
    variant's WINDOW_KERNEL_NAME). A serialization note counts for the entry it names, and for
    KERNEL_NAME where it names none."""
    start = log.find(f"entry function '{entry}'")
    if start < 0:
        start = log.find(entry) if entry in log else 0
    end = log.find("Compiling entry function", start + 1)
    section = log[start:] if end < 0 else log[start:end]
    def grab(pattern, default=0):
        m = re.search(pattern, section)
        return int(m.group(1)) if m else default
    notes = [line for line in log.splitlines() if WGMMA_SERIALIZED.search(line)
             and (f"'{entry}'" in line or (entry == KERNEL_NAME and f"'{WINDOW_KERNEL_NAME}'" not in line))]
    return ResourceUsage(
        registers=grab(r"Used (\d+) registers", -1),
        spill_stores=grab(r"(\d+) bytes spill stores"),
        spill_loads=grab(r"(\d+) bytes spill loads"),
        stack_frame=grab(r"(\d+) bytes stack frame"),
        static_smem=grab(r"(\d+) bytes smem"),
        wgmma_serialized=",".join(dict.fromkeys(WGMMA_SERIALIZED.search(line).group(1) for line in notes)),
    )


def check_variants(variants: List[KernelVariant]) -> int:
    """Compiles `variants`, printing each one's resource row with a count as it finishes (a
    full check compiles for minutes); returns the number of failures."""
    total = len(variants)
    count = f"[{{:{len(str(total))}d}}/{total}]"
    print(f"{' ' * len(count.format(0))} {'variant':58s} {'regs':>5s} {'spill':>6s} {'stack':>6s} {'smem':>7s}  status")
    failures, done, lock = 0, 0, threading.Lock()

    def report(variant: KernelVariant, compiled: Union[CompiledKernel, RuntimeError]) -> None:
        nonlocal failures, done
        if isinstance(compiled, RuntimeError):
            ok, row = False, f"{variant.name():58s} compile error\n{compiled}"
        else:
            usage = parse_ptxas(compiled.ptxas_log)
            spills = usage.spill_stores + usage.spill_loads
            # A timeline build's clock registers may spill a few bytes (12-20 at BLOCK_M 64, outside
            # the main loop): acceptable in that debugging build, shown, not failed.
            allowed = SPILLS_OUTSIDE_MAIN_LOOPS.get(variant.name(), 0)
            spills_fail = spills > allowed and not variant.timeline
            ok = not spills_fail and usage.registers > 0 and not usage.wgmma_serialized
            status = ("SPILLS" if spills_fail else f"WGMMA SERIALIZED (ptxas {usage.wgmma_serialized})" if usage.wgmma_serialized
                      else "no ptxas report" if usage.registers <= 0
                      else "ok (timeline build spills)" if spills and variant.timeline
                      else f"ok (allowed: at most {allowed} B outside the main loops)" if spills
                      else "ok")
            if variant.windowed:
                # The window kernel runs only the calls whose rows overflow the pools; its spills (its
                # loop over windows in exact BLOCK_M 64 without fast_math, its one window per launch at
                # BLOCK_M 128) cost there alone: shown, not failed. It must compile and report like the
                # fused kernel.
                window = parse_ptxas(compiled.ptxas_log, WINDOW_KERNEL_NAME)
                ok = ok and window.registers > 0
                window_spills = window.spill_stores + window.spill_loads
                status += (f"; window kernel {window.registers} regs, {window_spills} B spills"
                           + (f", WGMMA serialized (ptxas {window.wgmma_serialized})" if window.wgmma_serialized else ""))
            row = (f"{variant.name():58s} {usage.registers:5d} {spills:6d} {usage.stack_frame:6d} "
                   f"{compiled.smem_bytes:7d}  {status}")
        with lock:  # rows come from the compile threads
            done += 1
            failures += not ok
            print(f"{count.format(done)} {row}", flush=True)

    compile_variants(variants, on_done=report)
    return failures


def reference_variants() -> List[KernelVariant]:
    """Every variant the heuristics pick for docs/design.md section 8's reference configs, in both
    numerics modes, and each tier a mode implements that they pick for none of its token counts,
    once per reference shape on one rank (MEGAMOE_BLOCK_M, tuned tables)."""
    from ..configs import REFERENCE_SHAPES, REFERENCE_TOKENS_PER_RANK
    from ..heuristics import NUMERICS_MODES, default_config, default_num_stages, runnable_block_m

    variants = []
    for shape, numerics in itertools.product(REFERENCE_SHAPES.values(), NUMERICS_MODES):
        hidden, inter, topk, num_local_experts = (shape.hidden, shape.intermediate_size, shape.num_topk,
                                                  shape.num_local_experts)
        for num_ranks in (1, 2):
            num_experts = num_local_experts * num_ranks
            # As a buffer for the largest reference token count with the default pools has them.
            windowed = BufferShape(num_ranks, num_experts, max(REFERENCE_TOKENS_PER_RANK), topk, hidden,
                                   inter).windowed
            for tokens in REFERENCE_TOKENS_PER_RANK:
                cfg = default_config(num_ranks, num_experts, topk, hidden, inter, tokens, 132, numerics)
                for fast_math in (True, False):  # as variants.variant_for picks without a table
                    block_m = runnable_block_m(cfg.block_m, fast_math)
                    stages = cfg.num_stages if block_m == cfg.block_m else default_num_stages(
                        block_m, num_local_experts, hidden, inter, numerics=numerics)
                    v = KernelVariant(hidden, inter, topk, num_experts, num_ranks, block_m, stages, fast_math,
                                      numerics, windowed=windowed)
                    if v not in variants:
                        variants.append(v)
        picked = {v.block_m for v in variants if (v.hidden, v.intermediate_size, v.num_topk, v.num_experts,
                                                    v.num_ranks, v.numerics)
                  == (hidden, inter, topk, num_local_experts, 1, numerics)}
        for block_m in sorted(set(implemented_block_m(numerics)) - picked):
            stages = default_num_stages(block_m, num_local_experts, hidden, inter, numerics=numerics)
            variants.append(KernelVariant(hidden, inter, topk, num_local_experts, 1, block_m, stages, True, numerics))
    return variants
