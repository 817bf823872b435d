"""Progress without tqdm or without a terminal: a line per tenth of the work on stderr."""
import sys

import pytest

from megamoe_plugin import progress


class _Terminal:
    """stderr as a terminal (pytest's capture is none)."""

    def __init__(self, stream):
        self.stream = stream

    def isatty(self):
        return True

    def write(self, text):
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def test_without_tqdm_prints_a_line_per_tenth(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    monkeypatch.setattr(sys, "stderr", _Terminal(sys.stderr))
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


def test_a_redirected_stderr_gets_lines_not_a_bar(monkeypatch, capsys):
    """Where stderr is a file or a pipe (a log), tqdm's carriage-return bar would land in the middle of
    stdout's result lines: the lines instead, tqdm installed or not."""
    pytest.importorskip("tqdm")
    bar = progress.progress_bar(4, "points", "point")
    assert isinstance(bar, progress._Lines)
    monkeypatch.setattr(sys, "stderr", _Terminal(sys.stderr))
    assert not isinstance(progress.progress_bar(4, "points", "point"), progress._Lines)
