"""A benchmark run's results: the table rows on stdout, the JSON file and the PNG plot
(time and floor against tokens per rank, one line per config and numerics mode, per
config's floor and per config's baseline). matplotlib is optional: without it the JSON is
still written and the run says so."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..heuristics import Numerics

COLUMNS = (("config", "8s", "config"), ("numerics", "8s", "numerics"), ("tokens", "6d", "tokens"),
           ("time_us", "9.1f", "time_us"), ("TFLOPS", "7.1f", "tflops"), ("floor_us", "9.1f", "floor_us"),
           ("ratio", "6.2f", "time_per_floor"), ("sm_MHz", "6.0f", "sm_mhz"), ("min_MHz", "7.0f", "sm_mhz_min"),
           ("limit", "5s", "limits"), ("e2e_us", "9.1f", "e2e_us"), ("base_us", "9.1f", "baseline_us"),
           ("speedup", "7.2f", "speedup"), ("nvlink_MB", "9.2f", "nvlink_mb"))


def _width(spec: str) -> int:
    return int(spec.rstrip("sdf").split(".")[0])


def header() -> str:
    return " ".join(f"{title:{'<' if spec.endswith('s') else '>'}{_width(spec)}s}" for title, spec, _ in COLUMNS)


def row(point: Dict) -> str:
    cells = []
    for _, spec, key in COLUMNS:
        value = point.get(key)
        cells.append(f"{'-':>{_width(spec)}s}" if value is None else f"{value:{spec}}")
    return " ".join(cells)


def point(config: str, numerics: Numerics, tokens: int, time_s: float, flops: int, floor_s: float, e2e_s: float,
          baseline_s: Optional[float], nvlink_bytes: Optional[int] = None, clock: Optional[Dict] = None) -> Dict:
    """One measured point as the JSON file and the table hold it (times in us; the rank's NVLink
    traffic per call in MB, floors.rank_floor, None on one rank; `clock`: the SM clock's median and
    lowest reading and the clock limits seen while the kernel's timed calls ran,
    timing.GpuClockSampler.summary)."""
    clock = clock or {}
    return dict(config=config, numerics=numerics, tokens=tokens, time_us=time_s * 1e6,
                tflops=flops / time_s / 1e12, floor_us=floor_s * 1e6,
                time_per_floor=time_s / floor_s if floor_s > 0 else None,  # 0 tokens: no work, no floor
                sm_mhz=clock.get("sm_mhz"), sm_mhz_min=clock.get("sm_mhz_min"), limits=clock.get("limits"),
                e2e_us=e2e_s * 1e6, baseline_us=None if baseline_s is None else baseline_s * 1e6,
                speedup=None if baseline_s is None else baseline_s / e2e_s,
                nvlink_mb=None if nvlink_bytes is None else nvlink_bytes / 1e6)


def clock_note(clock: Dict) -> str:
    """` at <median> MHz` (and the limits seen, where any) of timing.GpuClockSampler.summary, for a
    ceiling's line; empty where the clock was not sampled."""
    if clock.get("sm_mhz") is None:
        return ""
    limits = clock.get("limits") or "-"
    return f" at {clock['sm_mhz']:.0f} MHz" + ("" if limits == "-" else f" (limit {limits})")


def plot(results: Dict, path: Path) -> None:
    """The PNG of `results` (write_results' dict); needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    points: List[Dict] = results["points"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    configs = list(dict.fromkeys(p["config"] for p in points))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, config in enumerate(configs):
        color = colors[i % len(colors)]
        mine = [p for p in points if p["config"] == config]
        for numerics, marker in zip(dict.fromkeys(p["numerics"] for p in mine), "os^v"):
            line = sorted((p["tokens"], p["time_us"]) for p in mine if p["numerics"] == numerics)
            ax.plot(*zip(*line), marker=marker, color=color, label=f"{config} megamoe, {numerics}")
        floor = sorted({p["tokens"]: p["floor_us"] for p in mine}.items())
        ax.plot(*zip(*floor), linestyle=":", color=color, label=f"{config} floor")
        base = sorted({p["tokens"]: p["baseline_us"] for p in mine if p["baseline_us"] is not None}.items())
        if base:
            ax.plot(*zip(*base), linestyle="--", marker="x", color=color, label=f"{config} baseline")
    ax.set_xscale("symlog" if any(p["tokens"] == 0 for p in points) else "log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("device time per call (us)")
    ax.set_title(f"megamoe on {results['num_ranks']} x {results['device']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    # Lower right: the large token counts sit high there; the baseline (its full name, with why
    # its path was chosen, can be long) is named once under the axes.
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    if any(p["baseline_us"] is not None for p in points):
        fig.text(0.01, 0.005, f"baseline: {results['baseline']}", fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(results: Dict, folder: Path, stem: str) -> Tuple[Path, Optional[Path], str]:
    """(JSON path, PNG path or None, a note why not) for `results` written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return json_path, None, "matplotlib is not installed (pip install matplotlib): no plot"
    png_path = folder / f"{stem}.png"
    plot(results, png_path)
    return json_path, png_path, ""

