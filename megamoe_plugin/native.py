"""The host runtime extension (csrc/runtime/runtime.cpp): loaded on first use, so the package
imports where it could not be built (no CUDA headers), and fails then with why."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path


def _missing_message() -> str:
    here = Path(__file__).resolve().parent
    message = f"megamoe: the host runtime extension is not built in {here}"
    # The usual cause: a source checkout (e.g. the working directory) earlier on sys.path
    # than the installed package, which has the extension.
    try:
        dist = importlib.metadata.distribution("megamoe_plugin")
        for file in dist.files or []:
            if file.name.startswith("_runtime.") and file.name.endswith((".so", ".pyd")):
                installed = Path(str(dist.locate_file(file))).resolve().parent
                if installed != here:
                    return (f"{message}; the installed megamoe_plugin in {installed} has it but this source tree "
                            "shadows it: run from another directory, or build here (pip install -e .)")
    except importlib.metadata.PackageNotFoundError:
        pass
    return f"{message} (reinstall the package on a machine with the CUDA toolkit headers: pip install -e .)"


def runtime():
    """The `_runtime` extension module; a RuntimeError that says why where it is not built."""
    try:
        from . import _runtime
    except ImportError as exc:
        raise RuntimeError(_missing_message()) from exc
    return _runtime
