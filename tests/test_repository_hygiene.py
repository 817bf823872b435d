"""The tracked files speak of the product, not of the machines and tools it was developed with:
no output-folder variable of a development harness, no "carry" of files to a machine, no
machine kinds or per-call limits, no absolute paths of development machines or folders outside
the repository; README and docs/performance.md state facts, not the history of rounds and issues.
Each rule names what it found, file and line."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# (what, pattern, applies to path?): every tracked file but this one, where the predicate holds.
EVERYWHERE = lambda path: True  # noqa: E731
# csrc's comments use "carries"/"carried over" of registers and pipeline state; LICENSE is legal text.
PROSE = lambda path: not path.startswith("csrc/") and path != "LICENSE"  # noqa: E731
CURRENT_DOCS = {"README.md", "docs/performance.md"}
RULES = [
    ("a harness's output variable", re.compile(r"\$\{?OUT\b"), EVERYWHERE),
    ("the harness's remote-run tool", re.compile(r"\bdevice\s+tool\b", re.IGNORECASE), EVERYWHERE),
    ("a per-call transfer limit", re.compile(r"\b64 ?MiB calls?\b"), EVERYWHERE),
    ("a machine kind", re.compile(r"\bnvidia-h(100|200)(-x\d+)?\b"), EVERYWHERE),
    ("a development machine's path", re.compile(r"/(root|tmp|work)/"), EVERYWHERE),
    ("a folder outside the repository", re.compile(r"\.\./shared\b|\bvllm_on_gpu\b|\bsglang_on_gpu\b"), EVERYWHERE),
    ("files carried to a machine", re.compile(r"\.carry\b|\bcarry\s*\[|\bcarr(y|ied)\s+(`?\.\w|MEGAMOE_CACHE_DIR)"
                                              r"|\b(cubins?|wheels?|bundles?|parts?|cache) carried\b"
                                              r"|\bcarried (cache|cubins?|wheels?|bundles?|tarballs?)\b"), EVERYWHERE),
    ("carry / carried", re.compile(r"\bcarr(y|ied)\b", re.IGNORECASE), PROSE),
    ("the results log, which left the repository", re.compile(r"docs/results"),
     lambda path: PROSE(path) and path != "docs/design.md"),
    ("round or issue history", re.compile(r"\b[Rr]ound \d|\b[Ii]ssue \d|\bround[- ]?\d"), CURRENT_DOCS.__contains__),
]


def tracked_files():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (git ls-files) to know the tracked files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name and name != THIS]


def findings(rule, files):
    what, pattern, applies = rule
    found = []
    for name in files:
        if not applies(name):
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or deleted in the working tree
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


@pytest.mark.parametrize("rule", RULES, ids=[rule[0] for rule in RULES])
def test_tracked_files_name_no_development_machinery(rule):
    found = findings(rule, tracked_files())
    assert not found, f"{rule[0]} in tracked files:\n" + "\n".join(found)


def test_the_rules_catch_what_they_are_for():
    """Each rule on a line it must flag, and the product's own wording it must let pass."""
    flagged = {
        "a harness's output variable": 'tee "$' 'OUT/tests.log"',
        "the harness's remote-run tool": "Usage (device " "tool): bash tools/gpu_check.sh",
        "a per-call transfer limit": "far over what can be carried in 64 MiB calls",
        "a machine kind": 'reason="needs two GPUs; run on nvidia-h' '200-x2"',
        "a development machine's path": "--output-dir /ro" "ot/out/r26/table",
        "a folder outside the repository": "bash ../sha" "red/tools/vllm_on_gpu/stage.sh",
        "files carried to a machine": 'carry ' '[".jitcache", ".whl"]',
        "carry / carried": "the carried cache",
        "the results log, which left the repository": "see docs/results/README.md",
        "round or issue history": "measured in round 26 (issue 12's closing run)",
    }
    assert set(flagged) == {rule[0] for rule in RULES}
    for what, pattern, _ in RULES:
        assert pattern.search(flagged[what]), what
    for fine in ("each role's PipelineState carries over", "~/.cache/megamoe_plugin", "for round in 1 2; do",
                 "copy MEGAMOE_CACHE_DIR to the GPU machine", "NVIDIA H200 (132 SMs)", "configs/NVIDIA_H200.json"):
        hits = [what for what, pattern, applies in RULES if applies("README.md") and pattern.search(fine)]
        assert not hits, (fine, hits)
