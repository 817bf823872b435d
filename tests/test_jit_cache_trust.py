"""The kernel cache is code (issue 41 item 2): a build loads only from a folder no other user
can change and only where its manifest vouches for its cubin; a build that fails it is rebuilt
where nvcc is and refused by name where it is not. The compiles are a stand-in nvcc's
(tests/kernel_stand_ins.py): the cache's whole path runs, in no time."""
import hashlib
import json
import os
import shutil

import pytest

from kernel_stand_ins import compiles, fresh_toolchain, stand_in_toolchain  # noqa: F401
from megamoe_plugin import jit

VARIANT = jit.KernelVariant(384, 256, 2, 4, 1, 8, 2, True)
OTHER = jit.KernelVariant(384, 256, 2, 4, 1, 16, 2, True)


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
