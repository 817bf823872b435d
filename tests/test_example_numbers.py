"""The buffer size examples/serve.sh quotes is today's: get_symm_buffer_size for DeepSeek-V3 (256
experts, top-8, H 7168, I 2048) at 8192 tokens per rank over EP8, as README's "Memory per rank"
table has it (a stale 5.6 GiB stood there after the pools shrank)."""
import re
from pathlib import Path

import megamoe_plugin as mm

ROOT = Path(__file__).resolve().parents[1]


def test_serve_example_quotes_todays_buffer_size():
    nbytes = mm.get_symm_buffer_size(8, 256, 8192, 8, 7168, 2048)
    text = (ROOT / "examples" / "serve.sh").read_text()
    (mib,) = re.findall(r"over 8 EP rank\(s\): ([\d.]+) MiB per rank", text)
    assert mib == f"{nbytes / 2**20:.1f}"
    (gib,) = re.findall(r"~([\d.]+) GiB/GPU at 8192 for V3", text)
    assert gib == f"{nbytes / 2**30:.2f}"
    readme = (ROOT / "README.md").read_text().splitlines()
    readme_row = next(line for line in readme if line.startswith("| v3 (H 7168, I 2048, top-8) |"))
    assert readme_row.rstrip(" |").split("|")[-1].strip() == gib
