"""A kernel timeout's ERROR line reaches the user's log under SGLang's own logging setup.

Every SGLang scheduler process loads the plugins (the megamoe_sm90 entry point) and then
sets up logging with sglang's configure_logger: basicConfig(force=True) on the root logger,
"[date TP0] message" on stderr, at --log-level. The watchdog's "megamoe_plugin" logger
propagates to that root handler (so this passed before vLLM's case was fixed too; it keeps
that so). The test runs in a fresh interpreter, as a scheduler process is, so that SGLang's
logging config does not leak into the other tests.
"""
import os
import re
import subprocess
import sys

from conftest import not_0_5_17

pytestmark = not_0_5_17  # 0.5.17 has configure_logger elsewhere; the setup is the same

# What a scheduler process does first (sglang/srt/managers/scheduler.py: run_scheduler_process
# loads the plugins, configure_scheduler_process sets up logging); configure_logger reads only
# the log level of the server args.
SCHEDULER_PROCESS = """
import types
from sglang.srt.plugins import load_plugins
from sglang.srt.utils.common import configure_logger, suppress_other_loggers

load_plugins()
configure_logger(types.SimpleNamespace(log_level="info"), prefix=" TP0")
suppress_other_loggers()
"""
WATCHDOG = """
from megamoe_plugin.watchdog import Watchdog

Watchdog(lambda: 0x0102, lambda: 3, "megamoe kernel timed out: error word {:#x}".format,
         "megamoe: {} topk_idx entries dropped".format).poll()
"""


def test_watchdog_lines_reach_sglangs_handler():
    env = dict(os.environ, SGLANG_PLUGINS="megamoe_sm90")
    result = subprocess.run([sys.executable, "-c", SCHEDULER_PROCESS + WATCHDOG], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for message in ("megamoe kernel timed out: error word 0x102", "megamoe: 3 topk_idx entries dropped"):
        # Once, in SGLang's format: not (also) the bare line of Python's last-resort handler.
        lines = [line for line in result.stderr.splitlines() if line.endswith(message)]
        assert len(lines) == 1 and re.fullmatch(rf"\[\d{{4}}-\d\d-\d\d [\d:]+ TP0\] {message}", lines[0]), \
            result.stderr
