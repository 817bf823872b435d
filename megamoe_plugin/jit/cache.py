"""The kernel cache on disk, and nvcc runs that fill it.

A cache folder is code: the serving process loads its cubins next to the model's weights, the
KV cache and every peer's buffer. So a build loads only from a folder that no other user can
change, and only where its manifest vouches for its cubin.

Layout: <cache folder>/<entry>/<build>/. The entry is named by the variant and its key (what the
cubin computes: megamoe_plugin.jit.cache_key), the build by the toolchain that compiled it
(`nvcc12.8.93-cutlass4.2.0`). A build holds kernel.cubin, ptxas.log and manifest.json, which
records the key, the toolchain, the flags and the cubin's sha256 and size. The three are written
into a temporary `.build_<host>_<pid>_*` folder of the cache and renamed into place together, so
a build is whole or absent.

Trust (UntrustedCacheError): the cache folder, the entry, the build, the cubin and the manifest
must each be owned by this process's user or root and writable by neither group nor others.
Verification (BuildProblem): the manifest names the entry's key and the build folder's toolchain,
and the cubin has the recorded size and sha256. A build that fails it (a truncated copy, a cubin
replaced, a folder renamed or planted, one built before manifests) is rebuilt where this process
can compile, and refused by name where it cannot (megamoe_plugin.jit.compile_variant).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

from .. import settings

CUBIN = "kernel.cubin"
PTXAS_LOG = "ptxas.log"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
TEMP_PREFIX = ".build_"
# Mode bits through which users other than the owner could change a file, or a folder's entries.
_GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH

NVCC_TIMEOUT_ENV = "MEGAMOE_NVCC_TIMEOUT_S"
# Older than this, a temporary folder is no running compile's: twice the longest, a margin for the
# clocks of other hosts that share the cache folder.
STALE_TEMP_AGE_S = 2 * settings.MAX_NVCC_TIMEOUT_S


class UntrustedCacheError(RuntimeError):
    """A folder or file of the kernel cache that a user other than this process's (and root)
    could change; the message says how to fix it."""


class CacheWriteError(RuntimeError):
    """A build that could not be written into the cache folder."""


class NvccError(RuntimeError):
    """nvcc did not run, or failed."""


class NvccTimeoutError(NvccError):
    """nvcc ran past MEGAMOE_NVCC_TIMEOUT_S and was stopped."""


class BuildProblem(Exception):
    """Why a build does not verify against its manifest (the message)."""


def build_name(nvcc_version: str, cutlass_version: str) -> str:
    """The folder of a toolchain's build inside a cache entry (`nvcc12.8.93-cutlass4.2.0`)."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"nvcc{nvcc_version}-cutlass{cutlass_version}")


def _version_numbers(version: str) -> Tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a build's manifest.json records."""

    key: str
    nvcc_version: str
    cutlass_version: str
    nvcc_flags: List[str]  # the command line's, and NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS where set
    cubin_sha256: str
    cubin_bytes: int

    def build_name(self) -> str:
        return build_name(self.nvcc_version, self.cutlass_version)

    def toolchain_order(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """Sorts builds by their toolchain, newest last (as numbers: CUTLASS 4.10.1 after 4.2.0)."""
        return _version_numbers(self.nvcc_version), _version_numbers(self.cutlass_version)


def cache_dir_problem(root: Path) -> str:
    """Why `root` cannot be the cache folder ("" where it can), creating it where missing: it is
    a file, or it cannot be created (a parent that is a file, /proc, a read-only file system)."""
    if root.exists() and not root.is_dir():
        return "it is a file"
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create it ({exc.strerror})"
    return ""


def refuse_untrusted(*paths: Path) -> None:
    """Raises UntrustedCacheError for the first of `paths` (folders of the cache, from the cache
    folder down, and files of a build) that a user other than this process's and root could
    change: writable by its group or others, or owned by another user. Missing paths pass."""
    uid = os.geteuid()
    root = paths[0]
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_mode & _GROUP_OR_OTHER_WRITE:
            who = "others" if st.st_mode & stat.S_IWOTH else "its group"
            problem = f"is writable by {who} ({stat.filemode(st.st_mode)})"
            fix = f"`chmod -R go-w {root}`"
        elif st.st_uid not in (uid, 0):
            problem = f"is owned by uid {st.st_uid}, not by this process's user (uid {uid}) or root"
            fix = (f"`chown -R {uid} {root}` (as root), or copy the folder (a copy is yours) and point "
                   "MEGAMOE_CACHE_DIR at the copy")
        else:
            continue
        raise UntrustedCacheError(
            f"megamoe: refusing the kernel cache {root}: {path} {problem}, so another user could put code into "
            f"this process. Fix it with {fix}, or point MEGAMOE_CACHE_DIR at a folder only this user can write")


def builds(entry: Path) -> List[Path]:
    """The build folders of a cache entry that hold a cubin (verified or not), by name."""
    return sorted(b for b in entry.iterdir() if (b / CUBIN).exists()) if entry.is_dir() else []


def read_manifest(build: Path) -> Manifest:
    path = build / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BuildProblem(f"it has no {MANIFEST} (built before manifests, or not by megamoe_plugin)") from None
    except (OSError, ValueError) as exc:
        raise BuildProblem(f"its {MANIFEST} is unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise BuildProblem(f"its {MANIFEST} is not of format {MANIFEST_FORMAT}")
    try:
        return Manifest(**{field.name: data[field.name] for field in dataclasses.fields(Manifest)})
    except KeyError as exc:
        raise BuildProblem(f"its {MANIFEST} lacks {exc}") from None


def verified_manifest(build: Path, key: str) -> Manifest:
    """The manifest of `build` (a build folder holding a cubin) where it vouches for the cubin;
    BuildProblem, saying why, where it does not. Refuses an untrusted cache first
    (UntrustedCacheError): a manifest is only as good as the folder it lies in."""
    entry = build.parent
    refuse_untrusted(entry.parent, entry, build, build / CUBIN, build / MANIFEST)
    manifest = read_manifest(build)
    if manifest.key != key:
        raise BuildProblem(f"its manifest is of the cache key {manifest.key}, not {key}")
    if manifest.build_name() != build.name:
        raise BuildProblem(f"its manifest names the toolchain {manifest.build_name()}, not {build.name}")
    try:
        sha256, size = digest(build / CUBIN)
    except OSError as exc:
        raise BuildProblem(f"{CUBIN} is unreadable ({exc.strerror})") from None
    if size != manifest.cubin_bytes:
        raise BuildProblem(f"{CUBIN} has {size} bytes, its manifest records {manifest.cubin_bytes} "
                           "(truncated or replaced)")
    if sha256 != manifest.cubin_sha256:
        raise BuildProblem(f"{CUBIN}'s sha256 is not the one its manifest records (changed since the build)")
    return manifest


def build_problem(build: Path, key: str) -> str:
    """Why `build` does not verify, "" where it does (verified_manifest)."""
    try:
        verified_manifest(build, key)
    except BuildProblem as exc:
        return str(exc)
    return ""


def check_builds(entry: Path, key: str) -> Tuple[Dict[Path, Manifest], Dict[Path, str]]:
    """The builds of `entry`: those that verify, with their manifests, and the others, with why not."""
    verified, problems = {}, {}
    for build in builds(entry):
        try:
            verified[build] = verified_manifest(build, key)
        except BuildProblem as exc:
            problems[build] = str(exc)
    return verified, problems


def digest(cubin: Path) -> Tuple[str, int]:
    """(sha256, size) of a cubin, as a manifest records them."""
    data = cubin.read_bytes()
    return hashlib.sha256(data).hexdigest(), len(data)


def stage_build(folder: Path, cubin: Path, ptxas_log: str, manifest: Manifest) -> Path:
    """A build folder made in `folder` (a temporary folder of the cache): `cubin` moved in, the
    ptxas log and `manifest`. What install renames into place. Nothing in it is writable by group
    or others, whatever the umask: the cache refuses such files."""
    staged = folder / "build"
    staged.mkdir(mode=0o755)
    cubin.rename(staged / CUBIN)
    (staged / PTXAS_LOG).write_text(ptxas_log)
    (staged / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, **dataclasses.asdict(manifest)}, indent=1))
    for path in (staged, *staged.iterdir()):
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~_GROUP_OR_OTHER_WRITE)
    return staged


def install(staged: Path, build: Path, key: str) -> None:
    """Renames the staged build to `build`, atomically. A build already there that verifies (a
    concurrent compile's, as good as this one) stays; one that does not is moved aside into the
    staging folder (removed with it) and replaced."""
    if _rename_folder(staged, build) or not build_problem(build, key):
        return
    with contextlib.suppress(FileNotFoundError):  # a concurrent compile moved it aside first
        build.rename(staged.with_name("replaced"))
    if not (_rename_folder(staged, build) or not build_problem(build, key)):
        raise CacheWriteError(f"megamoe: could not replace {build}, which fails verification")


def _rename_folder(source: Path, target: Path) -> bool:
    """Renames folder `source` to `target`; False where `target` is a folder that is not empty."""
    try:
        source.rename(target)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())


_TEMP_NAME = re.compile(rf"{re.escape(TEMP_PREFIX)}(?P<host>[A-Za-z0-9.-]+)_(?P<pid>\d+)_")


def temp_folder(root: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder in the cache folder to compile in, named by this host and process so
    that remove_stale_temp_folders can tell when its compile is gone."""
    return tempfile.TemporaryDirectory(dir=root, prefix=f"{TEMP_PREFIX}{_host()}_{os.getpid()}_")


def remove_stale_temp_folders(root: Path) -> None:
    """Removes the temporary folders of compiles that a crash or a kill left behind: those of a
    process of this host that is gone, and any older than STALE_TEMP_AGE_S (a cache folder may be
    shared between hosts, whose processes this one cannot see). A container that shares this
    host's name and cache folder but not its processes could lose a running compile's folder:
    that compile then fails with a named error (nvcc's, or CacheWriteError), and a retry works."""
    for folder in root.glob(TEMP_PREFIX + "*"):
        name = _TEMP_NAME.match(folder.name)
        try:
            age = time.time() - folder.stat().st_mtime
        except FileNotFoundError:  # its compile finished meanwhile
            continue
        if age > STALE_TEMP_AGE_S or (name and name["host"] == _host() and not _process_exists(int(name["pid"]))):
            shutil.rmtree(folder, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def run_nvcc(cmd: List[str], doing: str) -> subprocess.CompletedProcess:
    """Runs nvcc (`cmd`, text output) in a session of its own. Past MEGAMOE_NVCC_TIMEOUT_S the
    session is killed, nvcc's children (cicc, ptxas) with it, and NvccTimeoutError names `doing`."""
    timeout = settings.nvcc_timeout_s()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    except OSError as exc:
        raise NvccError(f"megamoe: cannot run {cmd[0]} ({exc.strerror})") from None
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the whole session ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise NvccTimeoutError(
                f"megamoe: nvcc ran past {NVCC_TIMEOUT_ENV}={timeout:g} s {doing} and was stopped; on a slow or busy "
                f"machine, raise {NVCC_TIMEOUT_ENV} (at most {settings.MAX_NVCC_TIMEOUT_S:g})") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
