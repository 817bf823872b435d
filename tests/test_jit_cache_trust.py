"""The kernel cache is code (issue 41 items 2 and 3): a build loads only from a folder no other
user can change and only where its manifest vouches for its cubin; a build that fails it is
rebuilt where nvcc is and refused by name where it is not; and every way the cache or the
toolchain can be unusable says so in one named error, never a raw traceback. The compiles are
a stand-in nvcc's (tests/kernel_stand_ins.py): the cache's whole path runs, in no time."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from kernel_stand_ins import compiles, fresh_toolchain, stand_in_toolchain  # noqa: F401
from megamoe_plugin import jit, kernel_variant
from megamoe_plugin.jit import cache, cli

VARIANT = kernel_variant.KernelVariant(384, 256, 2, 4, 1, 8, 2, True)
OTHER = kernel_variant.KernelVariant(384, 256, 2, 4, 1, 16, 2, True)
TINY_BUILD = ["--build", "--hidden", "384", "--intermediate-size", "256", "--num-experts", "4", "--topk", "2",
              "--batch-sizes", "1", "--numerics", "fast"]


def _flip_a_byte(build):
    cubin = bytearray((build / "kernel.cubin").read_bytes())
    cubin[-1] ^= 1
    (build / "kernel.cubin").write_bytes(bytes(cubin))


def _truncate(build):
    (build / "kernel.cubin").write_bytes((build / "kernel.cubin").read_bytes()[:8])


def _another_entrys_manifest(build):
    other = jit.compile_variant(OTHER).cubin.parent
    shutil.copy(other / "manifest.json", build / "manifest.json")


TAMPERINGS = {
    "cubin truncated": _truncate,
    "cubin changed": _flip_a_byte,
    "no manifest": lambda build: (build / "manifest.json").unlink(),
    "manifest not JSON": lambda build: (build / "manifest.json").write_text("{"),
    "another entry's manifest": _another_entrys_manifest,
}


def test_a_build_has_a_manifest_of_its_cubin_toolchain_and_key(jit_cache, stand_in_toolchain):
    stand_in_toolchain("12.8.93", "4.2.0")
    cubin = jit.compile_variant(VARIANT).cubin
    manifest = json.loads((cubin.parent / "manifest.json").read_text())
    data = cubin.read_bytes()
    assert (manifest["cubin_sha256"], manifest["cubin_bytes"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert (manifest["key"], manifest["nvcc_version"], manifest["cutlass_version"]) == (
        jit.cache_key(VARIANT), "12.8.93", "4.2.0")
    assert manifest["nvcc_flags"] == jit.nvcc_flags()
    assert cubin.parent == jit.entry_dir(VARIANT) / "nvcc12.8.93-cutlass4.2.0"


@pytest.mark.parametrize("tamper", TAMPERINGS)
def test_a_build_that_fails_its_manifest_is_rebuilt_where_nvcc_is(jit_cache, stand_in_toolchain, tamper):
    calls = stand_in_toolchain()
    cubin = jit.compile_variant(VARIANT).cubin
    built = cubin.read_bytes()
    TAMPERINGS[tamper](cubin.parent)
    assert jit.compile_variant(VARIANT).cubin == cubin
    assert cubin.read_bytes() == built
    assert compiles(calls) == 2 + (tamper == "another entry's manifest")
    assert jit.compile_variant(VARIANT).cubin == cubin and compiles(calls) == 2 + (tamper == "another entry's manifest")


@pytest.mark.parametrize("tamper", TAMPERINGS)
def test_a_build_that_fails_its_manifest_is_refused_by_name_without_nvcc(jit_cache, stand_in_toolchain, request,
                                                                         tamper):
    stand_in_toolchain()
    cubin = jit.compile_variant(VARIANT).cubin
    TAMPERINGS[tamper](cubin.parent)
    request.getfixturevalue("no_nvcc")
    with pytest.raises(RuntimeError, match="refusing") as info:
        jit.compile_variant(VARIANT)
    message = str(info.value)
    assert str(cubin) in message and "nvcc not found" in message and "--build" in message
    assert isinstance(info.value, jit.KernelMissingError) and info.value.variants == [VARIANT]


def test_without_nvcc_a_planted_or_renamed_build_does_not_win(jit_cache, stand_in_toolchain, request, caplog):
    """The build folder with the highest version numbers does not win: a build loads by its
    manifest, and a folder whose manifest names another toolchain (a renamed copy) or that has none
    (planted) is passed over, and named in the log."""
    stand_in_toolchain()
    real = jit.compile_variant(VARIANT).cubin
    planted = jit.entry_dir(VARIANT) / "nvcc99.9.99-cutlass9.9.9"
    planted.mkdir()
    (planted / "kernel.cubin").write_bytes(b"\x7fELF planted")
    shutil.copytree(real.parent, jit.entry_dir(VARIANT) / "nvcc98.0.0-cutlass9.0.0")
    request.getfixturevalue("no_nvcc")
    assert jit.compile_variant(VARIANT).cubin == real
    assert str(planted / "kernel.cubin") in caplog.text and "nvcc98.0.0-cutlass9.0.0" in caplog.text


def _made_writable_by(path, bits):
    path.chmod(path.stat().st_mode | bits)


@pytest.mark.parametrize("bits, who", [(0o020, "its group"), (0o002, "others")])
@pytest.mark.parametrize("where", ["cache folder", "entry", "build", "cubin", "manifest"])
def test_a_cache_writable_by_other_users_is_refused(jit_cache, stand_in_toolchain, where, bits, who):
    stand_in_toolchain()
    cubin = jit.compile_variant(VARIANT).cubin
    path = {"cache folder": jit_cache, "entry": cubin.parent.parent, "build": cubin.parent, "cubin": cubin,
            "manifest": cubin.parent / "manifest.json"}[where]
    _made_writable_by(path, bits)
    with pytest.raises(RuntimeError, match="refusing the kernel cache") as info:
        jit.compile_variant(VARIANT)
    assert isinstance(info.value, jit.UntrustedCacheError)
    assert f"{path} is writable by {who}" in str(info.value) and f"chmod -R go-w {jit_cache}" in str(info.value)


def test_a_cache_writable_by_other_users_is_refused_without_nvcc_too(jit_cache, stand_in_toolchain, request):
    stand_in_toolchain()
    jit.compile_variant(VARIANT)
    _made_writable_by(jit_cache, 0o002)
    request.getfixturevalue("no_nvcc")
    with pytest.raises(jit.UntrustedCacheError, match=f"{jit_cache} is writable by others"):
        jit.compile_variant(VARIANT)


def test_a_cache_owned_by_another_user_is_refused(jit_cache, stand_in_toolchain, monkeypatch):
    stand_in_toolchain()
    cubin = jit.compile_variant(VARIANT).cubin
    if os.geteuid() == 0:  # root's own files pass: give the cubin to another user
        os.chown(cubin, 12345, -1)
        owned = cubin
    else:  # the files are this user's: run as another
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 12345)
        owned = jit_cache
    with pytest.raises(jit.UntrustedCacheError, match="refusing the kernel cache") as info:
        jit.compile_variant(VARIANT)
    assert f"{owned} is owned by uid" in str(info.value) and "chown -R" in str(info.value)


def test_builds_are_written_without_group_or_other_write_whatever_the_umask(jit_cache, stand_in_toolchain):
    """A umask of 002 (a group per user) would make nvcc's cubin group-writable, which the cache
    then refuses: the build is written without it, and loads."""
    stand_in_toolchain()
    umask = os.umask(0o002)
    try:
        build = jit.compile_variant(VARIANT).cubin.parent
    finally:
        os.umask(umask)
    for path in (jit_cache, build.parent, build, *build.iterdir()):
        assert not path.stat().st_mode & 0o022, path
    assert jit.compile_variant(VARIANT).cubin == build / "kernel.cubin"


def stat_mode(path):
    return path.stat().st_mode & 0o7777


@pytest.fixture
def read_only():
    """read_only(folder): makes `folder` and everything in it read-only to this process (root:
    chattr +i, which binds root too; skipped where that does not work). Undone after the test."""
    frozen = []

    def freeze(folder):
        if os.geteuid() == 0:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "-R", "+i", str(folder)],
                                                                capture_output=True).returncode:
                pytest.skip("running as root, and chattr +i (a read-only folder for root) does not work here")
        else:
            for path in (folder, *folder.rglob("*")):
                path.chmod(stat_mode(path) & ~0o222)
        frozen.append(folder)

    yield freeze
    for folder in frozen:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-R", "-i", str(folder)], check=True)
        else:
            for path in (folder, *folder.rglob("*")):
                path.chmod(stat_mode(path) | 0o200)


def test_a_read_only_prebuilt_cache_loads_where_nvcc_is_of_another_version(jit_cache, stand_in_toolchain, read_only):
    """A pre-built cache mounted read-only (or another user's) and a local nvcc of another version
    than the one that built it: the build that verifies loads; a variant it lacks is named, with
    why nothing compiles it, before anything runs."""
    stand_in_toolchain("12.4.131")
    prebuilt = jit.compile_variant(VARIANT).cubin
    read_only(jit_cache)
    calls = stand_in_toolchain("12.8.93")
    assert jit.compile_variant(VARIANT).cubin == prebuilt and compiles(calls) == 0
    missing, why = jit.missing_variants([VARIANT, OTHER])
    assert missing == [OTHER] and f"the kernel cache {jit_cache} is read-only" in why
    with pytest.raises(jit.KernelMissingError, match="read-only"):
        jit.compile_variant(OTHER)
    assert compiles(calls) == 0


def test_nvcc_past_its_timeout_is_stopped_with_its_children(jit_cache, stand_in_toolchain, monkeypatch):
    stand_in_toolchain(before_compile="sleep 60 & wait")  # a child that holds nvcc's output pipes
    monkeypatch.setenv("MEGAMOE_NVCC_TIMEOUT_S", "1")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=re.escape(f"nvcc ran past MEGAMOE_NVCC_TIMEOUT_S=1 s compiling "
                                                     f"{VARIANT.name()}")) as info:
        jit.compile_variant(VARIANT)
    assert time.monotonic() - start < 20
    assert isinstance(info.value, jit.NvccTimeoutError)
    assert not list(jit_cache.glob(".build_*"))


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e9"])
def test_a_bad_nvcc_timeout_is_refused_by_name(jit_cache, stand_in_toolchain, monkeypatch, value):
    stand_in_toolchain()
    monkeypatch.setenv("MEGAMOE_NVCC_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"MEGAMOE_NVCC_TIMEOUT_S must be .*, got {value!r}"):
        jit.compile_variant(VARIANT)


def test_temporary_folders_of_dead_compiles_are_removed(jit_cache, stand_in_toolchain):
    """A compile that crashed or was killed leaves its `.build_*` folder: the next compile removes
    those of processes of this host that are gone, and any older than the longest compile; a live
    one, and a recent one of another host (a shared cache folder), stay."""
    stand_in_toolchain()
    jit_cache.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = cache.temp_folder(jit_cache)  # this process's, as a compile names it
    live_name = os.path.basename(live.name)
    folders = {
        "dead": jit_cache / live_name.replace(f"_{os.getpid()}_", f"_{dead.pid}_"),
        "old": jit_cache / ".build_oldstyle",
        "other host": jit_cache / f".build_another-host_{dead.pid}_x",
    }
    for folder in folders.values():
        folder.mkdir()
        (folder / "kernel.cu").write_text("")
    day = 86400
    os.utime(folders["old"], (time.time() - 3 * day, time.time() - 3 * day))
    jit.compile_variant(VARIANT)
    assert (folders["dead"].exists(), folders["old"].exists(), folders["other host"].exists()) == (False, False, True)
    assert os.path.isdir(live.name)
    live.cleanup()


@pytest.mark.parametrize("name", ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"])
def test_nvcc_flags_from_the_environment_are_part_of_the_key(jit_cache, stand_in_toolchain, monkeypatch, name):
    """nvcc adds these variables' flags to its command line: a cubin built with them is another
    entry, and its manifest records them; unset, the key is what it was."""
    for variable in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"):
        monkeypatch.delenv(variable, raising=False)
    plain = jit.cache_key(VARIANT)
    monkeypatch.setenv(name, "-G")
    debug = jit.cache_key(VARIANT)
    monkeypatch.setenv(name, "-Xptxas=-O1")
    assert len({plain, debug, jit.cache_key(VARIANT)}) == 3
    stand_in_toolchain()
    cubin = jit.compile_variant(VARIANT).cubin
    assert json.loads((cubin.parent / "manifest.json").read_text())["nvcc_flags"] == [
        *jit.nvcc_flags(), f"{name}=-Xptxas=-O1"]
    monkeypatch.delenv(name)
    assert jit.cache_key(VARIANT) == plain


def test_megamoe_nvcc_that_does_not_exist_is_named_not_replaced(jit_cache, stand_in_toolchain, monkeypatch):
    calls = stand_in_toolchain()
    monkeypatch.setenv("PATH", os.pathsep.join([str(calls.parent), os.environ["PATH"]]))  # an nvcc on PATH
    monkeypatch.setenv("MEGAMOE_NVCC", "/no/such/nvcc")
    with pytest.raises(ValueError, match="MEGAMOE_NVCC must be the path of an nvcc executable, got '/no/such/nvcc'"):
        jit.compile_variant(VARIANT)
    assert compiles(calls) == 0


def test_megamoe_nvcc_that_fails_is_named(jit_cache, stand_in_toolchain, monkeypatch):
    stand_in_toolchain()
    monkeypatch.setenv("MEGAMOE_NVCC", "/bin/false")
    with pytest.raises(ValueError, match=re.escape("MEGAMOE_NVCC must be the path of an nvcc executable, got "
                                                   "'/bin/false': `/bin/false --version` exited with status 1")):
        jit.compile_variant(VARIANT)


def _under_a_file(tmp_path):
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "cache")


@pytest.mark.parametrize("where", ["under a file", "a file", "under /proc"])
def test_a_cache_dir_that_cannot_be_created_is_named(jit_cache, stand_in_toolchain, monkeypatch, tmp_path, where):
    stand_in_toolchain()
    under_a_file = _under_a_file(tmp_path)
    folder = {"under a file": under_a_file, "a file": str(tmp_path / "a-file"),
              "under /proc": "/proc/megamoe-cache"}[where]
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", folder)
    with pytest.raises(ValueError, match=f"MEGAMOE_CACHE_DIR must be .*, got {folder!r}"):
        jit.compile_variant(VARIANT)


@pytest.mark.parametrize("setting", ["MEGAMOE_NVCC=/no/such/nvcc", "MEGAMOE_NVCC=/bin/false",
                                     "MEGAMOE_NVCC_TIMEOUT_S=soon", "MEGAMOE_CACHE_DIR=<under a file>",
                                     "--cache-dir=<under a file>", "--cache-dir=/proc/megamoe-cache"])
def test_build_cli_names_a_bad_setting_in_one_line(jit_cache, stand_in_toolchain, request, monkeypatch, tmp_path,
                                                   capsys, setting):
    calls = stand_in_toolchain()
    request.getfixturevalue("no_nvcc")  # only the stand-in compiles, whatever the setting says
    monkeypatch.setenv("MEGAMOE_NVCC", str(calls.parent / "nvcc"))
    name, value = setting.split("=")
    value = value.replace("<under a file>", _under_a_file(tmp_path))
    argv = [*TINY_BUILD, "--cache-dir", value] if name == "--cache-dir" else TINY_BUILD
    if name.startswith("MEGAMOE"):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("python -m megamoe_plugin.jit --build: ") and name in lines[0] and value in lines[0]
    assert compiles(calls) == 0
