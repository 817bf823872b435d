"""megamoe_plugin.settings: every MEGAMOE_* variable's default, the values it takes, and one
line naming the variable, the value and what is accepted for each value it refuses."""
import os
import re
import stat
from pathlib import Path

import pytest

from megamoe_plugin import settings
from megamoe_plugin.heuristics import IMPLEMENTED_BLOCK_M

ALL = ("MEGAMOE_NUMERICS", "MEGAMOE_BLOCK_M", "MEGAMOE_NUM_STAGES", "MEGAMOE_NUM_SMS", "MEGAMOE_TIMEOUT_S",
       "MEGAMOE_CONFIGS_DIR", "MEGAMOE_CACHE_DIR", "MEGAMOE_NVCC", "MEGAMOE_NVCC_TIMEOUT_S", "MEGAMOE_CUTLASS_INCLUDE")


@pytest.fixture(autouse=True)
def unset(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def test_every_variable_the_package_reads_is_read_here():
    """No module of the package but settings (and serving's MEGAMOE_EXECUTOR test hook) reads a
    MEGAMOE_* variable."""
    package = Path(settings.__file__).parent
    readers = {str(path.relative_to(package)) for path in package.rglob("*.py")
               if re.search(r"(environ\.get|getenv)\(\s*\"MEGAMOE_", path.read_text(encoding="utf-8"))}
    assert readers - {"settings.py"} == set()


@pytest.mark.parametrize("reader, default", [
    (settings.numerics, "fast"), (settings.forced_block_m, None), (settings.forced_num_stages, None),
    (settings.num_sms, None), (settings.timeout_s, settings.DEFAULT_TIMEOUT_S),
    (settings.nvcc_timeout_s, settings.DEFAULT_NVCC_TIMEOUT_S), (settings.configs_dir, None),
    (settings.cache_dir, Path.home() / ".cache" / "megamoe_plugin"), (settings.nvcc, None),
    (settings.cutlass_include, None)])
def test_unset_or_empty_gives_the_default(monkeypatch, reader, default):
    assert reader() == default
    for name in ALL:
        monkeypatch.setenv(name, "")
    assert reader() == default


@pytest.mark.parametrize("name, reader, value, expected", [
    ("MEGAMOE_NUMERICS", settings.numerics, "exact", "exact"),
    ("MEGAMOE_NUMERICS", settings.numerics, "fast", "fast"),
    *(("MEGAMOE_BLOCK_M", settings.forced_block_m, str(t), t) for t in IMPLEMENTED_BLOCK_M),
    ("MEGAMOE_NUM_STAGES", settings.forced_num_stages, "2", 2),
    ("MEGAMOE_NUM_STAGES", settings.forced_num_stages, "6", 6),
    ("MEGAMOE_NUM_SMS", settings.num_sms, "1", 1),
    ("MEGAMOE_NUM_SMS", settings.num_sms, "100", 100),
    ("MEGAMOE_NUM_SMS", settings.num_sms, "1000", 1000),  # more than the GPU has: every SM (ops)
    ("MEGAMOE_TIMEOUT_S", settings.timeout_s, "2.5", 2.5),
    ("MEGAMOE_TIMEOUT_S", settings.timeout_s, "0.1", 0.1),
    ("MEGAMOE_TIMEOUT_S", settings.timeout_s, "1e6", 1e6),
    ("MEGAMOE_TIMEOUT_S", settings.timeout_s, "600", 600.0),
    ("MEGAMOE_CONFIGS_DIR", settings.configs_dir, "/some/tables", Path("/some/tables")),
    ("MEGAMOE_CACHE_DIR", settings.cache_dir, "/some/cache", Path("/some/cache")),
])
def test_accepted_values(monkeypatch, name, reader, value, expected):
    monkeypatch.setenv(name, value)
    assert reader() == expected


@pytest.mark.parametrize("name, reader, value, accepted", [
    ("MEGAMOE_NUMERICS", settings.numerics, "fp16", r"one of \('fast', 'exact'\)"),
    ("MEGAMOE_NUMERICS", settings.numerics, "Fast", r"one of \('fast', 'exact'\)"),
    *(("MEGAMOE_BLOCK_M", settings.forced_block_m, value, r"one of the implemented tiers \(8, 16, 32, 64, 128\)")
      for value in ("48", "256", "0", "x", "-8", "8.0", " 8", "\u0668")),  # the last: an Arabic-Indic 8
    *(("MEGAMOE_NUM_STAGES", settings.forced_num_stages, value, "an integer >= 2")
      for value in ("1", "0", "-4", "x", "2.5", "+4")),
    *(("MEGAMOE_NUM_SMS", settings.num_sms, value, r"an integer >= 1 \(SMs of the persistent grid; unset: every SM\)")
      for value in ("0", "-1", "-132", "many", "1.5", "0x10")),
    # The runtime's uint64 nanoseconds wrap from about 1.8e10 s and truncate 1e-12 s to 0: both
    # trapped every wait at the first call. 0.1 s to 1e6 s, said in the message.
    *(("MEGAMOE_TIMEOUT_S", settings.timeout_s, value,
       r"a number of seconds from 0\.1 to 1e\+06 \(1e\+06 for never; default 30\)")
      for value in ("1e11", "1.85e10", "1000001", "1e-12", "0.09", "0", "-1", "soon", "inf", "nan")),
])
def test_refused_values_are_named(monkeypatch, name, reader, value, accepted):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        reader()
    message = str(info.value)
    assert "\n" not in message
    assert re.fullmatch(f"{name} must be {accepted}, got {re.escape(repr(value))}", message), message


def test_nvcc_must_be_an_executable_file(monkeypatch, tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    for value in (str(tmp_path / "no-such"), str(tmp_path), str(nvcc)):  # missing, a folder, not executable
        monkeypatch.setenv("MEGAMOE_NVCC", value)
        with pytest.raises(ValueError, match=f"^MEGAMOE_NVCC must be the path of an nvcc executable, got "
                                             f"{re.escape(repr(value))}$"):
            settings.nvcc()
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    assert settings.nvcc() == str(nvcc)


def test_cutlass_include_must_hold_the_headers(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAMOE_CUTLASS_INCLUDE", str(tmp_path))
    with pytest.raises(ValueError, match=f"^MEGAMOE_CUTLASS_INCLUDE must be a folder holding cutlass/cutlass.h, got "
                                         f"{re.escape(repr(str(tmp_path)))}$"):
        settings.cutlass_include()
    (tmp_path / "cutlass").mkdir()
    (tmp_path / "cutlass" / "cutlass.h").write_text("")
    assert settings.cutlass_include() == str(tmp_path)


def test_a_variable_set_later_takes_effect(monkeypatch):
    """Read at each call: the tuning sweep forces each candidate by setting the variables."""
    assert settings.forced_block_m() is None
    monkeypatch.setenv("MEGAMOE_BLOCK_M", "16")
    assert settings.forced_block_m() == 16
    monkeypatch.setitem(os.environ, "MEGAMOE_BLOCK_M", "32")
    assert settings.forced_block_m() == 32
