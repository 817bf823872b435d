"""A daemon thread that brings what kernels report to the log, also when nobody asks.

A kernel whose wait times out records which wait, on which rank and in which kernel
variant in host-mapped memory (csrc/megamoe/params.h HostWords) and traps, which kills
the CUDA context. `ops.synchronize()` turns that into a RuntimeError, but a server never
calls it: vLLM replays the kernel from CUDA graphs, and its next CUDA call, wherever it
happens, fails with an anonymous "unspecified launch failure". Likewise topk_idx entries
outside [-1, E) that a replayed graph dropped would wait for the next eager call.

So the op layer starts this thread when it loads its first kernel. Every POLL_INTERVAL_S
it reads the host words with plain loads (no CUDA call: nothing is added per launch, and
it works after the context died) and logs at ERROR on the "megamoe_plugin" logger
(under vLLM, whose logging shows only its own loggers, the plugin routes that logger to
vLLM's: serving.route_logs_to): the first kernel failure, once, and how many bad expert ids
were dropped since its last report. It reads the counter without clearing it: `reports.raise_input_errors` keeps its own
record of what it raised.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

logger = logging.getLogger("megamoe_plugin")

# A timed-out wait shows in the log within this of the trap; each poll is two loads.
POLL_INTERVAL_S = 0.25


class Watchdog:
    """Polls `read_error_word()` and `read_bad_expert_ids()` (the runtime's host-word reads)
    and logs `describe_error(word)` and `describe_bad_expert_ids(new)` messages."""

    def __init__(self, read_error_word: Callable[[], int], read_bad_expert_ids: Callable[[], int],
                 describe_error: Callable[[int], str], describe_bad_expert_ids: Callable[[int], str],
                 interval_s: float = POLL_INTERVAL_S):
        self._read_error_word = read_error_word
        self._read_bad_expert_ids = read_bad_expert_ids
        self._describe_error = describe_error
        self._describe_bad_expert_ids = describe_bad_expert_ids
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.error_reported = False
        self.bad_expert_ids_reported = 0

    def start(self) -> None:
        """Starts the thread unless it runs already (cheap to call again)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="megamoe-watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Ends the thread (tests); a later start() runs a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
            self._stop.clear()

    def poll(self) -> None:
        """One look at the host words: logs what is new since the last look."""
        if not self.error_reported:
            word = self._read_error_word()
            if word:
                self.error_reported = True
                logger.error("%s", self._describe_error(word))
        total = self._read_bad_expert_ids()
        if total != self.bad_expert_ids_reported:
            # Logged before the count moves: who sees the count caught up sees the line too.
            logger.error("%s", self._describe_bad_expert_ids(total - self.bad_expert_ids_reported))
            self.bad_expert_ids_reported = total

    def _run(self) -> None:
        # After a failure the context is gone and no kernel can run again: nothing more to watch.
        while not self.error_reported and not self._stop.wait(self._interval_s):
            self.poll()
