"""tools/ab_summary.py on bench tables written here: medians per cell over rounds, B against A, and
B's fastest round against A's."""
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ab_summary.py"
HEADER = ("1 x NVIDIA H200: copy 4.28 TB/s, FP8 GEMM 1432 TFLOP/s, fast_math=True\n"
          "config   numerics tokens   time_us  TFLOPS  floor_us  ratio    e2e_us   base_us speedup\n")


def table(path, rows):
    path.write_text(HEADER + "".join(f"{c:8s} {n:8s} {t:6d} {us:9.1f}     6.1      82.4   1.40     117.4         -       -\n"
                                     for c, n, t, us in rows))
    return str(path)


def test_medians_and_change(tmp_path):
    a = [table(tmp_path / f"a{r}.txt", [("v3", "fast", 1, us), ("v3", "exact", 128, 400.0)])
         for r, us in enumerate([100.0, 300.0, 110.0])]
    b = [table(tmp_path / f"b{r}.txt", [("v3", "fast", 1, us)]) for r, us in enumerate([95.0, 99.0, 500.0])]
    out = subprocess.run([sys.executable, str(TOOL), "--a", *a, "--b", *b, "--names", "main,exp"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 2
    exact, fast = out  # sorted by (config, numerics, tokens)
    assert exact.split()[:5] == ["v3", "exact", "128", "main", "400.0"] and "exp" not in exact
    # medians 110 and 99: -10.0%; fastest rounds 100 and 95: -5.0%
    assert fast.split()[:5] == ["v3", "fast", "1", "main", "110.0"]
    assert fast.split()[8:10] == ["exp", "99.0"] and fast.endswith("-10.0%  fastest -5.0%")
