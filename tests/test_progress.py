"""Progress without tqdm: a line per tenth of the work on stderr."""
import sys

from megamoe_plugin import progress


def test_without_tqdm_prints_a_line_per_tenth(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    bar = progress.progress_bar(20, "compiling", "variant")
    assert isinstance(bar, progress._Lines)
    bar.set_postfix_str("v3")
    for _ in range(20):
        bar.update()
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"compiling: {n}/20 variants (v3)" for n in range(2, 21, 2)]


def test_an_empty_step_reports_once(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = progress.progress_bar(0, "compiling", "variant")
    bar.update(0)
    bar.update(0)
    assert capsys.readouterr().err == "compiling: 0/0 variants\n"
