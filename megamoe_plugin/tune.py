"""Tuning sweep: time the kernel's configs on this GPU and write the table the op layer reads.

    python -m megamoe_plugin.tune [--shapes v3,v4flash,qwen235,qwen30,e2e] [--tokens 1,8,...,8192]
                                  [--numerics fast,exact] [--weights fp8|mxfp4] [--tiers 8,16,32,64]
                                  [--stages 4,6] [--iters 20] [--output-dir DIR] [--dry-run | --compile-only]

For each shape, numerics mode and token count per rank it times candidate configs
(BLOCK_M tier x pipeline stages) of the fused kernel on one GPU, and writes the fastest
of each into `<output-dir>/<GPU>.json` (configs.table_path; default: MEGAMOE_CONFIGS_DIR,
else the shipped configs/), one table per shape and mode, with its time and the
runner-up's, and the command and date in the table's note. --weights mxfp4 tunes calls on
MXFP4 experts (fast numerics: the modes the kernel runs them in) into tables of their own. Tables of other shapes and
modes already in the file are kept. The op layer then picks the entry nearest to a
call's expected tokens per expert (configs.lookup_config); shapes and modes without a
table keep the heuristic.

One GPU stands for any EP width: per-rank work with E/R local experts is the same as
one rank with E/R experts, so tables are keyed by local experts and tuned at R = 1.

Device time is scarce, so the sweep is pruned: by default each token count measures
the heuristic's tier and its implemented neighbours (one tier down and up), each at the
heuristic's stage count and at half the deepest pipeline worth its shared memory
(heuristics.stages_in_flight: MAX_STAGES / 2, MXFP4's twice that); --tiers and --stages replace those sets.
Every candidate variant is compiled first, in parallel, so no compile lands between
timings; --compile-only stops there (nvcc needs no GPU: precompile on a CPU machine and
copy MEGAMOE_CACHE_DIR over), --dry-run prints the candidates and the number of timed runs.
Each candidate is timed through megamoe_plugin.timing:
the call captured in a CUDA graph, L2 flushed before every replay, median of --iters replays.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from .buffer import BufferShape
from .configs import (
    REFERENCE_SHAPES,
    REFERENCE_TOKENS_PER_RANK,
    SCHEMA_VERSION,
    TableShape,
    entry_key,
    format_table,
    table_path,
    validate_table,
)
from .heuristics import (
    DEFAULT_NUMERICS,
    IMPLEMENTED_BLOCK_M,
    MIN_STAGES,
    NUMERICS_MODES,
    Numerics,
    default_config,
    default_num_stages,
    expected_tokens_per_expert,
    implemented_block_m,
    max_pipeline_stages,
    min_pipeline_stages,
    select_block_m,
    stages_in_flight,
    WEIGHT_FORMATS,
    WEIGHT_NAME_SUFFIX,
)
from .jit import compile_variants
from .kernel_variant import KernelVariant
from .variants import ANY_GRID_SIZE
from .progress import progress_bar

# The shapes the sweep knows by name: docs/design.md section 8's reference configs and the
# tools/e2e model's MoE layer (Qwen3-30B-A3B: qwen30's H/I/top-k with all 128 experts on
# one rank, as megamoe_plugin.bench.vs_vllm and tests/gpu/test_vllm_shaped.py run it).
SHAPES: Mapping[str, TableShape] = {
    **REFERENCE_SHAPES,
    "e2e": TableShape(num_local_experts=128, hidden=2048, intermediate_size=768, num_topk=8),
}
DEFAULT_ITERS = 20
TOP_NOTE = "tables written by python -m megamoe_plugin.tune; each table's note says how and when it was measured"


class Candidate(NamedTuple):
    block_m: int
    num_stages: int


class Point(NamedTuple):
    """One (shape, token count, numerics mode, weight format) of the sweep and the configs it times
    there."""

    shape_name: str
    shape: TableShape
    tokens: int
    numerics: Numerics
    candidates: Tuple[Candidate, ...]
    weights: str = "fp8"

    @property
    def expected_tokens(self) -> float:
        return expected_tokens_per_expert(self.tokens, 1, self.shape.num_topk, self.shape.num_local_experts)

    @property
    def label(self) -> str:
        """The shape's name, with +w4 for MXFP4 experts (as the bench names its configs)."""
        return self.shape_name + WEIGHT_NAME_SUFFIX[self.weights]

    def heuristic(self) -> Candidate:
        """What a call would run without a table: heuristics.default_config at R = 1."""
        s = self.shape
        config = default_config(1, s.num_local_experts, s.num_topk, s.hidden, s.intermediate_size, self.tokens,
                                ANY_GRID_SIZE, self.numerics, self.weights)
        return Candidate(config.block_m, config.num_stages)


# (candidate, median seconds), fastest first.
Timings = List[Tuple[Candidate, float]]
Timer = Callable[[Point, Candidate], float]


def tier_candidates(expected_tokens: float, tiers: Optional[Sequence[int]] = None,
                    numerics: Numerics = DEFAULT_NUMERICS, weights: str = "fp8") -> Tuple[int, ...]:
    """`tiers` if given (those the mode implements for the weight format), else the heuristic's
    tier and its neighbours among those: the tier bounds come from a few measured shapes
    (heuristics._TIER_UPPER_BOUNDS), so the winner elsewhere is near them, not far off."""
    own = implemented_block_m(numerics, weights)
    if tiers is not None:
        return tuple(t for t in tiers if t in own)
    i = own.index(select_block_m(expected_tokens, own))
    return own[max(0, i - 1): i + 2]


def stage_candidates(block_m: int, shape: TableShape, numerics: Numerics,
                     stages: Optional[Sequence[int]] = None, weights: str = "fp8") -> Tuple[int, ...]:
    """Of `stages` (if given) those that fit in shared memory in this numerics mode with this
    weight format; else the heuristic's depth (as many as fit, up to heuristics.stages_in_flight)
    and half that, which shows whether the deepest pipeline is worth its shared memory."""
    most = max_pipeline_stages(block_m, shape.num_local_experts, numerics=numerics, weights=weights)
    if stages is not None:
        least = min_pipeline_stages(block_m, weights)
        return tuple(sorted({s for s in stages if least <= s <= most}))
    heuristic = default_num_stages(block_m, shape.num_local_experts, shape.hidden, shape.intermediate_size,
                                   numerics=numerics, weights=weights)
    return tuple(sorted({heuristic, min(max(min_pipeline_stages(block_m, weights), stages_in_flight(weights) // 2),
                                        most)}))


def plan(shapes: Mapping[str, TableShape], tokens: Sequence[int], numerics: Sequence[str] = NUMERICS_MODES,
         tiers: Optional[Sequence[int]] = None, stages: Optional[Sequence[int]] = None,
         weights: str = "fp8") -> List[Point]:
    """The sweep's points on experts of format `weights`, grouped by shape (the timer builds one
    layer per shape), then by token count (the modes of one count time the same inputs)."""
    for mode in numerics:
        if not implemented_block_m(mode, weights):
            raise ValueError(f"--numerics {mode}: the kernel runs {weights} weights in no tier of {mode!r} numerics")
    points = []
    for name, shape in shapes.items():
        for n in sorted(set(tokens)):
            expected = expected_tokens_per_expert(n, 1, shape.num_topk, shape.num_local_experts)
            for mode in dict.fromkeys(numerics):
                tier_set = tier_candidates(expected, tiers, mode, weights)
                candidates = tuple(Candidate(block_m, s) for block_m in tier_set
                                   for s in stage_candidates(block_m, shape, mode, stages, weights))
                if not tier_set:
                    raise ValueError(f"--tiers {','.join(map(str, tiers))}: none is a tier of {mode} numerics with "
                                     f"{weights} weights {implemented_block_m(mode, weights)}")
                if not candidates:
                    raise ValueError(f"--stages {','.join(map(str, stages))}: none fits in shared memory at any of "
                                     f"the tiers {tier_set} for {name} ({shape.num_local_experts} local experts) in "
                                     f"{mode} numerics with {weights} weights while at least the tier's fewest stages "
                                     f"(heuristics.min_pipeline_stages)")
                points.append(Point(name, shape, n, mode, candidates, weights))
    return points


def variant_of(point: Point, candidate: Candidate) -> KernelVariant:
    """The kernel a candidate runs: one rank, fast_math on (the op's default)."""
    s = point.shape
    return KernelVariant(s.hidden, s.intermediate_size, s.num_topk, s.num_local_experts, 1, candidate.block_m,
                         candidate.num_stages, True, point.numerics, weights=point.weights)


def variants_of(points: Sequence[Point]) -> List[KernelVariant]:
    """Every distinct kernel variant the points time, in sweep order."""
    return list(dict.fromkeys(variant_of(p, c) for p in points for c in p.candidates))


def compile_all(points: Sequence[Point]) -> List[Point]:
    """Compiles every candidate's variant, several at once, with progress; returns the
    points without the candidates whose variant failed to compile (reported on stderr).
    Raises RuntimeError when a point is left without candidates."""
    variants = variants_of(points)
    progress = progress_bar(len(variants), "megamoe tune: compiling", "variant")
    results = compile_variants(variants, on_done=lambda v, result: progress.update())
    progress.close()
    failed = set()
    for v, r in zip(variants, results):
        if isinstance(r, RuntimeError):
            failed.add(v)
            print(f"megamoe tune: {v.name()} does not compile, left out of the sweep:\n{r}", file=sys.stderr)
    kept = []
    for p in points:
        candidates = tuple(c for c in p.candidates if variant_of(p, c) not in failed)
        if not candidates:
            raise RuntimeError(f"megamoe tune: no candidate of {p.label} at {p.tokens} tokens in {p.numerics} "
                               "numerics compiles")
        kept.append(p._replace(candidates=candidates))
    return kept


def sweep(points: Sequence[Point], timer: Timer) -> List[Tuple[Point, Timings]]:
    """Times every candidate of every point with `timer(point, candidate) -> seconds`,
    with progress. Timings come fastest first; a tie keeps the candidates' order."""
    progress = progress_bar(sum(len(p.candidates) for p in points), "megamoe tune: timing", "config")
    results = []
    for p in points:
        progress.set_postfix_str(f"{p.label}, {p.tokens} tokens, {p.numerics}")
        timings = []
        for c in p.candidates:
            timings.append((c, timer(p, c)))
            progress.update()
        results.append((p, sorted(timings, key=lambda ct: ct[1])))
    progress.close()
    return results


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def tables_from(results: Sequence[Tuple[Point, Timings]], note: str) -> List[Dict[str, Any]]:
    """Table objects (configs schema version 2), one per shape, numerics mode and weight format
    (named in the table for MXFP4 only): each point's winner with its time and the runner-up."""
    tables: Dict[Tuple[TableShape, str, str], Dict[str, Any]] = {}
    for point, timings in results:
        table = tables.setdefault((point.shape, point.numerics, point.weights), {
            "shape": point.shape._asdict(), "numerics": point.numerics,
            **({} if point.weights == "fp8" else {"weights": point.weights}), "note": note, "entries": {}})
        (best, t_best), *rest = timings
        entry: Dict[str, Any] = {"block_m": best.block_m, "num_stages": best.num_stages, "us": _us(t_best)}
        if rest:
            (second, t_second), *_ = rest
            entry["runner_up"] = {"block_m": second.block_m, "num_stages": second.num_stages, "us": _us(t_second)}
        table["entries"][entry_key(point.expected_tokens)] = entry
    return list(tables.values())


def merged_file(existing: Optional[Dict[str, Any]], gpu: str, tables: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The table file with `tables` in place of the existing file's tables of the same
    shape, numerics mode and weight format. A table for both modes goes once every mode of
    its shape and format has a new table, as nothing would read it; other tables are kept, and
    a version-1 file's note moves onto its tables."""
    swept = [(t["shape"], t["numerics"], t.get("weights", "fp8")) for t in tables]
    kept = []
    for old in (existing or {}).get("tables", []):
        modes = [old["numerics"]] if "numerics" in old else NUMERICS_MODES
        if all((old["shape"], mode, old.get("weights", "fp8")) in swept for mode in modes):
            continue
        old = dict(old)
        if existing["version"] == 1 and "note" in existing:
            old["note"] = existing["note"]
        kept.append(old)
    return {"gpu": gpu, "version": SCHEMA_VERSION, "note": TOP_NOTE, "tables": kept + list(tables)}


def write_table(results: Sequence[Tuple[Point, Timings]], gpu: str, output_dir: Union[str, Path, None],
                note: str) -> Path:
    """Merges the sweep's tables into `<output_dir>/<gpu>.json` and writes it; the file is
    validated (configs.validate_table) before it replaces the old one, atomically."""
    path = table_path(gpu, output_dir)
    existing = None
    if path.exists():
        existing = json.loads(path.read_text(encoding="utf-8"))
        validate_table(existing, str(path))  # never build on (or silently drop) a file the loader rejects
        if existing["gpu"] != gpu:
            raise ValueError(f"{path}: $.gpu: {existing['gpu']!r} does not match the GPU {gpu!r} the sweep ran on")
    obj = merged_file(existing, gpu, tables_from(results, note))
    text = format_table(obj)
    validate_table(json.loads(text), str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def summary(results: Sequence[Tuple[Point, Timings]]) -> str:
    """The winners beside the heuristic's config: what the table changes."""
    lines = [f"{'shape':8s} {'tokens':>6s} {'rows/exp':>8s} {'numerics':8s}  {'winner':>8s} {'us':>8s}  "
             f"{'runner-up':>9s} {'us':>8s}  {'heuristic':>9s} {'us':>8s}"]
    for p, timings in results:
        (best, t_best), *rest = timings
        second = f"{rest[0][0].block_m}/{rest[0][0].num_stages}" if rest else "-"
        t_second = f"{_us(rest[0][1]):8.1f}" if rest else f"{'-':>8s}"
        heuristic = p.heuristic()
        t_heuristic = dict(timings).get(heuristic)
        lines.append(f"{p.label:8s} {p.tokens:6d} {p.expected_tokens:8.4g} {p.numerics:8s}  "
                     f"{f'{best.block_m}/{best.num_stages}':>8s} {_us(t_best):8.1f}  {second:>9s} {t_second}  "
                     f"{f'{heuristic.block_m}/{heuristic.num_stages}':>9s} "
                     + (f"{_us(t_heuristic):8.1f}" if t_heuristic is not None else f"{'not run':>8s}"))
    return "\n".join(lines)


def describe_plan(points: Sequence[Point], iters: int) -> str:
    """--dry-run: every point's candidates (block_m/stages) and what the sweep will cost."""
    lines = [f"{'shape':8s} {'tokens':>6s} {'rows/exp':>8s} {'numerics':8s}  candidates (block_m/stages)"]
    for p in points:
        lines.append(f"{p.label:8s} {p.tokens:6d} {p.expected_tokens:8.4g} {p.numerics:8s}  "
                     + " ".join(f"{c.block_m}/{c.num_stages}" for c in p.candidates))
    configs = sum(len(p.candidates) for p in points)
    # Per candidate: one eager call before the capture (kernel load), the warm-up
    # replay and `iters` timed replays (timing.graphed, timing.median_call_seconds).
    calls = configs * (iters + 2)
    lines.append(f"{len(points)} points, {configs} configs to time, {calls} kernel runs ({iters} timed + 2 per "
                 f"config), {len(variants_of(points))} kernel variants to compile")
    return "\n".join(lines)


@contextmanager
def forced(candidate: Candidate) -> Iterator[None]:
    """Runs fp8_mega_moe with this candidate's config (ops: MEGAMOE_BLOCK_M, MEGAMOE_NUM_STAGES)."""
    names = {"MEGAMOE_BLOCK_M": str(candidate.block_m), "MEGAMOE_NUM_STAGES": str(candidate.num_stages)}
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class KernelTimer:
    """Times candidates on the current GPU: one random layer (of the points' weight format) and
    buffer per shape, random uniformly routed inputs per token count (the same for every
    candidate of a point)."""

    def __init__(self, points: Sequence[Point], iters: int):
        import torch

        from .timing import l2_flusher

        self.torch = torch
        self.iters = iters
        self.flush = l2_flusher()
        self.gen = torch.Generator(device="cuda").manual_seed(0)
        self.max_tokens: Dict[TableShape, int] = {}
        for p in points:
            self.max_tokens[p.shape] = max(self.max_tokens.get(p.shape, 0), p.tokens)
        self.shape: Optional[Tuple[TableShape, str]] = None  # and the weight format
        self.tokens: Optional[int] = None

    def _load_shape(self, shape: TableShape, weights: str) -> None:
        from . import get_symm_buffer
        from .testing import random_layer_of

        self.layer = self.buf = None  # free the previous shape's weights before allocating these
        self.torch.cuda.empty_cache()
        self.layer = random_layer_of(weights)(shape.num_local_experts, shape.hidden, shape.intermediate_size, "cuda", self.gen)
        self.buf = get_symm_buffer(None, shape.num_local_experts, self.max_tokens[shape], shape.num_topk,
                                   shape.hidden, shape.intermediate_size)
        self.shape, self.tokens = (shape, weights), None

    def _load_tokens(self, tokens: int) -> None:
        from .testing import fill_buffer, random_inputs

        s = self.shape[0]
        fill_buffer(self.buf, random_inputs(tokens, s.hidden, s.num_local_experts, s.num_topk, "uniform", "cuda",
                                            self.gen))
        self.y = self.torch.empty(tokens, s.hidden, dtype=self.torch.bfloat16, device="cuda")
        self.tokens = tokens

    def __call__(self, point: Point, candidate: Candidate) -> float:
        from .ops import fp8_mega_moe
        from .timing import graphed, median_call_seconds

        if (point.shape, point.weights) != self.shape:
            self._load_shape(point.shape, point.weights)
        if point.tokens != self.tokens:
            self._load_tokens(point.tokens)
        with forced(candidate):  # the variant is chosen in the eager call and baked into the graph
            replay = graphed(functools.partial(fp8_mega_moe, self.y, self.layer.l1, self.layer.l2, self.buf,
                                               numerics=point.numerics))
        return median_call_seconds(replay, self.iters, self.flush)


def _int_list(minimum: int, allowed: Optional[Sequence[int]] = None) -> Callable[[str], Tuple[int, ...]]:
    def parse(text: str) -> Tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        for v in values:
            if v < minimum or (allowed is not None and v not in allowed):
                raise argparse.ArgumentTypeError(
                    f"{v} is not " + (f"one of {tuple(allowed)}" if allowed is not None else f"an integer >= {minimum}"))
        return values
    return parse


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _modes(text: str) -> Tuple[str, ...]:
    modes = tuple(text.split(","))
    for mode in modes:
        if mode not in NUMERICS_MODES:
            raise argparse.ArgumentTypeError(f"{mode!r} is not one of {NUMERICS_MODES}")
    return modes


def _shapes(text: str) -> Dict[str, TableShape]:
    """Names from SHAPES, or LOCALxHIDDENxINTERxTOPK (e.g. 128x2048x768x8) within the kernel's
    limits (buffer.BufferShape, at one rank as the sweep runs it)."""
    shapes = {}
    for item in text.split(","):
        if item in SHAPES:
            shapes[item] = SHAPES[item]
            continue
        parts = item.split("x")
        if len(parts) != 4 or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"unknown shape {item!r}: give one of {', '.join(SHAPES)} or "
                                             "local_experts x hidden x intermediate x top-k, e.g. 128x2048x768x8")
        shape = TableShape(*map(int, parts))
        try:
            BufferShape(1, shape.num_local_experts, 1, shape.num_topk, shape.hidden, shape.intermediate_size)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"shape {item!r}: {exc}") from None
        shapes[item] = shape
    return shapes


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megamoe_plugin.tune", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    parser.add_argument("--shapes", type=_shapes, default=dict(SHAPES),
                        help=f"shapes to tune: names ({', '.join(SHAPES)}; default all) or "
                             "LOCALxHIDDENxINTERxTOPK, comma-separated")
    parser.add_argument("--tokens", type=_int_list(1), default=REFERENCE_TOKENS_PER_RANK,
                        help="tokens per rank to tune at (default: %(default)s)")
    parser.add_argument("--numerics", type=_modes,
                        help="numerics modes to tune, a table each (docs/design.md section 2; default: those the "
                             f"kernel runs the weight format in, {NUMERICS_MODES} for fp8)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="fp8",
                        help="the experts' weight format: fp8 (128x128 blocks) or mxfp4 (read at 4 bits), "
                             "tables of their own (default: %(default)s)")
    parser.add_argument("--tiers", type=_int_list(1, IMPLEMENTED_BLOCK_M),
                        help="BLOCK_M tiers to time at every token count (default: the heuristic's and its neighbours)")
    parser.add_argument("--stages", type=_int_list(MIN_STAGES),
                        help="pipeline stages to time, where they fit (default: the heuristic's and half "
                             "heuristics.stages_in_flight)")
    parser.add_argument("--iters", type=_positive_int, default=DEFAULT_ITERS,
                        help="timed replays per config, the median is kept (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path,
                        help="where <GPU>.json is written (default: MEGAMOE_CONFIGS_DIR, else the shipped configs/)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the candidates and the cost; run nothing")
    mode.add_argument("--compile-only", action="store_true", help="compile every candidate variant (no GPU needed)")
    args = parser.parse_args(argv)
    if args.numerics is None:
        args.numerics = tuple(m for m in NUMERICS_MODES if implemented_block_m(m, args.weights))
    try:
        args.points = plan(args.shapes, args.tokens, args.numerics, args.tiers, args.stages, args.weights)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _cuda_device() -> Tuple[str, int]:
    """(name, SM count) of the current GPU; an SM90 one, since the sweep runs the kernel."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("megamoe tune: no CUDA GPU here; the sweep times the kernel on one "
                         "(--compile-only and --dry-run need none)")
    if torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit(f"megamoe tune: {torch.cuda.get_device_name()} is not an SM90 (Hopper) GPU")
    return torch.cuda.get_device_name(), torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        print(describe_plan(args.points, args.iters))
        return 0
    if not args.compile_only:
        gpu, num_sms = _cuda_device()  # before minutes of compiling, not after
    points = compile_all(args.points)
    if args.compile_only:
        print(f"megamoe tune: {len(variants_of(points))} kernel variants compiled")
        return 0
    results = sweep(points, KernelTimer(points, args.iters))
    print(summary(results))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # How the table was measured, not where this run wrote it: no --output-dir (a path of this machine).
    shown = [a for i, a in enumerate(argv) if not a.startswith("--o")
             and not (i and argv[i - 1].startswith("--o") and "=" not in argv[i - 1])]
    note = (f"measured by `python -m megamoe_plugin.tune {shlex.join(shown)}` on {date}: {gpu} ({num_sms} SMs), "
            f"one rank, fast_math, median of {args.iters} CUDA-graph replays with L2 flushed")
    path = write_table(results, gpu, args.output_dir, note)
    print(f"megamoe tune: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
