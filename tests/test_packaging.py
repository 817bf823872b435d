"""A non-editable install (a wheel, `pip install --target`: how vLLM users install
plugins) must ship the JIT kernel sources and the config tables, and must hash the
sources exactly as the source tree does, so a JIT cache built from a checkout still hits."""
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True)
    (path,) = out.glob("megamoe_plugin-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel pip-installed into a target folder, as `pip install --target` would."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    return target


def test_wheel_ships_kernel_sources_and_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in sorted((REPO / "csrc" / "megamoe").iterdir()):
        assert f"megamoe_plugin/_csrc/megamoe/{src.name}" in names
    for cfg in sorted((REPO / "configs").glob("*.json")):
        assert f"megamoe_plugin/_configs/{cfg.name}" in names
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)


def test_wheel_metadata_states_python_and_test_extra(wheel):
    zf = zipfile.ZipFile(wheel)
    (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
    lines = zf.read(metadata).decode().splitlines()
    # tests/test_stdlib_only.py needs sys.stdlib_module_names (3.10).
    assert "Requires-Python: >=3.10" in lines
    # tools/gpu_check.sh runs pytest --timeout, which needs pytest-timeout.
    assert any(line.startswith("Requires-Dist: pytest-timeout") and 'extra == "test"' in line for line in lines)
    assert "megamoe_plugin/jit/__main__.py" in zf.namelist()


def test_wheel_states_and_ships_the_license(wheel):
    zf = zipfile.ZipFile(wheel)
    (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
    lines = zf.read(metadata).decode().splitlines()
    # setuptools writes License (older) or License-Expression (newer) for setup(license=...).
    assert {"License: Apache-2.0", "License-Expression: Apache-2.0"} & set(lines)
    (license_file,) = [n for n in zf.namelist() if n.endswith(".dist-info/licenses/LICENSE")
                       or n.endswith(".dist-info/LICENSE")]
    assert zf.read(license_file).decode() == (REPO / "LICENSE").read_text()
    assert "Apache License" in (REPO / "LICENSE").read_text().splitlines()[1]


def test_example_install_hints_name_the_kernel_extras():
    hints = [(path.name, m.group(1)) for path in sorted((REPO / "examples").iterdir()) if path.is_file()
             for m in re.finditer(r"megamoe_plugin\[([^\]]*)\]", path.read_text())]
    assert hints, "no install hint in examples/"
    for name, extras in hints:
        assert {"vllm", "cutlass"} <= set(extras.split(",")), (name, extras)


def test_installed_copy_finds_its_own_files_with_the_same_cache_key(installed, tmp_path):
    target = installed
    probe = ("import json, megamoe_plugin.paths as p, megamoe_plugin.jit as j, megamoe_plugin.configs as c;"
             "print(json.dumps([str(p.CSRC_DIR), str(p.CONFIGS_DIR), j._sources_digest()]))")
    # Run outside the repo so the source tree cannot shadow the installed copy.
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout
    from megamoe_plugin import jit

    csrc, configs, digest = json.loads(out)
    assert Path(csrc) == target / "megamoe_plugin" / "_csrc"
    assert Path(configs) == target / "megamoe_plugin" / "_configs"
    assert digest == jit._sources_digest()


def test_source_tree_shadowing_the_installed_copy_is_named(installed, tmp_path):
    """A checkout without the built extension imported ahead of the real install (what
    `vllm serve` started in the repo root does) gets an error that names both places.
    (The message is what is checked: in this test environment the editable install's
    import hook would still find the repository's own extension.)"""
    target = installed
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "megamoe_plugin", checkout / "megamoe_plugin",
                    ignore=shutil.ignore_patterns("_runtime.*", "__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(target))
    probe = "import megamoe_plugin.native as n; print(n.__file__); print(n._missing_message())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=checkout, env=env, capture_output=True, text=True,
                         check=True).stdout
    imported_from, message = out.splitlines()
    assert Path(imported_from).parent == checkout / "megamoe_plugin"
    assert "shadows it" in message and str(target / "megamoe_plugin") in message
