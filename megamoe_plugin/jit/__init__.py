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

This module is the compiler and the cache, for any variant that names itself and gives its source
(megamoe_plugin.kernel_variant: this kernel's instantiation). `python -m megamoe_plugin.jit --check`
(megamoe_plugin.jit.check, this kernel's checks) compiles every variant the heuristics can pick
for the reference configs of docs/design.md section 8 (no GPU needed) and prints registers,
spills, stack frame and shared memory; it exits non-zero on a spill or compile error.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

from ..kernel_variant import KernelVariant
from ..paths import CSRC_DIR
from ..settings import cache_dir, cache_dir_setting, cutlass_include, nvcc as chosen_nvcc
from . import cache
from .cpp_text import code_only
# What compile_variant raises besides KernelMissingError, as megamoe_plugin.jit's.
from .cache import CacheWriteError, NvccError, NvccTimeoutError, UntrustedCacheError  # noqa: F401

_log = logging.getLogger(__name__)

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

    return smem_bytes(variant.block_m, variant.num_stages, variant.num_experts // variant.num_ranks, variant.numerics,
                      variant.weights)


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
                            variant.num_ranks, numerics=(variant.numerics,), fast_math=variant.fast_math,
                            weights=variant.weights)
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
