"""What `register()` does, step by step (see the package docstring).

vLLM has no registry of MoE backends: `--moe-backend` is the pydantic `Literal`
`MoEBackend` on `KernelConfig.moe_backend` (vllm/config/kernel.py), and argparse's
choices are derived from the dataclass fields through the `lru_cache`d
`vllm.engine.arg_utils._compute_kwargs`. So the plugin

- rebinds `vllm.config.kernel.MoEBackend` to the Literal plus "megamoe_sm90" (modules
  imported later, e.g. vllm.engine.arg_utils in a worker, pick it up by name),
- rewrites the `moe_backend` annotation of the already-built config dataclasses
  (KernelConfig, SpeculativeConfig, and EngineArgs if imported) and rebuilds the
  pydantic ones,
- clears `_compute_kwargs`'s cache so the next parser build sees the new choice.

It also sends the package's log records (the watchdog's kernel-failure lines, the
warm-up's progress) to the "vllm.megamoe_sm90" logger: vLLM's logging config shows only
its "vllm.*" loggers (serving.route_logs_to).

Everything is checked before it is changed and every step is a no-op when already
done, so calling `register()` twice (or in a process where vLLM already loaded it)
changes nothing. Nothing here imports torch.cuda state or vLLM's model/kernel modules.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import types
import typing
from typing import Any, Literal

from .. import serving
from . import BACKEND

logger = logging.getLogger("vllm.megamoe_sm90")

_lock = threading.RLock()
_registered = False


# ------------------------------------------------------------------ the MoEBackend Literal


def _extended(literal: Any) -> Any:
    """The Literal with BACKEND appended (the same object when it is already there)."""
    args = typing.get_args(literal)
    if BACKEND in args:
        return literal
    return Literal[tuple(args) + (BACKEND,)]  # type: ignore[misc]


def _with_backend(annotation: Any) -> Any:
    """`annotation` with every Literal in it (also inside Optional/Union) extended by
    BACKEND; the same object when nothing changes. String annotations are left alone:
    they resolve through the patched module attribute."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return _extended(annotation)
    if origin is typing.Union or (origin is not None and origin is getattr(types, "UnionType", object())):
        args = typing.get_args(annotation)
        new_args = tuple(_with_backend(a) for a in args)
        if all(a is b for a, b in zip(args, new_args)):
            return annotation
        return typing.Union[new_args]  # type: ignore[return-value]
    return annotation


def _patch_field(cls: type, name: str, *, pydantic: bool) -> None:
    """Extend the Literal of dataclass field cls.<name> (annotation, dataclass field type,
    pydantic field info) and rebuild the pydantic dataclass when anything changed."""
    field = getattr(cls, "__dataclass_fields__", {}).get(name)
    if field is None:
        return
    changed = False
    annotations = cls.__dict__.get("__annotations__", {})
    if name in annotations:
        new = _with_backend(annotations[name])
        if new is not annotations[name]:
            annotations[name] = new
            changed = True
    new = _with_backend(field.type)
    if new is not field.type:
        field.type = new
        changed = True
    info = getattr(cls, "__pydantic_fields__", {}).get(name) if pydantic else None
    if info is not None:
        new = _with_backend(info.annotation)
        if new is not info.annotation:
            info.annotation = new
            changed = True
    if changed and pydantic:
        from pydantic.dataclasses import rebuild_dataclass

        rebuild_dataclass(cls, force=True)


def _patch_moe_backend_literal() -> None:
    import vllm.config.kernel as kernel_mod

    new = _extended(kernel_mod.MoEBackend)
    kernel_mod.MoEBackend = new  # modules imported from now on see the new Literal
    _patch_field(kernel_mod.KernelConfig, "moe_backend", pydantic=True)

    # Already-imported modules that copied the name, and their dataclasses.
    for mod_name in ("vllm.config.speculative", "vllm.engine.arg_utils",
                     "vllm.model_executor.layers.fused_moe.config"):
        mod = sys.modules.get(mod_name)
        if mod is not None and hasattr(mod, "MoEBackend"):
            mod.MoEBackend = new
    spec_mod = sys.modules.get("vllm.config.speculative")
    if spec_mod is not None and hasattr(spec_mod, "SpeculativeConfig"):
        _patch_field(spec_mod.SpeculativeConfig, "moe_backend", pydantic=True)
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None:
        if hasattr(arg_utils, "EngineArgs"):
            _patch_field(arg_utils.EngineArgs, "moe_backend", pydantic=False)
        compute_kwargs = getattr(arg_utils, "_compute_kwargs", None)
        if compute_kwargs is not None and hasattr(compute_kwargs, "cache_clear"):
            compute_kwargs.cache_clear()  # argparse choices are rebuilt from the new Literal


# ------------------------------------------------------------------ passthrough all2all


def _patch_passthrough_binding() -> None:
    """vLLM >= 0.33: bind all2all_backend="passthrough" for megamoe_sm90 as vLLM does for
    its own self-dispatching MoE-EP megakernels (no all2all runs around the kernel).
    Older versions have no passthrough backend; the plugin's own pass-through
    prepare/finalize is used there regardless of all2all_backend."""
    import vllm.config.kernel as kernel_mod

    original = getattr(kernel_mod, "bind_passthrough_all2all_backend", None)
    passthrough = getattr(kernel_mod, "PASSTHROUGH_ALL2ALL_BACKEND", None)
    if original is None or passthrough is None or getattr(original, "_megamoe_wrapped", False):
        return

    def bind_passthrough_all2all_backend(moe_backend, parallel_config):
        if moe_backend != BACKEND:
            return original(moe_backend, parallel_config)
        a2a = parallel_config.all2all_backend
        if a2a == passthrough:
            return None
        if a2a != "allgather_reducescatter":  # vLLM's default: the user did not choose one
            raise ValueError(
                f"moe_backend={BACKEND!r} dispatches and combines tokens inside its kernel and cannot be paired "
                f"with all2all_backend={a2a!r}: leave --all2all-backend unset (or pick another --moe-backend).")
        logger.info("moe_backend=%r: using all2all_backend=%r (dispatch and combine run inside the MegaMoE "
                    "kernel).", BACKEND, passthrough)
        parallel_config.all2all_backend = passthrough
        return None

    bind_passthrough_all2all_backend._megamoe_wrapped = True  # type: ignore[attr-defined]
    bind_passthrough_all2all_backend._megamoe_original = original  # type: ignore[attr-defined]
    bind_passthrough_all2all_backend.__doc__ = original.__doc__
    kernel_mod.bind_passthrough_all2all_backend = bind_passthrough_all2all_backend


def passthrough_all2all_supported() -> bool:
    import vllm.config.kernel as kernel_mod

    return hasattr(kernel_mod, "PASSTHROUGH_ALL2ALL_BACKEND")


# ------------------------------------------------------------------ the fp8 quantization config


class _LazyQuantConfigs(dict):
    """vLLM's `_CUSTOMIZED_METHOD_TO_QUANT_CONFIG` with lazily imported entries.

    vLLM merges this dict into its method table with `dict.update` and then looks the
    method up; overriding `__iter__`/`keys`/`__getitem__` makes `update` go through
    `__getitem__`, which imports the plugin's config class (and with it vLLM's FP8
    modules) only when "fp8" is actually resolved. Other plugins' eager entries behave
    as before."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loaders = {}

    def set_lazy(self, key, loader) -> None:
        self._loaders[key] = loader
        dict.__setitem__(self, key, _Pending(key))

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        if isinstance(value, _Pending):
            value = self._loaders[key]()
            dict.__setitem__(self, key, value)
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __iter__(self):
        return iter(list(dict.keys(self)))

    def keys(self):
        return list(dict.keys(self))

    def values(self):
        return [self[k] for k in self.keys()]

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def __setitem__(self, key, value):  # an eager registration replaces a lazy one
        self._loaders.pop(key, None)
        dict.__setitem__(self, key, value)


class _Pending:
    def __init__(self, key):
        self.key = key

    def __repr__(self):
        return f"<megamoe lazy quantization config {self.key!r}>"


def _load_fp8_config():
    from .quant_config import MegaMoEFp8Config

    return MegaMoEFp8Config


def _load_deepseek_v4_config():
    """Ours over whichever class vLLM itself resolves "deepseek_v4_fp8" to (it picks one by platform):
    that lookup runs with our entry set aside."""
    import vllm.model_executor.layers.quantization as quant_mod

    from .quant_config import megamoe_deepseek_v4_config

    registry = quant_mod._CUSTOMIZED_METHOD_TO_QUANT_CONFIG
    ours = dict.pop(registry, "deepseek_v4_fp8")
    try:
        base = quant_mod.get_quantization_config("deepseek_v4_fp8")
    finally:
        dict.__setitem__(registry, "deepseek_v4_fp8", ours)
    return megamoe_deepseek_v4_config(base)


def _has_deepseek_v4() -> bool:
    """Whether this vLLM has DeepSeek-V4's quantization config (looked for on disk: importing its
    package imports the whole model)."""
    import vllm

    return any(os.path.exists(os.path.join(path, "models", "deepseek_v4", "quant_config.py"))
               for path in getattr(vllm, "__path__", []))


def _register_quant_configs() -> None:
    """Our configs over vLLM's "fp8" and, where vLLM has DeepSeek-V4, "deepseek_v4_fp8"."""
    import vllm.model_executor.layers.quantization as quant_mod

    registry = getattr(quant_mod, "_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", None)
    if registry is None:
        # A vLLM without the customized-method dict (and without DeepSeek-V4): register eagerly.
        quant_mod.register_quantization_config("fp8")(_load_fp8_config())
        return
    configs = [("fp8", _load_fp8_config)] + ([("deepseek_v4_fp8", _load_deepseek_v4_config)]
                                             if _has_deepseek_v4() else [])
    if not isinstance(registry, _LazyQuantConfigs):
        registry = quant_mod._CUSTOMIZED_METHOD_TO_QUANT_CONFIG = _LazyQuantConfigs(registry)
    for key, loader in configs:
        current = dict.get(registry, key)
        if current is not None and not isinstance(current, _Pending):
            if getattr(current, "_megamoe", False):
                continue  # already resolved to our class
            logger.warning("megamoe_plugin: another plugin registered quantization %r (%s); the MegaMoE config "
                           "replaces it", key, current)
        registry.set_lazy(key, loader)


# ------------------------------------------------------------------ entry point


def register() -> None:
    global _registered
    with _lock:
        _patch_moe_backend_literal()  # cheap to repeat; also fixes modules imported since
        if _registered:
            return
        _patch_passthrough_binding()
        _register_quant_configs()
        serving.route_logs_to(logger)  # vLLM shows only its "vllm.*" loggers' records
        _registered = True
        logger.debug("megamoe_plugin: registered moe_backend=%r", BACKEND)


def is_registered() -> bool:
    return _registered
