"""Progress for the long steps (compiling kernel variants, the tuning sweep, the benchmark's
points): tqdm's bar where stderr is a terminal and tqdm is installed, else a line on stderr at
every tenth of the work, so that a step of minutes is never silent and a log file (or a pipe)
gets whole lines, not a bar redrawn with carriage returns in the middle of stdout's lines.
Standard library only: tqdm is optional."""
from __future__ import annotations

import sys
import threading


class _Lines:
    """The part of tqdm's interface the project uses: update, set_postfix_str, close.
    update may come from several threads (jit.compile_variants' on_done)."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self.postfix = ""
        self._printed = 0  # tenths of the total already reported
        self._lock = threading.Lock()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            tenths = self.done * 10 // self.total if self.total else 10
            if tenths <= self._printed:
                return
            self._printed = tenths
            postfix = f" ({self.postfix})" if self.postfix else ""
            print(f"{self.desc}: {self.done}/{self.total} {self.unit}s{postfix}", file=sys.stderr, flush=True)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str):
    """A tqdm bar over `total` units on a terminal, else (stderr redirected, or no tqdm) the
    line-per-tenth fallback."""
    if not sys.stderr.isatty():
        return _Lines(total, desc, unit)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, desc, unit)
    return tqdm(total=total, desc=desc, unit=unit)
