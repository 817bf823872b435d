"""Config tables: schema validation, nearest-entry lookup, fallbacks, the shipped file."""
import copy
import json

import pytest

from megamoe_plugin.configs import (
    REFERENCE_SHAPES,
    ShapeTable,
    TableShape,
    TunedEntry,
    entry_key,
    load_table,
    lookup_config,
    table_path,
    validate_table,
)
from megamoe_plugin.heuristics import NUMERICS_MODES, SMEM_LIMIT, default_config, default_num_stages, smem_bytes
from megamoe_plugin.paths import CONFIGS_DIR

GPU = "Test GPU 80GB"
SHAPE = {"num_local_experts": 32, "hidden": 4096, "intermediate_size": 2048, "num_topk": 8}


def valid_table():
    return {
        "gpu": GPU,
        "version": 1,
        "note": "hand-written for the tests",
        "tables": [{"shape": dict(SHAPE),
                    "entries": {"1": {"block_m": 64, "num_stages": 2},
                                "4": {"block_m": 64, "num_stages": 3},
                                "64": {"block_m": 64, "num_stages": 4}}}],
    }


def measured_table():
    """A version-2 table as the tuning sweep writes it: one table per numerics mode."""
    def entry(block_m, num_stages, us, runner_up):
        return {"block_m": block_m, "num_stages": num_stages, "us": us,
                "runner_up": dict(zip(("block_m", "num_stages", "us"), runner_up))}

    return {
        "gpu": GPU,
        "version": 2,
        "tables": [{"shape": dict(SHAPE), "numerics": "fast", "note": "measured by the tests",
                    "entries": {"2": entry(8, 6, 70.5, (16, 6, 71.0)), "64": entry(64, 4, 400.0, (32, 5, 410.0))}},
                   {"shape": dict(SHAPE), "numerics": "exact",
                    "entries": {"2": entry(16, 4, 80.0, (8, 6, 80.0))}}],
    }


def test_a_fast_table_may_name_block_m_128():
    obj = measured_table()
    obj["tables"][0]["entries"]["64"] = {"block_m": 128, "num_stages": 4, "us": 350.0,
                                         "runner_up": {"block_m": 64, "num_stages": 4, "us": 400.0}}
    validate_table(obj, "tables/X.json")


def write(directory, obj, gpu=GPU):
    path = table_path(gpu, directory)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return path


def lookup(directory, num_tokens, num_topk=8, hidden=4096, num_ranks=1, num_experts=32, num_sms=132):
    return lookup_config(GPU, num_ranks, num_experts, num_topk, hidden, 2048, num_tokens, num_sms,
                         configs_dir=directory)


def test_table_path_replaces_spaces():
    assert table_path("NVIDIA H200") == CONFIGS_DIR / "NVIDIA_H200.json"
    assert table_path("NVIDIA H100 80GB HBM3", "/x").as_posix() == "/x/NVIDIA_H100_80GB_HBM3.json"


def test_load_table_parses_and_sorts(tmp_path):
    obj = valid_table()
    obj["tables"][0]["entries"] = {"64": {"num_stages": 4}, "0.5": {"block_m": 64}, "4": {"num_stages": 3}}
    write(tmp_path, obj)
    table = load_table(GPU, tmp_path)
    assert (table.gpu, table.note) == (GPU, "hand-written for the tests")
    shape = TableShape(**SHAPE)
    assert list(table.tables) == [(shape, None, "fp8")]
    assert table.find(shape, "fast") is table.find(shape, "exact") is table.tables[shape, None, "fp8"]
    assert table.find(shape, "fast", "mxfp4") is None
    assert table.tables[shape, None, "fp8"] == ShapeTable(
        expected_tokens=(0.5, 4.0, 64.0),
        entries=(TunedEntry(64, default_num_stages(64, 32, 4096, 2048, numerics="exact")), TunedEntry(8, 3), TunedEntry(64, 4)))


def test_load_table_without_file_is_none(tmp_path):
    assert load_table(GPU, tmp_path) is None


def edit(change):
    """A mutation that changes the table in place."""
    return lambda table: (change(table), table)[1]


# (mutation of a valid table, JSON path in the message, problem in the message)
SCHEMA_ERRORS = {
    "top not object": (lambda t: [t], "$", "expected an object, got list"),
    "unknown top key": (edit(lambda t: t.update(tabels=[])), "$", "unknown key 'tabels'"),
    "missing tables": (edit(lambda t: t.pop("tables")), "$", "missing key 'tables'"),
    "gpu type": (edit(lambda t: t.update(gpu=7)), "$.gpu", "expected a non-empty string, got 7"),
    "version value": (edit(lambda t: t.update(version=3)), "$.version", "expected one of (1, 2), got 3"),
    "version type": (edit(lambda t: t.update(version="1")), "$.version", 'expected one of (1, 2), got "1"'),
    "note type": (edit(lambda t: t.update(note=None)), "$.note", "expected a string, got null"),
    "tables type": (edit(lambda t: t.update(tables={})), "$.tables", "expected a non-empty array"),
    "tables empty": (edit(lambda t: t.update(tables=[])), "$.tables", "expected a non-empty array"),
    "table unknown key": (edit(lambda t: t["tables"][0].update(name="v3")), "$.tables[0]", "unknown key 'name'"),
    "numerics in version 1": (edit(lambda t: t["tables"][0].update(numerics="fast")), "$.tables[0]",
                              "unknown key 'numerics' (allowed: shape, entries)"),
    "us in version 1": (edit(lambda t: t["tables"][0]["entries"]["4"].update(us=1.0)), '$.tables[0].entries["4"]',
                        "unknown key 'us' (allowed: block_m, num_stages)"),
    "table missing entries": (edit(lambda t: t["tables"][0].pop("entries")), "$.tables[0]", "missing key 'entries'"),
    "shape unknown key": (edit(lambda t: t["tables"][0]["shape"].update(num_ranks=8)),
                          "$.tables[0].shape", "unknown key 'num_ranks'"),
    "shape missing key": (edit(lambda t: t["tables"][0]["shape"].pop("num_topk")),
                          "$.tables[0].shape", "missing key 'num_topk'"),
    "shape float": (edit(lambda t: t["tables"][0]["shape"].update(num_topk=8.0)),
                    "$.tables[0].shape.num_topk", "expected an integer, got 8.0"),
    "shape bool": (edit(lambda t: t["tables"][0]["shape"].update(num_local_experts=True)),
                   "$.tables[0].shape.num_local_experts", "expected an integer, got true"),
    "shape zero": (edit(lambda t: t["tables"][0]["shape"].update(num_topk=0)),
                   "$.tables[0].shape.num_topk", "expected an integer >= 1, got 0"),
    "hidden not 128-multiple": (edit(lambda t: t["tables"][0]["shape"].update(hidden=4000)),
                                "$.tables[0].shape.hidden", "expected a multiple of 128 >= 128, got 4000"),
    "duplicate shape": (edit(lambda t: t["tables"].append(copy.deepcopy(t["tables"][0]))),
                        "$.tables[1].shape", "duplicates $.tables[0].shape"),
    "entries type": (edit(lambda t: t["tables"][0].update(entries=[])), "$.tables[0].entries", "expected an object"),
    "entries empty": (edit(lambda t: t["tables"][0].update(entries={})), "$.tables[0].entries", "has no entries"),
    "key not numeric": (edit(lambda t: t["tables"][0]["entries"].update(decode={"block_m": 64})),
                        '$.tables[0].entries["decode"]', "key must be a positive number"),
    "key nan": (edit(lambda t: t["tables"][0]["entries"].update(nan={"block_m": 64})),
                '$.tables[0].entries["nan"]', "key must be a positive number"),
    "key zero": (edit(lambda t: t["tables"][0]["entries"].update({"0": {"block_m": 64}})),
                 '$.tables[0].entries["0"]', "key must be a positive number"),
    "key negative": (edit(lambda t: t["tables"][0]["entries"].update({"-2": {"block_m": 64}})),
                     '$.tables[0].entries["-2"]', "key must be a positive number"),
    "key same number": (edit(lambda t: t["tables"][0]["entries"].update({"4.0": {"block_m": 64}})),
                        '$.tables[0].entries["4.0"]', 'same expected tokens as $.tables[0].entries["4"]'),
    "entry type": (edit(lambda t: t["tables"][0]["entries"].update({"8": 64})),
                   '$.tables[0].entries["8"]', "expected an object, got int"),
    "entry empty": (edit(lambda t: t["tables"][0]["entries"].update({"8": {}})),
                    '$.tables[0].entries["8"]', "empty entry"),
    "entry unknown key": (edit(lambda t: t["tables"][0]["entries"]["4"].update(block_n=128)),
                          '$.tables[0].entries["4"]', "unknown key 'block_n'"),
    "block_m unsupported": (edit(lambda t: t["tables"][0]["entries"]["4"].update(block_m=48)),
                            '$.tables[0].entries["4"].block_m', "48 is not a tier of 'fast' numerics (8, 16, 32, 64, 128)"),
    "block_m of fast only in a table for both modes": (
        edit(lambda t: t["tables"][0]["entries"]["4"].update(block_m=128)),
        '$.tables[0].entries["4"].block_m', "128 is not a tier of 'exact' numerics (8, 16, 32, 64)"),
    "block_m type": (edit(lambda t: t["tables"][0]["entries"]["4"].update(block_m="64")),
                     '$.tables[0].entries["4"].block_m', 'expected an integer, got "64"'),
    "num_stages below 2": (edit(lambda t: t["tables"][0]["entries"]["4"].update(num_stages=1)),
                           '$.tables[0].entries["4"].num_stages', "expected an integer >= 2, got 1"),
    "num_stages too many": (edit(lambda t: t["tables"][0]["entries"]["4"].update(num_stages=6)),
                            '$.tables[0].entries["4"].num_stages',
                            f"6 stages of block_m=64 with 32 local experts need {smem_bytes(64, 6, 32, 'fast')} bytes "
                            f"of shared memory in fast numerics, more than the {SMEM_LIMIT} available"),
    "num_stages beyond exact": (edit(lambda t: t["tables"][0]["entries"]["4"].update(num_stages=5)),
                                '$.tables[0].entries["4"].num_stages',
                                f"5 stages of block_m=64 with 32 local experts need {smem_bytes(64, 5, 32, 'exact')} "
                                "bytes of shared memory in exact numerics"),
}



def fast_entry(table):
    return table["tables"][0]["entries"]["2"]


# The same, for what version 2 adds (mutations of measured_table()).
SCHEMA_V2_ERRORS = {
    "numerics value": (edit(lambda t: t["tables"][0].update(numerics="fp8")), "$.tables[0].numerics",
                       "expected one of ('fast', 'exact'), got \"fp8\""),
    "numerics null": (edit(lambda t: t["tables"][0].update(numerics=None)), "$.tables[0].numerics",
                      "expected one of ('fast', 'exact'), got null"),
    "table note type": (edit(lambda t: t["tables"][0].update(note=3)), "$.tables[0].note", "expected a string"),
    "duplicate shape and mode": (edit(lambda t: t["tables"][1].update(numerics="fast")), "$.tables[1].shape",
                                 "duplicates $.tables[0].shape for numerics 'fast'"),
    "two tables for both modes": (edit(lambda t: [table.pop("numerics") for table in t["tables"]]),
                                  "$.tables[1].shape", "duplicates $.tables[0].shape"),
    "us type": (edit(lambda t: fast_entry(t).update(us="70")), '$.tables[0].entries["2"].us',
                'expected a positive number, got "70"'),
    "us bool": (edit(lambda t: fast_entry(t).update(us=True)), '$.tables[0].entries["2"].us',
                "expected a positive number, got true"),
    "us zero": (edit(lambda t: fast_entry(t).update(us=0)), '$.tables[0].entries["2"].us',
                "expected a positive number, got 0"),
    "us without config": (edit(lambda t: fast_entry(t).pop("num_stages")), '$.tables[0].entries["2"]',
                          "must name the block_m and num_stages measured"),
    "runner_up without us": (edit(lambda t: fast_entry(t).pop("us")), '$.tables[0].entries["2"]',
                             "runner_up needs the entry's own measured time"),
    "runner_up type": (edit(lambda t: fast_entry(t).update(runner_up=[16, 6])), '$.tables[0].entries["2"].runner_up',
                       "expected an object, got list"),
    "runner_up missing key": (edit(lambda t: fast_entry(t)["runner_up"].pop("us")),
                              '$.tables[0].entries["2"].runner_up', "missing key 'us'"),
    "weights value": (edit(lambda t: t["tables"][0].update(weights="fp4")), "$.tables[0].weights",
                      "expected one of ('fp8', 'mxfp4'), got \"fp4\""),
    "MXFP4 in exact numerics": (edit(lambda t: t["tables"][1].update(weights="mxfp4")), "$.tables[1].numerics",
                                "the kernel runs mxfp4 weights in no tier of 'exact' numerics"),
    "MXFP4 for both modes": (edit(lambda t: (t["tables"][0].update(weights="mxfp4"), t["tables"][0].pop("numerics"))),
                             "$.tables[0].numerics", "no tier of 'exact' numerics: give the modes it runs them in"),
    "MXFP4 two stages at block_m 128": (edit(lambda t: (t["tables"][0].update(weights="mxfp4"),
                                                        t["tables"][0]["entries"]["64"].update(block_m=128,
                                                                                               num_stages=2))),
                                        '$.tables[0].entries["64"].num_stages', "expected an integer >= 3, got 2"),
    "runner_up block_m": (edit(lambda t: fast_entry(t)["runner_up"].update(block_m=48)),
                          '$.tables[0].entries["2"].runner_up.block_m', "48 is not a tier of 'fast' numerics"),
    "block_m 128 in an exact table": (edit(lambda t: t["tables"][1]["entries"]["2"].update(block_m=128)),
                                      '$.tables[1].entries["2"].block_m', "128 is not a tier of 'exact' numerics"),
    "runner_up num_stages": (edit(lambda t: fast_entry(t)["runner_up"].update(block_m=64, num_stages=7)),
                             '$.tables[0].entries["2"].runner_up.num_stages', "7 stages of block_m=64"),
    "runner_up is the winner": (edit(lambda t: fast_entry(t)["runner_up"].update(block_m=8)),
                                '$.tables[0].entries["2"].runner_up', "is the entry's own config"),
    "runner_up faster": (edit(lambda t: fast_entry(t)["runner_up"].update(us=70.4)),
                         '$.tables[0].entries["2"].runner_up.us',
                         "70.4 is faster than the entry's 70.5: the entry must be the fastest config measured"),
}


# (table builder, case): each schema version's errors, on a valid table of that version.
TABLE_ERROR_CASES = ([(valid_table, case) for case in SCHEMA_ERRORS]
                     + [(measured_table, case) for case in SCHEMA_V2_ERRORS])


@pytest.mark.parametrize("table, case", TABLE_ERROR_CASES, ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_validate_table_errors(table, case):
    mutate, path, problem = (SCHEMA_ERRORS if table is valid_table else SCHEMA_V2_ERRORS)[case]
    with pytest.raises(ValueError) as info:
        validate_table(mutate(table()), "tables/X.json")
    assert str(info.value).startswith(f"tables/X.json: {path}: ")
    assert problem in str(info.value)


def test_validate_table_accepts_the_valid_tables():
    assert validate_table(valid_table(), "x.json").gpu == GPU
    table = validate_table(measured_table(), "x.json")
    shape = TableShape(**SHAPE)
    assert set(table.tables) == {(shape, "fast", "fp8"), (shape, "exact", "fp8")}
    assert table.find(shape, "fast").entries == (TunedEntry(8, 6), TunedEntry(64, 4))
    assert table.find(shape, "exact").entries == (TunedEntry(16, 4),)


def test_mxfp4_tables_serve_mxfp4_calls_only(tmp_path):
    """A table for MXFP4 experts sits beside the shape's FP8 table: each weight format's calls read
    their own, and one format's table never stands in for the other's."""
    obj = measured_table()
    fp4 = copy.deepcopy(obj["tables"][0])
    fp4.update(weights="mxfp4", note="MXFP4 experts")
    # 10 stages of BLOCK_M 8 fit with MXFP4's half-size B tiles, not with FP8's.
    fp4["entries"] = {"2": {"block_m": 8, "num_stages": 10, "us": 50.0,
                            "runner_up": {"block_m": 16, "num_stages": 9, "us": 51.0}}}
    assert smem_bytes(8, 10, SHAPE["num_local_experts"], "fast") > SMEM_LIMIT
    obj["tables"].append(fp4)
    table = validate_table(obj, "x.json")
    shape = TableShape(**SHAPE)
    assert table.find(shape, "fast", "mxfp4").entries == (TunedEntry(8, 10),)
    assert table.find(shape, "fast").entries == (TunedEntry(8, 6), TunedEntry(64, 4))
    assert table.find(shape, "exact", "mxfp4") is None
    write(tmp_path, obj)
    args = (GPU, 1, SHAPE["num_local_experts"], SHAPE["num_topk"], SHAPE["hidden"], SHAPE["intermediate_size"], 8, 132)
    assert lookup_config(*args, configs_dir=tmp_path, numerics="fast", weights="mxfp4").num_stages == 10
    assert lookup_config(*args, configs_dir=tmp_path, numerics="fast").num_stages == 6
    fp4_twin = copy.deepcopy(fp4)
    obj["tables"].append(fp4_twin)
    with pytest.raises(ValueError, match=r"\$.tables\[3\].shape: duplicates \$.tables\[2\].shape for numerics 'fast' "
                                         "for mxfp4 weights"):
        validate_table(obj, "x.json")
    fp4_twin["weights"] = "fp8"  # the FP8 fast table's twin, and 10 stages do not fit FP8's tiles
    with pytest.raises(ValueError, match="duplicates"):
        validate_table(obj, "x.json")


def test_a_table_for_one_mode_is_checked_against_that_modes_shared_memory():
    obj = measured_table()
    fast_entry(obj).update(block_m=64, num_stages=5, runner_up={"block_m": 32, "num_stages": 6, "us": 71.0})
    assert validate_table(obj, "x.json").find(TableShape(**SHAPE), "fast").entries[0] == TunedEntry(64, 5)
    obj["tables"][0]["numerics"] = "exact"  # FP16 token staging: one stage fewer fits at block_m 64
    obj["tables"][1]["numerics"] = "fast"
    with pytest.raises(ValueError, match=r'entries\["2"\].num_stages: 5 stages of block_m=64 .* in exact numerics'):
        validate_table(obj, "x.json")


def test_version_2_entries_may_still_leave_fields_to_the_heuristic():
    obj = measured_table()
    obj["tables"][1]["entries"] = {"2": {"block_m": 16}}
    assert validate_table(obj, "x.json").find(TableShape(**SHAPE), "exact").entries == (
        TunedEntry(16, default_num_stages(16, 32, 4096, 2048)),)


def test_load_table_errors_name_the_file(tmp_path):
    obj = valid_table()
    obj["tables"][0]["entries"]["4"]["num_stages"] = 1
    path = write(tmp_path, obj)
    with pytest.raises(ValueError, match=f'^{path}: \\$.tables\\[0\\].entries\\["4"\\].num_stages: '):
        load_table(GPU, tmp_path)


@pytest.mark.parametrize("text, problem", [
    ("{", "not valid JSON"),
    ('{"gpu": "Test GPU 80GB", "gpu": "Test GPU 80GB", "version": 1, "tables": []}', "duplicate key 'gpu'"),
])
def test_load_table_rejects_bad_json(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=problem) as info:
        load_table(GPU, tmp_path)
    assert str(info.value).startswith(str(path))


def test_load_table_rejects_a_file_for_another_gpu(tmp_path):
    write(tmp_path, dict(valid_table(), gpu="NVIDIA H100"))
    with pytest.raises(ValueError, match=r"\$.gpu: 'NVIDIA H100' does not match the GPU 'Test GPU 80GB'"):
        load_table(GPU, tmp_path)


def test_nearest_entry_in_log_space():
    table = validate_table(valid_table(), "x.json").find(TableShape(**SHAPE), "fast")
    stages = {x: table.nearest(x).num_stages for x in (0, 0.01, 1, 1.99, 2, 3, 15.9, 16, 40, 64, 1e9)}
    # Entries 1 -> 2 stages, 4 -> 3, 64 -> 4; geometric midpoints 2 and 16 go to the larger entry.
    assert stages == {0: 2, 0.01: 2, 1: 2, 1.99: 2, 2: 3, 3: 3, 15.9: 3, 16: 4, 40: 4, 64: 4, 1e9: 4}


def test_lookup_config_uses_the_nearest_entry(tmp_path):
    write(tmp_path, valid_table())
    # R=1, E=32, K=8: expected tokens per expert = tokens / 4.
    assert [lookup(tmp_path, t).num_stages for t in (0, 1, 7, 8, 63, 64, 10000)] == [2, 2, 2, 3, 3, 4, 4]
    # EP8 with 256 experts has the same 32 local experts: the same table applies, with expected = tokens * 8 / 32.
    assert lookup(tmp_path, 8, num_ranks=8, num_experts=256).num_stages == 3
    config = lookup(tmp_path, 8, num_sms=100)
    assert (config.block_m, config.num_sms, config.key()) == (64, 100, "bm64_st3_sm100")


def test_lookup_config_fills_partial_entries_from_the_heuristic(tmp_path):
    obj = valid_table()
    obj["tables"][0]["entries"] = {"1": {"num_stages": 3}, "64": {"block_m": 64}}
    write(tmp_path, obj)
    assert (lookup(tmp_path, 4).block_m, lookup(tmp_path, 4).num_stages) == (8, 3)  # block_m for 1 row per expert
    assert lookup(tmp_path, 256).num_stages == default_num_stages(64, 32, 4096, 2048, numerics="exact")


def test_lookup_config_falls_back_to_the_heuristic(tmp_path):
    write(tmp_path, valid_table())
    for directory, num_topk, hidden in ((tmp_path / "none", 8, 4096), (tmp_path, 6, 4096), (tmp_path, 8, 7168)):
        for tokens in (0, 8, 8192):
            assert lookup(directory, tokens, num_topk=num_topk, hidden=hidden) == default_config(
                1, 32, num_topk, hidden, 2048, tokens, 132)


def test_lookup_config_reads_the_table_of_the_calls_numerics(tmp_path):
    obj = measured_table()
    write(tmp_path, obj)
    # 8 tokens: 2 rows per expert.
    assert (lookup(tmp_path, 8).block_m, lookup(tmp_path, 8).num_stages) == (8, 6)  # "fast" by default
    fast = lookup_config(GPU, 1, 32, 8, 4096, 2048, 8, 132, configs_dir=tmp_path, numerics="fast")
    exact = lookup_config(GPU, 1, 32, 8, 4096, 2048, 8, 132, configs_dir=tmp_path, numerics="exact")
    assert (fast.block_m, fast.num_stages, exact.block_m, exact.num_stages) == (8, 6, 16, 4)


def test_a_modes_own_table_wins_over_the_table_for_both(tmp_path):
    obj = measured_table()
    obj["tables"][1].pop("numerics")
    obj["tables"][1]["entries"] = {"2": {"block_m": 32, "num_stages": 3}}
    write(tmp_path, obj)
    for numerics, expected in (("fast", (8, 6)), ("exact", (32, 3))):
        config = lookup_config(GPU, 1, 32, 8, 4096, 2048, 8, 132, configs_dir=tmp_path, numerics=numerics)
        assert (config.block_m, config.num_stages) == expected, numerics


def test_a_mode_without_a_table_gets_the_heuristic(tmp_path):
    obj = measured_table()
    del obj["tables"][1]
    write(tmp_path, obj)
    for tokens in (1, 8, 8192):
        assert lookup_config(GPU, 1, 32, 8, 4096, 2048, tokens, 132, configs_dir=tmp_path,
                             numerics="exact") == default_config(1, 32, 8, 4096, 2048, tokens, 132, "exact")


def test_lookup_config_names_a_bad_numerics(tmp_path):
    with pytest.raises(ValueError, match=r"numerics must be one of \('fast', 'exact'\), got 'fp16'"):
        lookup_config(GPU, 1, 32, 8, 4096, 2048, 8, 132, configs_dir=tmp_path, numerics="fp16")


def test_configs_dir_from_the_environment(tmp_path, monkeypatch):
    write(tmp_path, valid_table())
    monkeypatch.setenv("MEGAMOE_CONFIGS_DIR", str(tmp_path))
    assert load_table(GPU) is load_table(GPU, tmp_path)
    assert lookup_config(GPU, 1, 32, 8, 4096, 2048, 8, 132).num_stages == 3  # the entry at 2 rows per expert
    monkeypatch.setenv("MEGAMOE_CONFIGS_DIR", "")  # empty: the shipped tables
    assert load_table("NVIDIA H200") is load_table("NVIDIA H200", CONFIGS_DIR)


def test_entry_key():
    assert [entry_key(x) for x in (0.25, 2.0, 512.0, 0.0625)] == ["0.25", "2", "512", "0.0625"]


def test_lookup_config_reads_the_file_once(tmp_path):
    path = write(tmp_path, valid_table())
    first = lookup(tmp_path, 8)
    path.unlink()
    assert lookup(tmp_path, 8) is first
    assert lookup(tmp_path, 256).num_stages == 4  # a new call, still served from the parsed table


def test_default_directory_is_the_shipped_one(monkeypatch):
    monkeypatch.delenv("MEGAMOE_CONFIGS_DIR", raising=False)
    assert load_table("NVIDIA H200") is load_table("NVIDIA H200", CONFIGS_DIR)
    assert lookup_config("NVIDIA H200", 1, 32, 8, 7168, 2048, 128, 132) is lookup_config(
        "NVIDIA H200", 1, 32, 8, 7168, 2048, 128, 132, configs_dir=str(CONFIGS_DIR))


def test_shipped_table_validates_and_covers_the_reference_shapes():
    table = load_table("NVIDIA H200", CONFIGS_DIR)
    assert table is not None and table.gpu == "NVIDIA H200"
    for shape in REFERENCE_SHAPES.values():
        for numerics in ("fast", "exact"):
            assert table.find(shape, numerics) is not None, (shape, numerics)


def test_every_shipped_entry_is_a_measured_winner():
    """A shipped entry is what the tuning sweep measured fastest, not a heuristic guess:
    each names its config, its measured time and a runner-up no faster (the loader checks
    the order of the two once they are there)."""
    for path in sorted(CONFIGS_DIR.glob("*.json")):
        obj = json.loads(path.read_text(encoding="utf-8"))
        assert obj["version"] == 2, path.name
        for table in obj["tables"]:
            assert table["entries"], (path.name, table["shape"])
            for key, entry in table["entries"].items():
                where = (path.name, table["shape"], table.get("numerics"), key)
                assert {"block_m", "num_stages", "us", "runner_up"} <= set(entry), where
                assert 0 < entry["us"] <= entry["runner_up"]["us"], where


def test_every_shipped_entry_fits_shared_memory():
    """Checked here on its own, not only through the loader: a launch of an entry that
    does not fit fails on the GPU, at whatever token count selects it."""
    for path in sorted(CONFIGS_DIR.glob("*.json")):
        gpu = json.loads(path.read_text(encoding="utf-8"))["gpu"]
        assert table_path(gpu).name == path.name
        for (shape, numerics, weights), shape_table in load_table(gpu, CONFIGS_DIR).tables.items():
            for entry in shape_table.entries:
                for mode in NUMERICS_MODES if numerics is None else (numerics,):
                    assert smem_bytes(entry.block_m, entry.num_stages, shape.num_local_experts, mode,
                                      weights) <= SMEM_LIMIT, (path.name, shape, entry)
