"""Where the project's non-Python files live (kernel sources, shipped config tables)."""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
CSRC_DIR = REPO_DIR / "csrc"
CONFIGS_DIR = REPO_DIR / "configs"
