"""Where the project's non-Python files live (kernel sources, shipped config tables).

An installed wheel carries them inside the package (setup.py maps csrc/ and configs/ to
megamoe_plugin/_csrc and megamoe_plugin/_configs); a source checkout or an editable install
uses the repository's own csrc/ and configs/. (The kernel cache's folder, MEGAMOE_CACHE_DIR,
is megamoe_plugin.settings.cache_dir.)
"""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent


def _installed_or_source(installed: Path, source: Path) -> Path:
    return installed if installed.is_dir() else source


CSRC_DIR = _installed_or_source(PACKAGE_DIR / "_csrc", REPO_DIR / "csrc")
CONFIGS_DIR = _installed_or_source(PACKAGE_DIR / "_configs", REPO_DIR / "configs")

