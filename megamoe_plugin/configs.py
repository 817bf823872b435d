"""Shipped tuning tables: per GPU and shape, the kernel config to use at each load.

`configs/<GPU name, spaces as underscores>.json` (the name is what
torch.cuda.get_device_name() reports, e.g. configs/NVIDIA_H200.json) holds:

    {"gpu": "NVIDIA H200", "version": 1, "note": "...optional...",
     "tables": [{"shape": {"num_local_experts": 32, "hidden": 7168,
                           "intermediate_size": 2048, "num_topk": 8},
                 "entries": {"0.25": {"block_m": 64, "num_stages": 5}, ...}}, ...]}

Shapes are per rank (local experts), because per-rank work with E/R local experts is
the same at any EP width. Entry keys are expected tokens per expert
(tokens * R * K / E, DESIGN.md section 5), the quantity the best config depends on.
An entry may omit block_m or num_stages; the heuristic fills the gap at the entry's
own token count, so every entry is checked against shared memory once, at load.

Tables are read once per process and validated completely: a bad field raises a
ValueError naming the file and the JSON path, rather than launching a config the
kernel cannot run. `lookup_config` is cached on its arguments, so in the per-call
path it costs one dict lookup and no file I/O.

Until the tuning sweep runs, the shipped H200 table is the heuristic evaluated at the
reference configs of DESIGN.md section 8; regenerate it with
    python -m megamoe_plugin.configs --generate --output configs/NVIDIA_H200.json
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import re
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from .heuristics import (
    BLOCK_K,
    DEFAULT_NUMERICS,
    MIN_STAGES,
    SMEM_LIMIT,
    IMPLEMENTED_BLOCK_M,
    KernelConfig,
    default_config,
    default_num_stages,
    expected_tokens_per_expert,
    select_block_m,
    smem_bytes,
)
from .paths import CONFIGS_DIR

SCHEMA_VERSION = 1
GENERATED_NOTE = "from the heuristic; replace with the tuning sweep"

_TOP_KEYS = {"gpu": True, "version": True, "tables": True, "note": False}  # key -> required
_TABLE_KEYS = {"shape": True, "entries": True}
_SHAPE_KEYS = {"num_local_experts": True, "hidden": True, "intermediate_size": True, "num_topk": True}
_ENTRY_KEYS = {"block_m": False, "num_stages": False}
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


@dataclasses.dataclass(frozen=True)
class ConfigTable:
    """A validated table file."""

    gpu: str
    note: Optional[str]
    shapes: Mapping[TableShape, ShapeTable]


def table_path(gpu_name: str, configs_dir: Union[str, Path, None] = None) -> Path:
    """The table file for a GPU: spaces in the device name become underscores."""
    return Path(CONFIGS_DIR if configs_dir is None else configs_dir) / (gpu_name.replace(" ", "_") + ".json")


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

    def check_table(self, obj: Any) -> ConfigTable:
        self.check_object(obj, "$", _TOP_KEYS)
        if not isinstance(obj["gpu"], str) or not obj["gpu"]:
            self.fail("$.gpu", f"expected a non-empty string, got {json.dumps(obj['gpu'])}")
        if not _is_int(obj["version"]) or obj["version"] != SCHEMA_VERSION:
            self.fail("$.version", f"expected {SCHEMA_VERSION}, got {json.dumps(obj['version'])}")
        if "note" in obj and not isinstance(obj["note"], str):
            self.fail("$.note", f"expected a string, got {json.dumps(obj['note'])}")
        tables = obj["tables"]
        if not isinstance(tables, list) or not tables:
            self.fail("$.tables", "expected a non-empty array")
        shapes: Dict[TableShape, ShapeTable] = {}
        first_path: Dict[TableShape, str] = {}
        for i, table in enumerate(tables):
            path = f"$.tables[{i}]"
            self.check_object(table, path, _TABLE_KEYS)
            shape = self.check_shape(table["shape"], f"{path}.shape")
            if shape in shapes:
                self.fail(f"{path}.shape", f"duplicates {first_path[shape]}")
            first_path[shape] = f"{path}.shape"
            shapes[shape] = self.check_entries(table["entries"], f"{path}.entries", shape)
        return ConfigTable(gpu=obj["gpu"], note=obj.get("note"), shapes=types.MappingProxyType(shapes))

    def check_shape(self, value: Any, path: str) -> TableShape:
        self.check_object(value, path, _SHAPE_KEYS)
        return TableShape(
            num_local_experts=self.check_int(value["num_local_experts"], f"{path}.num_local_experts"),
            hidden=self.check_int(value["hidden"], f"{path}.hidden", BLOCK_K, BLOCK_K),
            intermediate_size=self.check_int(value["intermediate_size"], f"{path}.intermediate_size", BLOCK_K, BLOCK_K),
            num_topk=self.check_int(value["num_topk"], f"{path}.num_topk"),
        )

    def check_entries(self, value: Any, path: str, shape: TableShape) -> ShapeTable:
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
            points[expected] = (key, self.check_entry(entry, entry_path, expected, shape))
        ordered = sorted(points.items())
        return ShapeTable(expected_tokens=tuple(p for p, _ in ordered), entries=tuple(e for _, (_, e) in ordered))

    def check_entry(self, value: Any, path: str, expected: float, shape: TableShape) -> TunedEntry:
        self.check_object(value, path, _ENTRY_KEYS)
        if not value:
            self.fail(path, "empty entry: give block_m and/or num_stages")
        if "block_m" in value:
            block_m = self.check_int(value["block_m"], f"{path}.block_m")
            if block_m not in IMPLEMENTED_BLOCK_M:
                self.fail(f"{path}.block_m", f"{block_m} is not an implemented tier {IMPLEMENTED_BLOCK_M}")
        else:
            block_m = select_block_m(expected)
        # A version-1 entry serves both numerics modes: it must fit the larger ("exact").
        if "num_stages" not in value:
            num_stages = default_num_stages(block_m, shape.num_local_experts, shape.hidden, shape.intermediate_size,
                                            numerics="exact")
        else:
            num_stages = self.check_int(value["num_stages"], f"{path}.num_stages", MIN_STAGES)
            needed = smem_bytes(block_m, num_stages, shape.num_local_experts, "exact")
            if needed > SMEM_LIMIT:
                self.fail(f"{path}.num_stages",
                          f"{num_stages} stages of block_m={block_m} with {shape.num_local_experts} local experts "
                          f"need {needed} bytes of shared memory, more than the {SMEM_LIMIT} available")
        return TunedEntry(block_m=block_m, num_stages=num_stages)


def validate_table(obj: Any, source: str) -> ConfigTable:
    """Check a parsed table file against the schema and the kernel's limits.

    Raises ValueError("<source>: <JSON path>: <problem>") at the first bad field:
    unknown or missing keys, wrong types, an unsupported block_m, a num_stages that
    does not fit in shared memory, a non-numeric or duplicate entry key, no entries.
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
    return str(CONFIGS_DIR if configs_dir is None else Path(configs_dir))


def load_table(gpu_name: str, configs_dir: Union[str, Path, None] = None) -> Optional[ConfigTable]:
    """The validated table for a GPU, or None if there is no file for it.

    Cached per (gpu_name, configs_dir): the file is read and validated once per process.
    """
    return _load(gpu_name, _dir_key(configs_dir))


@functools.lru_cache(maxsize=None)
def _lookup(gpu_name: str, num_ranks: int, num_experts: int, num_topk: int, hidden: int, intermediate_size: int,
            num_tokens: int, num_sms: int, configs_dir: str, numerics: str) -> KernelConfig:
    config = default_config(num_ranks, num_experts, num_topk, hidden, intermediate_size, num_tokens, num_sms,
                            numerics)
    table = _load(gpu_name, configs_dir)
    shape_table = None if table is None else table.shapes.get(
        TableShape(num_experts // num_ranks, hidden, intermediate_size, num_topk))
    if shape_table is None:
        return config
    entry = shape_table.nearest(expected_tokens_per_expert(num_tokens, num_ranks, num_topk, num_experts))
    return dataclasses.replace(config, block_m=entry.block_m, num_stages=entry.num_stages)


def lookup_config(gpu_name: str, num_ranks: int, num_experts: int, num_topk: int, hidden: int,
                  intermediate_size: int, num_tokens: int, num_sms: int,
                  configs_dir: Union[str, Path, None] = None, numerics: str = DEFAULT_NUMERICS) -> KernelConfig:
    """The config for a call: the GPU's table entry if there is one, else the heuristic
    (whose pipeline depth depends on the numerics mode's shared memory).

    The table must have this exact shape (num_experts / num_ranks local experts, hidden,
    intermediate_size, num_topk); of its entries the one nearest to this call's
    expected tokens per expert in log space is used, with num_sms from the call.
    Results are cached on all arguments (normalized to positional values, the
    directory as a string), so a repeated call is a dict lookup. The cache grows by
    one entry per distinct token count, bounded by the batch sizes a server runs.
    """
    return _lookup(gpu_name, num_ranks, num_experts, num_topk, hidden, intermediate_size, num_tokens, num_sms,
                   _dir_key(configs_dir), numerics)


# DESIGN.md section 8: per-rank shapes of real models with 32 local experts, and the
# token counts per rank the benchmarks measure; tables use R = 1, E = 32.
REFERENCE_SHAPES = {
    "v3": TableShape(num_local_experts=32, hidden=7168, intermediate_size=2048, num_topk=8),
    "v4flash": TableShape(num_local_experts=32, hidden=4096, intermediate_size=2048, num_topk=6),
    "qwen235": TableShape(num_local_experts=32, hidden=4096, intermediate_size=1536, num_topk=8),
    "qwen30": TableShape(num_local_experts=32, hidden=2048, intermediate_size=768, num_topk=8),
}
REFERENCE_TOKENS_PER_RANK = (1, 8, 32, 128, 512, 2048, 8192)


def _format_expected(expected: float) -> str:
    return str(int(expected)) if expected.is_integer() else repr(expected)


def generate_table(gpu_name: str = "NVIDIA H200", shapes: Sequence[TableShape] = tuple(REFERENCE_SHAPES.values()),
                   tokens_per_rank: Sequence[int] = REFERENCE_TOKENS_PER_RANK) -> Dict[str, Any]:
    """A table file's content from the heuristic, at one rank (per-rank work is the same at any R)."""
    tables = []
    for shape in shapes:
        entries = {}
        for tokens in tokens_per_rank:
            expected = expected_tokens_per_expert(tokens, 1, shape.num_topk, shape.num_local_experts)
            block_m = select_block_m(expected)
            entries[_format_expected(expected)] = {
                "block_m": block_m,
                "num_stages": default_num_stages(block_m, shape.num_local_experts, shape.hidden,
                                                 shape.intermediate_size, numerics="exact"),
            }
        tables.append({"shape": shape._asdict(), "entries": entries})
    return {"gpu": gpu_name, "version": SCHEMA_VERSION, "note": GENERATED_NOTE, "tables": tables}


def format_table(obj: Mapping[str, Any]) -> str:
    """The canonical text of a table file (what the shipped files contain)."""
    return json.dumps(obj, indent=2) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe_plugin.configs", description=__doc__.split("\n")[0])
    parser.add_argument("--generate", action="store_true", required=True,
                        help="produce the table from the heuristic for the DESIGN.md section 8 reference configs")
    parser.add_argument("--gpu", default="NVIDIA H200", help="GPU name to put in the table (default: %(default)s)")
    parser.add_argument("--output", type=Path, help="write the table here instead of printing it")
    args = parser.parse_args(argv)
    text = format_table(generate_table(args.gpu))
    validate_table(json.loads(text), "generated table")
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
