"""tools/ncu_loop_stalls.py on a small synthetic Nsight Compute source export: it finds the loop
from its backward branch, subtracts an earlier launch and splits the samples by stall reason."""
import csv
import gzip
import io
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ncu_loop_stalls.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"]


def launch(rows):
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", "megamoe_fused_kernel"])
    w.writerow(HEADER)
    for r in rows:
        w.writerow(r)
    return out.getvalue()


def body(scale):
    # Address, text, samples, executed, wait, long_sb, wait (not issued)
    return [
        ["0x100", "MOV R1, R2", 5, 1, 5, 0, 0],
        ["0x110", "QGMMA.64x64x32.F32.E4M3.E4M3 R56, gdesc[UR12], RZ", 10 * scale, 200000, 4 * scale, 0, 1],
        ["0x120", "FFMA R3, R4, R5, R3", 6 * scale, 200000, 0, 6 * scale, 0],
        ["0x130", "@P0 BRA 0x110", 4 * scale, 200000, 0, 0, 0],
        ["0x140", "EXIT", 1, 1, 1, 0, 0],
    ]


def test_loop_found_and_split(tmp_path):
    path = tmp_path / "src.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(launch(body(1)) + launch(body(3)))
    out = subprocess.run([sys.executable, str(TOOL), str(path), "--launch", "1", "--minus", "0"],
                         capture_output=True, text=True, check=True).stdout
    # launch 1 minus launch 0: the loop's samples 2 * (10 + 6 + 4) = 40, outside the loop 0
    assert "40 samples" in out.splitlines()[0]
    loop_line = next(l for l in out.splitlines() if l.startswith("loop "))
    assert "3 instructions (1 WGMMA, 1 FFMA, 0 R2UR)" in loop_line and "executed 200000 times" in loop_line
    reasons = {l.split()[0]: int(l.split()[1]) for l in out.splitlines() if l.startswith("  ") and not l.startswith("   ")
               and l.split()[0] != "top"}
    assert reasons == {"long_sb": 12, "wait": 8, "other": 20}
