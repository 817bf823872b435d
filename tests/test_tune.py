"""The tuning sweep on CPU: its pruning, the winner it picks with a fake timer in place of
the GPU, the table it writes (through the loader and lookup_config), its command line."""
import json
import os
import re

import pytest

from megamoe_plugin import tune
from megamoe_plugin.configs import TableShape, TunedEntry, load_table, lookup_config, table_path, validate_table
from megamoe_plugin.heuristics import (IMPLEMENTED_BLOCK_M, NUMERICS_MODES, SMEM_LIMIT, default_num_stages,
                                       implemented_block_m, select_block_m, smem_bytes)
from megamoe_plugin.tune import Candidate, Point

GPU = "Test GPU 80GB"
SHAPE = TableShape(num_local_experts=32, hidden=4096, intermediate_size=2048, num_topk=8)


def fake_seconds(point, candidate):
    """Fastest where block_m is nearest 2x the rows per expert (4x in exact mode), deeper
    pipelines a little faster: a landscape whose winner the test can work out by hand."""
    ideal = (2 if point.numerics == "fast" else 4) * point.expected_tokens
    return 1e-4 * (1 + abs(candidate.block_m - ideal) / 64) - 1e-7 * candidate.num_stages


def test_default_plan_prunes_to_the_heuristic_and_its_neighbours():
    points = tune.plan(tune.SHAPES, tune.REFERENCE_TOKENS_PER_RANK)
    assert len(points) == len(tune.SHAPES) * len(tune.REFERENCE_TOKENS_PER_RANK) * len(NUMERICS_MODES)
    assert [p.numerics for p in points[:4]] == ["fast", "exact", "fast", "exact"]
    for p in points:
        heuristic = p.heuristic()
        assert heuristic in p.candidates, p
        tiers = implemented_block_m(p.numerics)  # exact has no BLOCK_M 128
        i = tiers.index(select_block_m(p.expected_tokens, implemented_block_m(p.numerics)))
        assert {c.block_m for c in p.candidates} == set(tiers[max(0, i - 1): i + 2]), p
        for c in p.candidates:
            assert smem_bytes(c.block_m, c.num_stages, p.shape.num_local_experts, p.numerics) <= SMEM_LIMIT, (p, c)
            # The depth the heuristic gives this tier in this mode, or MAX_STAGES / 2.
            assert c.num_stages in (default_num_stages(c.block_m, p.shape.num_local_experts, p.shape.hidden,
                                                       p.shape.intermediate_size, numerics=p.numerics), 4), (p, c)
    # The e2e model's layer: 128 local experts, so 8192 tokens are 512 rows per expert.
    e2e = [p for p in points if p.shape_name == "e2e"]
    assert e2e[-1].shape == TableShape(128, 2048, 768, 8) and e2e[-1].expected_tokens == 512


def test_tiers_and_stages_narrow_the_plan_to_what_fits():
    fast, exact = tune.plan({"x": SHAPE}, [512], tiers=[8, 64], stages=[2, 5, 6])
    # block_m 64 fits at most 5 stages with 32 local experts in fast mode, 4 in exact; block_m 8 six.
    assert fast.candidates == (Candidate(8, 2), Candidate(8, 5), Candidate(8, 6), Candidate(64, 2), Candidate(64, 5))
    assert exact.candidates == (Candidate(8, 2), Candidate(8, 5), Candidate(8, 6), Candidate(64, 2))
    [only] = tune.plan({"x": SHAPE}, [512], numerics=["exact"], tiers=[64])
    assert (only.numerics, only.candidates) == ("exact", (Candidate(64, 4),))
    with pytest.raises(ValueError, match=r"^--stages 5: none fits in shared memory at any of the tiers \(64,\) for x "
                                         r"\(32 local experts\) in exact numerics"):
        tune.plan({"x": SHAPE}, [512], tiers=[64], stages=[5])


def test_sweep_orders_each_points_timings_fastest_first():
    points = tune.plan({"x": SHAPE}, [1, 8192])
    results = tune.sweep(points, fake_seconds)
    assert [p for p, _ in results] == points
    for point, timings in results:
        assert sorted(c for c, _ in timings) == sorted(point.candidates)
        assert [t for _, t in timings] == sorted(t for _, t in timings)
    # 0.25 rows per expert: block_m 8 with the deepest pipeline; 2048: the largest tier of the mode,
    # as deep as fits (fast: 128, exact: 64).
    assert [(p.numerics, timings[0][0]) for p, timings in results] == [
        ("fast", Candidate(8, 6)), ("exact", Candidate(8, 6)), ("fast", Candidate(128, 4)), ("exact", Candidate(64, 4))]


def test_sweep_keeps_the_candidates_order_on_a_tie():
    point = Point("x", SHAPE, 8, "fast", (Candidate(16, 4), Candidate(8, 6)))
    [(_, timings)] = tune.sweep([point], lambda p, c: 1e-4)
    assert [c for c, _ in timings] == [Candidate(16, 4), Candidate(8, 6)]


def test_written_table_round_trips_and_serves_lookup_config(tmp_path):
    results = tune.sweep(tune.plan({"x": SHAPE}, [1, 32, 512, 8192]), fake_seconds)
    path = tune.write_table(results, GPU, tmp_path, "measured by the test")
    assert path == table_path(GPU, tmp_path)
    obj = json.loads(path.read_text(encoding="utf-8"))
    validate_table(obj, str(path))
    assert (obj["version"], obj["note"]) == (2, tune.TOP_NOTE)
    tables = {t["numerics"]: t for t in obj["tables"]}
    assert list(tables) == ["fast", "exact"]
    for point, timings in results:
        table = tables[point.numerics]
        assert table["note"] == "measured by the test" and table["shape"] == SHAPE._asdict()
        entry = table["entries"][str(point.expected_tokens).removesuffix(".0")]
        (best, t_best), (second, t_second) = timings[:2]
        assert entry == {"block_m": best.block_m, "num_stages": best.num_stages, "us": round(t_best * 1e6, 1),
                         "runner_up": {"block_m": second.block_m, "num_stages": second.num_stages,
                                       "us": round(t_second * 1e6, 1)}}
    winners = {(p.tokens, p.numerics): timings[0][0] for p, timings in results}
    for numerics in NUMERICS_MODES:
        loaded = load_table(GPU, tmp_path).find(SHAPE, numerics)
        assert loaded.expected_tokens == (0.25, 8.0, 128.0, 2048.0)
        assert loaded.entries == tuple(TunedEntry(*winners[n, numerics]) for n in (1, 32, 512, 8192))
        for tokens in (1, 32, 512, 8192):
            config = lookup_config(GPU, 1, 32, 8, 4096, 2048, tokens, 132, configs_dir=tmp_path, numerics=numerics)
            assert Candidate(config.block_m, config.num_stages) == winners[tokens, numerics]
        # EP8 with 256 experts has the same 32 local experts and reads the same entries.
        config = lookup_config(GPU, 8, 256, 8, 4096, 2048, 1024, 132, configs_dir=tmp_path, numerics=numerics)
        assert Candidate(config.block_m, config.num_stages) == winners[8192, numerics]
    # The winners differ by mode here (fake_seconds), so each mode reads its own table.
    assert winners[32, "fast"] != winners[32, "exact"]


def test_mxfp4_experts_are_tuned_into_tables_of_their_own(tmp_path):
    """--weights mxfp4: the MXFP4 tiers (fast numerics) at MXFP4 depths (half-size stages: deeper
    pipelines fit), compiled as MXFP4 variants, written as tables that name the format beside the
    shape's FP8 tables, which stay; each format's calls then read their own."""
    points = tune.plan({"x": SHAPE}, [1, 512], ["fast"], weights="mxfp4")
    for p in points:
        assert p.weights == "mxfp4" and p.label == "x+w4" and p.heuristic() in p.candidates
        assert {c.block_m for c in p.candidates} <= set(implemented_block_m("fast", "mxfp4"))
        for c in p.candidates:
            assert smem_bytes(c.block_m, c.num_stages, SHAPE.num_local_experts, "fast", "mxfp4") <= SMEM_LIMIT
            assert tune.variant_of(p, c).weights == "mxfp4"
    deepest = max(c.num_stages for p in points for c in p.candidates)
    assert smem_bytes(8, deepest, SHAPE.num_local_experts, "fast") > SMEM_LIMIT  # deeper than FP8 fits
    with pytest.raises(ValueError, match="runs mxfp4 weights in no tier of 'exact' numerics"):
        tune.plan({"x": SHAPE}, [1], ["exact"], weights="mxfp4")

    tune.write_table(tune.sweep(tune.plan({"x": SHAPE}, [1, 512]), fake_seconds), GPU, tmp_path, "fp8")
    results = tune.sweep(points, lambda p, c: fake_seconds(p, c) - 1e-7 * c.num_stages)
    tune.write_table(results, GPU, tmp_path, "mxfp4")
    obj = json.loads(table_path(GPU, tmp_path).read_text())
    assert [(t["numerics"], t.get("weights"), t["note"]) for t in obj["tables"]] == [
        ("fast", None, "fp8"), ("exact", None, "fp8"), ("fast", "mxfp4", "mxfp4")]
    winners = {p.tokens: timings[0][0] for p, timings in results}
    for tokens in (1, 512):
        config = lookup_config(GPU, 1, 32, 8, 4096, 2048, tokens, 132, configs_dir=tmp_path, numerics="fast",
                               weights="mxfp4")
        assert Candidate(config.block_m, config.num_stages) == winners[tokens]
    fp8 = load_table(GPU, tmp_path).find(SHAPE, "fast")
    assert fp8.entries != load_table(GPU, tmp_path).find(SHAPE, "fast", "mxfp4").entries
    # Sweeping MXFP4 again replaces its own table only.
    tune.write_table(results, GPU, tmp_path, "mxfp4 again")
    again = json.loads(table_path(GPU, tmp_path).read_text())
    assert [t["note"] for t in again["tables"]] == ["fp8", "fp8", "mxfp4 again"]


def test_a_single_candidate_is_written_without_a_runner_up(tmp_path):
    results = tune.sweep(tune.plan({"x": SHAPE}, [4096], ["fast"], tiers=[64], stages=[4]), fake_seconds)
    path = tune.write_table(results, GPU, tmp_path, "one config")
    # 1024 rows per expert: 1e-4 * (1 + (2048 - 64) / 64) - 4e-7 seconds.
    assert json.loads(path.read_text())["tables"][0]["entries"] == {"1024": {"block_m": 64, "num_stages": 4,
                                                                             "us": 3199.6}}


def test_writing_merges_into_the_existing_file(tmp_path):
    other = {"num_local_experts": 32, "hidden": 7168, "intermediate_size": 2048, "num_topk": 8}
    table_path(GPU, tmp_path).write_text(json.dumps({
        "gpu": GPU, "version": 1, "note": "from the heuristic",
        "tables": [{"shape": other, "entries": {"2": {"block_m": 8}}},
                   {"shape": SHAPE._asdict(), "entries": {"2": {"block_m": 32}}}]}))
    # Only "fast" swept: this shape's table for both modes still serves "exact" and stays.
    tune.write_table(tune.sweep(tune.plan({"x": SHAPE}, [8], ["fast"]), fake_seconds), GPU, tmp_path, "fast")
    obj = json.loads(table_path(GPU, tmp_path).read_text())
    # Kept tables take the version-1 file's note.
    assert obj["tables"][:2] == [{"shape": other, "entries": {"2": {"block_m": 8}}, "note": "from the heuristic"},
                                 {"shape": SHAPE._asdict(), "entries": {"2": {"block_m": 32}},
                                  "note": "from the heuristic"}]
    assert (obj["tables"][2]["numerics"], obj["tables"][2]["note"]) == ("fast", "fast")
    assert lookup_config(GPU, 1, 32, 8, 4096, 2048, 8, 132, configs_dir=tmp_path, numerics="exact").block_m == 32
    # Both modes swept: the table for both goes, and the new "fast" table replaces the old.
    tune.write_table(tune.sweep(tune.plan({"x": SHAPE}, [8, 512]), fake_seconds), GPU, tmp_path, "both")
    again = json.loads(table_path(GPU, tmp_path).read_text())
    assert again["tables"][0] == obj["tables"][0]
    assert [(t["numerics"], t["note"], len(t["entries"])) for t in again["tables"][1:]] == [("fast", "both", 2),
                                                                                           ("exact", "both", 2)]


def test_writing_refuses_a_broken_or_foreign_existing_file(tmp_path):
    results = tune.sweep(tune.plan({"x": SHAPE}, [8]), fake_seconds)
    path = table_path(GPU, tmp_path)
    path.write_text(json.dumps({"gpu": GPU, "version": 1, "tables": []}))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: \\$.tables: expected a non-empty array"):
        tune.write_table(results, GPU, tmp_path, "n")
    path.write_text(json.dumps({"gpu": "NVIDIA H100", "version": 2,
                                "tables": [{"shape": SHAPE._asdict(), "entries": {"2": {"block_m": 8}}}]}))
    with pytest.raises(ValueError, match=r"\$.gpu: 'NVIDIA H100' does not match the GPU 'Test GPU 80GB'"):
        tune.write_table(results, GPU, tmp_path, "n")


def test_output_dir_defaults_to_the_environments(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CONFIGS_DIR", str(tmp_path))
    path = tune.write_table(tune.sweep(tune.plan({"x": SHAPE}, [8]), fake_seconds), GPU, None, "n")
    assert path == tmp_path / "Test_GPU_80GB.json" and path.exists()


def test_forced_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("MEGAMOE_BLOCK_M", "64")
    monkeypatch.delenv("MEGAMOE_NUM_STAGES", raising=False)
    with tune.forced(Candidate(16, 3)):
        assert (os.environ["MEGAMOE_BLOCK_M"], os.environ["MEGAMOE_NUM_STAGES"]) == ("16", "3")
    assert os.environ["MEGAMOE_BLOCK_M"] == "64" and "MEGAMOE_NUM_STAGES" not in os.environ


def test_dry_run_prints_the_candidates_and_the_cost(capsys):
    assert tune.main(["--dry-run", "--shapes", "v3,e2e", "--tokens", "1,8192", "--iters", "30"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["shape", "tokens", "rows/exp", "numerics", "candidates", "(block_m/stages)"]
    assert out[1].split() == ["v3", "1", "0.25", "fast", "8/4", "8/6", "16/4", "16/6"]
    assert out[8].split() == ["e2e", "8192", "512", "exact", "32/4", "32/5", "64/4"]
    # Per shape 4 + 4 configs at 1 token, 4 (fast) + 3 (exact) at 8192, each run 30 timed + 2 more
    # times; each is its own kernel (the two token counts share no tier, the modes no kernel).
    assert out[-1] == "8 points, 28 configs to time, 896 kernel runs (30 timed + 2 per config), 28 kernel variants to compile"


def fake_compile(fail=()):
    def compile_variants(variants, on_done=None):
        results = [RuntimeError(f"nvcc failed for {v.name()}") if v.block_m in fail else object() for v in variants]
        for v, result in zip(variants, results):
            on_done(v, result)
        return results
    return compile_variants


def test_compile_only_compiles_every_candidate_and_needs_no_gpu(monkeypatch, capsys):
    compiled = []
    monkeypatch.setattr(tune, "compile_variants", lambda vs, on_done: compiled.extend(vs) or [object()] * len(vs))
    monkeypatch.setattr(tune, "_cuda_device", lambda: pytest.fail("--compile-only must not need a GPU"))
    assert tune.main(["--compile-only", "--shapes", "qwen30", "--tokens", "1,8,8192", "--numerics", "exact"]) == 0
    assert [(v.block_m, v.num_stages) for v in compiled] == [(8, 4), (8, 6), (16, 4), (16, 6), (32, 4), (32, 5),
                                                              (64, 4)]
    assert all((v.num_experts, v.num_ranks, v.hidden, v.fast_math, v.numerics) == (32, 1, 2048, True, "exact")
               for v in compiled)
    assert capsys.readouterr().out == "megamoe tune: 7 kernel variants compiled\n"


def test_a_variant_that_fails_to_compile_leaves_the_sweep(monkeypatch, capsys):
    monkeypatch.setattr(tune, "compile_variants", fake_compile(fail=(16,)))
    [point] = tune.compile_all(tune.plan({"x": SHAPE}, [1], ["fast"]))
    assert point.candidates == (Candidate(8, 4), Candidate(8, 6))
    assert "bm16_st4" in capsys.readouterr().err
    monkeypatch.setattr(tune, "compile_variants", fake_compile(fail=(8, 16)))
    with pytest.raises(RuntimeError, match="no candidate of x at 1 tokens in exact numerics compiles"):
        tune.compile_all(tune.plan({"x": SHAPE}, [1], ["exact"]))


def test_main_times_and_writes_the_table_with_its_command_and_date(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "compile_variants", fake_compile())
    monkeypatch.setattr(tune, "_cuda_device", lambda: (GPU, 132))
    monkeypatch.setattr(tune, "KernelTimer", lambda points, iters: fake_seconds)
    argv = ["--shapes", "qwen30", "--tokens", "8,512", "--output-dir", str(tmp_path)]
    assert tune.main(argv) == 0
    captured = capsys.readouterr()
    # Winner, runner-up and the heuristic's config (here the winner) with their times.
    us = {c: f"{fake_seconds(Point('qwen30', tune.SHAPES['qwen30'], 8, 'fast', ()), c) * 1e6:.1f}"
          for c in (Candidate(8, 6), Candidate(8, 4))}
    assert captured.out.splitlines()[1].split() == ["qwen30", "8", "2", "fast", "8/6", us[8, 6], "8/4", us[8, 4],
                                                    "8/6", us[8, 6]]
    fast, exact = json.loads(table_path(GPU, tmp_path).read_text())["tables"]
    assert (fast["numerics"], exact["numerics"], exact["note"]) == ("fast", "exact", fast["note"])
    table = fast
    # The note says how, not where: no --output-dir and no path of this machine.
    assert re.fullmatch(r"measured by `python -m megamoe_plugin.tune --shapes qwen30 --tokens 8,512` "
                        r"on \d{4}-\d\d-\d\d \d\d:\d\d UTC: Test GPU 80GB \(132 SMs\), "
                        r"one rank, fast_math, median of 20 CUDA-graph replays with L2 flushed", table["note"])
    assert list(table["entries"]) == ["2", "128"]
    # --output-dir=DIR and an abbreviation are left out too.
    for output in (["--output-dir=" + str(tmp_path)], ["--out", str(tmp_path)]):
        assert tune.main(["--tokens", "8", "--shapes", "qwen30", *output, "--iters", "3"]) == 0
        note = json.loads(table_path(GPU, tmp_path).read_text())["tables"][0]["note"]
        assert note.startswith("measured by `python -m megamoe_plugin.tune --tokens 8 --shapes qwen30 --iters 3` on ")


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1,x"], "argument --tokens: expected comma-separated integers, got '1,x'"),
    (["--tokens", "0"], "argument --tokens: 0 is not an integer >= 1"),
    (["--tiers", "48"], f"argument --tiers: 48 is not one of {IMPLEMENTED_BLOCK_M}"),
    (["--numerics", "fast,fp8"], "argument --numerics: 'fp8' is not one of ('fast', 'exact')"),
    (["--stages", "1"], "argument --stages: 1 is not an integer >= 2"),
    (["--iters", "0"], "argument --iters: expected an integer >= 1, got '0'"),
    (["--shapes", "v5"], "argument --shapes: unknown shape 'v5'"),
    (["--shapes", "32x4000x2048x8"],
     "argument --shapes: shape '32x4000x2048x8': hidden=4000 is invalid: expected a positive multiple of 128"),
    (["--shapes", "32x4096x2000x8"],
     "argument --shapes: shape '32x4096x2000x8': intermediate_size=2000 is invalid: expected a positive multiple of 128"),
    # The kernel's limits (docs/design.md section 2): 1 <= K <= min(16, E), E/R <= 512.
    (["--shapes", "128x2048x768x99"], "argument --shapes: shape '128x2048x768x99': num_topk=99 is invalid: expected "
                                      "in [1, 16]"),
    (["--shapes", "4x2048x768x8"], "argument --shapes: shape '4x2048x768x8': num_topk=8 is invalid: expected <= "
                                   "num_experts=4"),
    (["--shapes", "1024x2048x768x8"], "argument --shapes: shape '1024x2048x768x8': num_experts=1024 is invalid: "
                                      "expected at most 512 experts per rank"),
    (["--dry-run", "--compile-only"], "argument --compile-only: not allowed with argument --dry-run"),
    (["--weights", "fp4"], "argument --weights: invalid choice: 'fp4'"),
    (["--weights", "mxfp4", "--numerics", "exact"],
     "--numerics exact: the kernel runs mxfp4 weights in no tier of 'exact' numerics"),
    (["--weights", "mxfp4", "--tiers", "128", "--stages", "2"],
     "--stages 2: none fits in shared memory at any of the tiers (128,)"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        tune.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_weights_mxfp4_tunes_the_modes_the_kernel_runs_it_in(monkeypatch, tmp_path):
    monkeypatch.setattr(tune, "compile_variants", fake_compile())
    monkeypatch.setattr(tune, "_cuda_device", lambda: (GPU, 132))
    monkeypatch.setattr(tune, "KernelTimer", lambda points, iters: fake_seconds)
    assert tune.parse_args(["--weights", "mxfp4"]).numerics == ("fast",)
    assert tune.parse_args([]).numerics == NUMERICS_MODES
    assert tune.main(["--shapes", "qwen30", "--tokens", "8", "--weights", "mxfp4", "--output-dir", str(tmp_path)]) == 0
    [table] = json.loads(table_path(GPU, tmp_path).read_text())["tables"]
    assert (table["numerics"], table["weights"]) == ("fast", "mxfp4")
    assert "--weights mxfp4" in table["note"]


def test_a_shape_given_as_numbers():
    args = tune.parse_args(["--shapes", "64x1024x512x4,v3", "--tokens", "16"])
    assert args.shapes == {"64x1024x512x4": TableShape(64, 1024, 512, 4), "v3": tune.SHAPES["v3"]}
    assert [(p.expected_tokens, p.numerics) for p in args.points] == [(1.0, "fast"), (1.0, "exact"), (4.0, "fast"),
                                                                      (4.0, "exact")]
