"""Shipped tuning tables: per GPU and shape, the kernel config to use at each load.

`configs/<GPU name, spaces as underscores>.json` (the name is what
torch.cuda.get_device_name() reports, e.g. configs/NVIDIA_H200.json) holds:

    {"gpu": "NVIDIA H200", "version": 2, "note": "...optional...",
     "tables": [{"shape": {"num_local_experts": 32, "hidden": 7168,
                           "intermediate_size": 2048, "num_topk": 8},
                 "numerics": "fast", "note": "...optional: how it was measured...",
                 "entries": {"0.25": {"block_m": 8, "num_stages": 6, "us": 71.2,
                                      "runner_up": {"block_m": 16, "num_stages": 6, "us": 72.0}},
                             ...}}, ...]}

Shapes are per rank (local experts), because per-rank work with E/R local experts is
the same at any EP width. Entry keys are expected tokens per expert
(tokens * R * K / E, docs/design.md section 5), the quantity the best config depends on.
An entry may omit block_m or num_stages; the heuristic fills the gap at the entry's
own token count, so every entry is checked against shared memory once, at load.

A table with "numerics" serves calls in that mode (docs/design.md section 2); one without
serves both, so a shape may have one table per mode and one for both, the mode's own
winning. A table with "weights": "mxfp4" serves calls on MXFP4 experts (read at 4 bits: other
tiers and depths win), in the modes the kernel runs them in (fast); one without serves FP8
experts. "us" is the measured median time of the entry's config and "runner_up" the
second fastest config measured (`python -m megamoe_plugin.tune` writes both, so a table
says what its choices rest on); an entry with "us" names its block_m and num_stages.
Version 1 files (no "numerics", "note" on tables, "us" or "runner_up") are still read.

The shipped tables come from `python -m megamoe_plugin.tune` run on that GPU (each
table's note says the command and the date); the built-in heuristic serves the shapes
they do not have.

Tables are read once per process and validated completely: a bad field raises a
ValueError naming the file and the JSON path, rather than launching a config the
kernel cannot run. `lookup_config` is cached on its arguments, so in the per-call
path it costs one dict lookup and no file I/O. MEGAMOE_CONFIGS_DIR, when set, is where
the tables are read from instead of the shipped configs/ (a table tuned on this machine,
or an installed package whose own folder is read-only).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import re
import types
from pathlib import Path
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

from .heuristics import (
    BLOCK_K,
    DEFAULT_NUMERICS,
    NUMERICS_MODES,
    Numerics,
    SMEM_LIMIT,
    implemented_block_m,
    KernelConfig,
    WEIGHT_FORMATS,
    check_numerics,
    check_weight_format,
    default_config,
    default_num_stages,
    expected_tokens_per_expert,
    min_pipeline_stages,
    select_block_m,
    smem_bytes,
)
from .paths import CONFIGS_DIR
from . import settings

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)

# key -> required, per schema version.
_TOP_KEYS = {"gpu": True, "version": True, "tables": True, "note": False}
_TABLE_KEYS = {1: {"shape": True, "entries": True},
               2: {"shape": True, "numerics": False, "weights": False, "note": False, "entries": True}}
_SHAPE_KEYS = {"num_local_experts": True, "hidden": True, "intermediate_size": True, "num_topk": True}
_ENTRY_KEYS = {1: {"block_m": False, "num_stages": False},
               2: {"block_m": False, "num_stages": False, "us": False, "runner_up": False}}
_RUNNER_UP_KEYS = {"block_m": True, "num_stages": True, "us": True}
# A plain decimal number as JSON writes it (float() alone would also take "1_0", " 1", "nan").
_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


class TableShape(NamedTuple):
    """What a table is keyed by: the per-rank problem shape."""

    num_local_experts: int
    hidden: int
    intermediate_size: int
    num_topk: int


class TunedEntry(NamedTuple):
    block_m: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class ShapeTable:
    """One shape's entries, sorted by expected tokens per expert."""

    expected_tokens: Tuple[float, ...]
    entries: Tuple[TunedEntry, ...]

    def nearest(self, expected_tokens: float) -> TunedEntry:
        """The entry nearest in log space (the larger one on a tie).

        Log space because the entries are spaced geometrically (1, 8, 32, ... tokens)
        and a config's fitness changes with the ratio of loads, not their difference.
        Zero tokens takes the smallest entry.
        """
        points = self.expected_tokens
        i = bisect.bisect_left(points, expected_tokens)
        if i == 0:
            return self.entries[0]
        if i == len(points):
            return self.entries[-1]
        # log(hi / x) <= log(x / lo)  <=>  lo * hi <= x * x
        return self.entries[i if points[i - 1] * points[i] <= expected_tokens * expected_tokens else i - 1]


# What a table serves: a shape, in one numerics mode or (None) in both, for one weight format.
TableKey = Tuple[TableShape, Optional[str], str]


@dataclasses.dataclass(frozen=True)
class ConfigTable:
    """A validated table file."""

    gpu: str
    note: Optional[str]
    tables: Mapping[TableKey, ShapeTable]

    def find(self, shape: TableShape, numerics: Numerics, weights: str = "fp8") -> Optional[ShapeTable]:
        """The table a call of this shape in this numerics mode on experts of format `weights`
        reads: the mode's own, else the shape's table for both modes, else None."""
        return self.tables.get((shape, numerics, weights), self.tables.get((shape, None, weights)))


def table_path(gpu_name: str, configs_dir: Union[str, Path, None] = None) -> Path:
    """The table file for a GPU: spaces in the device name become underscores. The
    directory defaults to MEGAMOE_CONFIGS_DIR if set, else the shipped configs."""
    return Path(_dir_key(configs_dir)) / (gpu_name.replace(" ", "_") + ".json")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry_path(path: str, key: str) -> str:
    return f"{path}[{json.dumps(key)}]"


class _Validator:
    """Walks a parsed table, raising ValueError('<source>: <JSON path>: <problem>')."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, problem: str) -> None:
        raise ValueError(f"{self.source}: {path}: {problem}")

    def check_object(self, value: Any, path: str, keys: Mapping[str, bool]) -> Dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected an object, got {type(value).__name__}")
        for key in value:
            if key not in keys:
                self.fail(path, f"unknown key {key!r} (allowed: {', '.join(keys)})")
        for key, required in keys.items():
            if required and key not in value:
                self.fail(path, f"missing key {key!r}")
        return value

    def check_int(self, value: Any, path: str, minimum: int = 1, multiple_of: int = 1) -> int:
        if not _is_int(value):
            self.fail(path, f"expected an integer, got {json.dumps(value)}")
        if value < minimum or value % multiple_of != 0:
            what = f"a multiple of {multiple_of} >= {minimum}" if multiple_of > 1 else f"an integer >= {minimum}"
            self.fail(path, f"expected {what}, got {value}")
        return value

    def check_number(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            self.fail(path, f"expected a positive number, got {json.dumps(value)}")
        return float(value)

    def check_table(self, obj: Any) -> ConfigTable:
        self.check_object(obj, "$", _TOP_KEYS)
        if not isinstance(obj["gpu"], str) or not obj["gpu"]:
            self.fail("$.gpu", f"expected a non-empty string, got {json.dumps(obj['gpu'])}")
        version = obj["version"]
        if not _is_int(version) or version not in READABLE_VERSIONS:
            self.fail("$.version", f"expected one of {READABLE_VERSIONS}, got {json.dumps(version)}")
        self.check_note(obj, "$")
        tables = obj["tables"]
        if not isinstance(tables, list) or not tables:
            self.fail("$.tables", "expected a non-empty array")
        parsed: Dict[TableKey, ShapeTable] = {}
        first_path: Dict[TableKey, str] = {}
        for i, table in enumerate(tables):
            path = f"$.tables[{i}]"
            self.check_object(table, path, _TABLE_KEYS[version])
            shape = self.check_shape(table["shape"], f"{path}.shape")
            numerics = table.get("numerics")
            if "numerics" in table and numerics not in NUMERICS_MODES:  # null too: leave the key out for both
                self.fail(f"{path}.numerics", f"expected one of {NUMERICS_MODES}, got {json.dumps(numerics)}")
            weights = table.get("weights", "fp8")
            if weights not in WEIGHT_FORMATS:
                self.fail(f"{path}.weights", f"expected one of {WEIGHT_FORMATS}, got {json.dumps(weights)}")
            self.check_note(table, path)
            key = (shape, numerics, weights)
            if key in parsed:
                self.fail(f"{path}.shape", f"duplicates {first_path[key]}"
                          + ("" if numerics is None else f" for numerics {numerics!r}")
                          + ("" if weights == "fp8" else f" for {weights} weights"))
            first_path[key] = f"{path}.shape"
            # A table for both modes must run in both: it is checked against each.
            modes = NUMERICS_MODES if numerics is None else (numerics,)
            for mode in modes:
                if not implemented_block_m(mode, weights):
                    self.fail(f"{path}.numerics", f"the kernel runs {weights} weights in no tier of {mode!r} numerics"
                                                  + (": give the modes it runs them in" if numerics is None else ""))
            parsed[key] = self.check_entries(table["entries"], f"{path}.entries", shape, version, modes, weights)
        return ConfigTable(gpu=obj["gpu"], note=obj.get("note"), tables=types.MappingProxyType(parsed))

    def check_note(self, obj: Dict[str, Any], path: str) -> None:
        if "note" in obj and not isinstance(obj["note"], str):
            self.fail(f"{path}.note", f"expected a string, got {json.dumps(obj['note'])}")

    def check_shape(self, value: Any, path: str) -> TableShape:
        self.check_object(value, path, _SHAPE_KEYS)
        return TableShape(
            num_local_experts=self.check_int(value["num_local_experts"], f"{path}.num_local_experts"),
            hidden=self.check_int(value["hidden"], f"{path}.hidden", BLOCK_K, BLOCK_K),
            intermediate_size=self.check_int(value["intermediate_size"], f"{path}.intermediate_size", BLOCK_K, BLOCK_K),
            num_topk=self.check_int(value["num_topk"], f"{path}.num_topk"),
        )

    def check_entries(self, value: Any, path: str, shape: TableShape, version: int,
                      modes: Tuple[str, ...], weights: str) -> ShapeTable:
        if not isinstance(value, dict):
            self.fail(path, f"expected an object, got {type(value).__name__}")
        if not value:
            self.fail(path, "has no entries")
        points: Dict[float, Tuple[str, TunedEntry]] = {}
        for key, entry in value.items():
            entry_path = _entry_path(path, key)
            expected = float(key) if _NUMBER.fullmatch(key) else math.nan
            if not (math.isfinite(expected) and expected > 0):
                self.fail(entry_path, "key must be a positive number (expected tokens per expert)")
            if expected in points:
                self.fail(entry_path, f"same expected tokens as {_entry_path(path, points[expected][0])}")
            points[expected] = (key, self.check_entry(entry, entry_path, expected, shape, version, modes, weights))
        ordered = sorted(points.items())
        return ShapeTable(expected_tokens=tuple(p for p, _ in ordered), entries=tuple(e for _, (_, e) in ordered))

    def check_entry(self, value: Any, path: str, expected: float, shape: TableShape, version: int,
                    modes: Tuple[str, ...], weights: str) -> TunedEntry:
        self.check_object(value, path, _ENTRY_KEYS[version])
        if not value:
            self.fail(path, "empty entry: give block_m and/or num_stages")
        if "us" in value:
            if "block_m" not in value or "num_stages" not in value:
                self.fail(path, "an entry with a measured time (us) must name the block_m and num_stages measured")
            self.check_number(value["us"], f"{path}.us")
        elif "runner_up" in value:
            self.fail(path, "runner_up needs the entry's own measured time (us) beside it")
        if "block_m" in value:
            block_m = self.check_block_m(value["block_m"], f"{path}.block_m", modes, weights)
        else:
            block_m = select_block_m(expected, [t for t in implemented_block_m(modes[0], weights)
                                                if all(t in implemented_block_m(m, weights) for m in modes)])
        if "num_stages" not in value:  # the heuristic's depth, the shallowest of the table's modes
            num_stages = min(default_num_stages(block_m, shape.num_local_experts, shape.hidden, shape.intermediate_size,
                                                numerics=mode, weights=weights) for mode in modes)
        else:
            num_stages = self.check_num_stages(value["num_stages"], f"{path}.num_stages", block_m, shape, modes,
                                               weights)
        if "runner_up" in value:
            self.check_runner_up(value["runner_up"], f"{path}.runner_up", value, shape, modes, weights)
        return TunedEntry(block_m=block_m, num_stages=num_stages)

    def check_block_m(self, value: Any, path: str, modes: Tuple[str, ...], weights: str) -> int:
        block_m = self.check_int(value, path)
        for mode in modes:  # a table for both modes names a tier both implement
            tiers = implemented_block_m(mode, weights)
            if block_m not in tiers:
                self.fail(path, f"{block_m} is not a tier of {mode!r} numerics {tiers}"
                                + ("" if weights == "fp8" else f" for {weights} weights"))
        return block_m

    def check_num_stages(self, value: Any, path: str, block_m: int, shape: TableShape, modes: Tuple[str, ...],
                         weights: str) -> int:
        num_stages = self.check_int(value, path, min_pipeline_stages(block_m, weights))
        for mode in modes:
            needed = smem_bytes(block_m, num_stages, shape.num_local_experts, mode, weights)
            if needed > SMEM_LIMIT:
                self.fail(path, f"{num_stages} stages of block_m={block_m} with {shape.num_local_experts} local "
                                f"experts need {needed} bytes of shared memory in {mode} numerics"
                                + ("" if weights == "fp8" else f" with {weights} weights")
                                + f", more than the {SMEM_LIMIT} available")
        return num_stages

    def check_runner_up(self, value: Any, path: str, winner: Dict[str, Any], shape: TableShape,
                        modes: Tuple[str, ...], weights: str) -> None:
        """The second fastest config measured: a runnable config other than the winner,
        no faster than it."""
        self.check_object(value, path, _RUNNER_UP_KEYS)
        block_m = self.check_block_m(value["block_m"], f"{path}.block_m", modes, weights)
        num_stages = self.check_num_stages(value["num_stages"], f"{path}.num_stages", block_m, shape, modes, weights)
        if (block_m, num_stages) == (winner["block_m"], winner["num_stages"]):
            self.fail(path, "is the entry's own config")
        if self.check_number(value["us"], f"{path}.us") < winner["us"]:
            self.fail(f"{path}.us", f"{value['us']} is faster than the entry's {winner['us']}: "
                                    "the entry must be the fastest config measured")


def validate_table(obj: Any, source: str) -> ConfigTable:
    """Check a parsed table file against the schema and the kernel's limits.

    Raises ValueError("<source>: <JSON path>: <problem>") at the first bad field:
    unknown or missing keys, wrong types, an unsupported block_m, numerics or weight format
    (or a mode the kernel does not run that format in), a num_stages that does not fit in
    shared memory, a non-numeric or duplicate entry key, no entries, two tables for one
    shape, mode and weight format, a runner-up faster than its entry.
    """
    return _Validator(source).check_table(obj)


def _reject_duplicate_keys(source: str):
    def hook(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        obj: Dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                raise ValueError(f"{source}: duplicate key {key!r} in one object")
            obj[key] = value
        return obj
    return hook


@functools.lru_cache(maxsize=None)
def _load(gpu_name: str, configs_dir: str) -> Optional[ConfigTable]:
    path = table_path(gpu_name, configs_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicate_keys(str(path)))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    table = validate_table(obj, str(path))
    if table.gpu != gpu_name:
        raise ValueError(f"{path}: $.gpu: {table.gpu!r} does not match the GPU {gpu_name!r} the file is named for")
    return table


def _dir_key(configs_dir: Union[str, Path, None]) -> str:
    if configs_dir is None:
        configs_dir = settings.configs_dir() or CONFIGS_DIR
    return str(Path(configs_dir))


def load_table(gpu_name: str, configs_dir: Union[str, Path, None] = None) -> Optional[ConfigTable]:
    """The validated table for a GPU, or None if there is no file for it. The directory
    defaults to MEGAMOE_CONFIGS_DIR if set, else the shipped configs.

    Cached per (gpu_name, configs_dir): the file is read and validated once per process.
    """
    return _load(gpu_name, _dir_key(configs_dir))


@functools.lru_cache(maxsize=None)
def _lookup(gpu_name: str, num_ranks: int, num_experts: int, num_topk: int, hidden: int, intermediate_size: int,
            num_tokens: int, num_sms: int, configs_dir: str, numerics: Numerics, weights: str) -> KernelConfig:
    config = default_config(num_ranks, num_experts, num_topk, hidden, intermediate_size, num_tokens, num_sms,
                            numerics, weights)
    table = _load(gpu_name, configs_dir)
    shape_table = None if table is None else table.find(
        TableShape(num_experts // num_ranks, hidden, intermediate_size, num_topk), numerics, weights)
    if shape_table is None:
        return config
    entry = shape_table.nearest(expected_tokens_per_expert(num_tokens, num_ranks, num_topk, num_experts))
    return dataclasses.replace(config, block_m=entry.block_m, num_stages=entry.num_stages)


def lookup_config(gpu_name: str, num_ranks: int, num_experts: int, num_topk: int, hidden: int,
                  intermediate_size: int, num_tokens: int, num_sms: int,
                  configs_dir: Union[str, Path, None] = None, numerics: Numerics = DEFAULT_NUMERICS,
                  weights: str = "fp8") -> KernelConfig:
    """The config for a call on experts of format `weights`: the GPU's table entry if there is
    one, else the heuristic (whose pipeline depth depends on the numerics mode's and the weight
    format's shared memory).

    The table must have this exact shape (num_experts / num_ranks local experts, hidden,
    intermediate_size, num_topk), this weight format, and serve the call's numerics mode (its
    own table, else the shape's table for both modes); of its entries the one nearest to this call's
    expected tokens per expert in log space is used, with num_sms from the call.
    Results are cached on all arguments (normalized to positional values, the
    directory as a string), so a repeated call is a dict lookup. The cache grows by
    one entry per distinct token count, bounded by the batch sizes a server runs.
    """
    return _lookup(gpu_name, num_ranks, num_experts, num_topk, hidden, intermediate_size, num_tokens, num_sms,
                   _dir_key(configs_dir), check_numerics(numerics), check_weight_format(weights))


# docs/design.md section 8: per-rank shapes of real models with 32 local experts, and the
# token counts per rank the benchmarks measure; tables use R = 1, E = 32.
REFERENCE_SHAPES = {
    "v3": TableShape(num_local_experts=32, hidden=7168, intermediate_size=2048, num_topk=8),
    "v4flash": TableShape(num_local_experts=32, hidden=4096, intermediate_size=2048, num_topk=6),
    "qwen235": TableShape(num_local_experts=32, hidden=4096, intermediate_size=1536, num_topk=8),
    "qwen30": TableShape(num_local_experts=32, hidden=2048, intermediate_size=768, num_topk=8),
}
REFERENCE_TOKENS_PER_RANK = (1, 8, 32, 128, 512, 2048, 8192)


def entry_key(expected_tokens: float) -> str:
    """An entry's key as the tables write it: "2", "0.25"."""
    return str(int(expected_tokens)) if expected_tokens.is_integer() else repr(expected_tokens)


def format_table(obj: Mapping[str, Any]) -> str:
    """The canonical text of a table file (what the shipped files contain)."""
    return json.dumps(obj, indent=2) + "\n"
