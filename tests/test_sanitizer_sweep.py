"""tools/sanitizer_sweep.sh on tests/gpu/cases.py's job list, with a stand-in compute-sanitizer that
records what it was asked to run: every job runs once, with its tier, mode, shape, pool rows, CTAs,
shared experts and weight format, and a job that reports errors fails the sweep."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE = """#!/bin/bash
echo "$MEGAMOE_NUMERICS $MEGAMOE_BLOCK_M $MEGAMOE_NUM_SMS $*" >> "$FAKE_LOG"
echo "========= ERROR SUMMARY: $FAKE_ERRORS errors"
[ "$FAKE_ERRORS" = 0 ]
"""


def jobs(*args):
    return subprocess.run([sys.executable, "-m", "tests.gpu.cases", "--jobs", *args], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def sweep(tmp_path, job_text, errors=0):
    (tmp_path / "bin").mkdir(exist_ok=True)
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
               FAKE_LOG=str(tmp_path / "calls.txt"), FAKE_ERRORS=str(errors))
    run = subprocess.run(["bash", "tools/sanitizer_sweep.sh", str(tmp_path / "results")], cwd=ROOT, input=job_text, env=env,
                         capture_output=True, text=True)
    assert (tmp_path / "results" / "sanitizer.txt").is_file()
    return run.returncode, (tmp_path / "calls.txt").read_text().splitlines()


def test_every_job_runs_with_its_own_settings(tmp_path):
    from tests.gpu.cases import SANITIZER_SHAPES, SANITIZER_SMS
    from megamoe_plugin.heuristics import implemented_block_m

    text = jobs()
    lines = text.splitlines()
    assert len(lines) == sum(2 * len(implemented_block_m(m, weights))
                             for _, modes, _, _, weights in SANITIZER_SHAPES for m in modes)
    assert any(line.split()[-2] != "0" for line in lines), "no job runs shared experts"
    assert any(line.split()[-1] == "mxfp4" for line in lines), "no job runs MXFP4 experts"
    rc, calls = sweep(tmp_path, text)
    assert rc == 0
    want = []
    for line in lines:
        numerics, tool, block_m, h, i, k, e, n, pool, ctas, shared, weights = line.split()
        assert int(ctas) == SANITIZER_SMS
        want.append(f"{numerics} {block_m} {ctas} --tool {tool} --error-exitcode 1 python3 tools/debug_phases.py "
                    f"{h} {i} {k} {e} {n} --phases 0" + (f" --pool-rows {pool}" if pool != "-" else "")
                    + (f" --shared-experts {shared}" if shared != "0" else "")
                    + (f" --weights {weights}" if weights != "fp8" else ""))
    assert sorted(calls) == sorted(want)


def test_a_job_line_sets_the_ctas_pool_rows_shared_experts_and_weights(tmp_path):
    rc, calls = sweep(tmp_path, "exact memcheck 32 384 256 4 4 16 96 3 2\nfast racecheck 8 384 256 4 4 16 - 5 0 mxfp4\n")
    assert rc == 0 and sorted(calls) == [
        "exact 32 3 --tool memcheck --error-exitcode 1 python3 tools/debug_phases.py "
        "384 256 4 4 16 --phases 0 --pool-rows 96 --shared-experts 2",
        "fast 8 5 --tool racecheck --error-exitcode 1 python3 tools/debug_phases.py 384 256 4 4 16 --phases 0 --weights mxfp4"]


def test_a_job_with_errors_fails_the_sweep(tmp_path):
    rc, calls = sweep(tmp_path, jobs("--numerics", "fast", "--tiers", "128"), errors=2)
    assert rc == 1 and calls and all(c.startswith("fast 128 ") for c in calls)
