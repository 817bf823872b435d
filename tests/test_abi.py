"""The host/device ABI has one source, csrc/megamoe/abi.h: Python's numbers are the ones the ABI
extension is compiled with, and the modules that use them take them from megamoe_plugin.abi."""
import json
import shutil
import subprocess
import sys
import sysconfig

import pytest

from megamoe_plugin import _abi, abi, buffer, heuristics, kernel_variant, timeline
from megamoe_plugin.buffer import BufferLayout, BufferShape
from megamoe_plugin.paths import CSRC_DIR, REPO_DIR

ABI_MODULE = REPO_DIR / "csrc" / "abi" / "abi_module.cpp"


def test_every_constant_of_the_extension_is_bound_under_its_cpp_name():
    constants = _abi.constants()
    assert {"kBlockN", "kNumThreads", "kErrorRankShift", "kCallTagRefused", "kSigRankArrivals",
            "kTimelineWords", "kSmemAlignSlack"} <= set(constants)
    for name, value in constants.items():
        assert getattr(abi, name) == value, name


def test_the_python_modules_take_their_numbers_from_the_abi():
    assert (heuristics.BLOCK_N, heuristics.BLOCK_K, heuristics.SMEM_LIMIT) == (abi.kBlockN, abi.kBlockK, abi.kSmemLimit)
    assert kernel_variant.NUM_THREADS == abi.kNumThreads
    assert buffer.SIGNAL_WORDS is abi.SIGNAL_WORDS and buffer.NUM_SIGNAL_WORDS == abi.kNumSignalWords
    assert buffer.SIGNAL_WORDS["rank_arrivals"] == abi.kSigRankArrivals
    assert buffer.SIGNAL_WORDS["l2_tiles_claimed"] == abi.kSigL2TilesClaimed
    assert (timeline.MAX_TILES, timeline.RECORDS, timeline.WORDS, timeline.PULL_SLOT) == (
        abi.kTimelineMaxTiles, abi.kTimelineRecords, abi.kTimelineWords, abi.kTimelinePullSlot)
    assert len(timeline.SLOTS) == abi.kTimelineSlots and timeline.SLOTS[timeline.PULL_SLOT] == "pull"


def test_the_buffer_lays_out_exactly_the_regions_the_kernel_reads():
    layout = BufferLayout(BufferShape(2, 64, 256, 8, 7168, 2048))
    assert set(layout.regions) == set(abi.BUFFER_REGIONS)
    assert abi.BUFFER_REGIONS[0] == "x" and len(abi.BUFFER_REGIONS) == len(set(abi.BUFFER_REGIONS))


@pytest.mark.parametrize("block_m, numerics", [(8, "fast"), (64, "fast"), (128, "fast"), (32, "exact"), (64, "exact")])
def test_the_launch_size_is_the_plan_of_shared_storage(block_m, numerics):
    plan = abi.smem_plan(block_m, 4, 32, numerics == "exact")
    assert heuristics.smem_bytes(block_m, 4, 32, numerics) == plan["bytes"] + abi.kSmemAlignSlack
    assert plan["bytes"] == plan["stages"] + 4 * plan["stage"]
    order = ("amax_exchange", "tables", "quad_lines", "l1_token_scales", "l1_tokens", "stages")
    assert [plan[m] for m in order] == sorted(plan[m] for m in order)
    assert plan["stages"] % 1024 == 0 and plan["stage"] % 1024 == 0  # the 128B swizzle's alignment


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_python_reads_the_header_itself(tmp_path):
    """An ABI extension built from an edited copy of abi.h reports the edited numbers: Python's values
    are the header's, with no copy of them anywhere to update."""
    pybind11 = pytest.importorskip("pybind11")
    header = (CSRC_DIR / "megamoe" / "abi.h").read_text()
    edits = {"constexpr int kErrorRankShift = 8;": "constexpr int kErrorRankShift = 9;",
             "constexpr int kBlockN = 256;": "constexpr int kBlockN = 512;",
             "  kSigWindowsPending = 5,": "  kSigWindowsPending = 2,",
             "X(x) X(x_sf)": "X(x) X(extra_region) X(x_sf)"}
    for old, new in edits.items():
        assert old in header, old
        header = header.replace(old, new)
    (tmp_path / "megamoe").mkdir()
    (tmp_path / "megamoe" / "abi.h").write_text(header)
    module = tmp_path / f"_abi{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["c++", "-O0", "-shared", "-fPIC", "-std=c++17", f"-I{sysconfig.get_paths()['include']}",
                    f"-I{pybind11.get_include()}", f"-I{tmp_path}", str(ABI_MODULE), "-o", str(module)],
                   check=True, capture_output=True)
    probe = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('_abi', sys.argv[1]); "
             "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
             "print(json.dumps([m.constants(), m.buffer_regions(), m.smem_plan(64, 4, 32, False)]))")
    constants, regions, plan = json.loads(subprocess.run([sys.executable, "-c", probe, str(module)], check=True,
                                                         capture_output=True, text=True).stdout)
    assert (constants["kErrorRankShift"], constants["kBlockN"], constants["kSigWindowsPending"]) == (9, 512, 2)
    assert regions[:3] == ["x", "extra_region", "x_sf"]
    assert plan["stage"] == abi.smem_plan(64, 4, 32, False)["stage"] + 256 * abi.kBlockK  # the B tile's extra rows
