"""A kernel timeout's ERROR line reaches the user's log under vLLM's own logging setup.

vLLM's logging config (vllm.logger.configure_logging, run in every vLLM process) gives the
"vllm" logger the one handler and stops it propagating; the root logger gets none. The
watchdog logs on the "megamoe_plugin" logger, so its line must be handed to vLLM's logger
(the plugin's register(), which vLLM runs in every process through its entry point) or it
misses vLLM's handler: Python's last-resort handler prints the bare message on stderr, and
a user whose vLLM logs go to a file never sees it. The cases with vLLM's logging run in a
fresh interpreter, as a vLLM process does, so that its config does not leak into the other
tests; serving.route_logs_to's own contract is tested in this process, on a stand-in logger.
"""
import io
import logging
import os
import re
import subprocess
import sys

import pytest

from megamoe_plugin import serving
from megamoe_plugin.watchdog import Watchdog

pytest.importorskip("vllm")

CONFIGURE = ("from vllm.config.logging import LoggingConfig\n"
             "from vllm.logger import configure_logging\n"
             "configure_logging(LoggingConfig())\n")
PLUGINS = ("from vllm.plugins import load_general_plugins\n"
           "load_general_plugins()\n")
WATCHDOG = """
from megamoe_plugin import serving
from megamoe_plugin.watchdog import Watchdog

serving.logger.info("megamoe_sm90: a serving progress line")
Watchdog(lambda: 0x0102, lambda: 3, "megamoe kernel timed out: error word {:#x}".format,
         "megamoe: {} topk_idx entries dropped".format).poll()
"""


def run_vllm_process(order: str, level: str) -> subprocess.CompletedProcess:
    """A process that sets up vLLM's logging and loads its plugins in `order`, as vLLM's
    processes do, then has the watchdog see a failure word and bad expert ids."""
    steps = {"configure, then plugins": CONFIGURE + PLUGINS, "plugins, then configure": PLUGINS + CONFIGURE}[order]
    env = dict(os.environ, VLLM_PLUGINS="megamoe_sm90", VLLM_LOGGING_LEVEL=level,
               VLLM_LOGGING_STREAM="ext://sys.stdout", VLLM_LOGGING_COLOR="0")
    return subprocess.run([sys.executable, "-c", steps + WATCHDOG], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("order, level", [("configure, then plugins", "INFO"),
                                          ("plugins, then configure", "WARNING")])
def test_watchdog_lines_reach_vllms_handler(order, level):
    result = run_vllm_process(order, level)
    assert result.returncode == 0, result.stderr
    # vLLM's format: "(process pid) LEVEL date [file:line] message", on its handler's stream.
    for message in ("megamoe kernel timed out: error word 0x102", "megamoe: 3 topk_idx entries dropped"):
        assert re.search(rf"ERROR \d\d-\d\d [\d:]+ \[watchdog\.py:\d+\] {message}$", result.stdout, re.M), \
            (result.stdout, result.stderr)
        assert message not in result.stderr  # once, through vLLM's handler, not the last-resort one
    # vLLM's level decides for the package's records as for its own.
    progress = re.search(r"INFO .* megamoe_sm90: a serving progress line$", result.stdout, re.M)
    assert bool(progress) == (level == "INFO"), result.stdout
    assert "serving progress" not in result.stderr


@pytest.fixture
def framework_logger():
    """A stand-in for vLLM's "vllm" logger as its config sets it up (its own handler, not
    propagating), and the package logger put back as it was afterwards."""
    package = logging.getLogger(serving.PACKAGE_LOGGER)
    saved = package.handlers[:], package.level, package.propagate
    framework = logging.getLogger("a_framework")
    framework.addHandler(logging.StreamHandler(io.StringIO()))
    framework.propagate = False
    yield framework
    framework.handlers.clear()
    package.handlers[:] = saved[0]
    package.setLevel(saved[1])
    package.propagate = saved[2]


def _framework_output(framework):
    return framework.handlers[0].stream.getvalue()


def test_watchdog_lines_reach_the_framework_logger_they_are_routed_to(framework_logger, caplog):
    watchdog = Watchdog(lambda: 0x0102, lambda: 0, "timed out: {:#x}".format, str)
    framework_logger.setLevel(logging.WARNING)
    serving.route_logs_to(framework_logger)
    serving.route_logs_to(framework_logger)  # idempotent: still one line per record
    serving.logger.info("progress")  # below the framework logger's level: dropped there
    watchdog.poll()
    assert _framework_output(framework_logger) == "timed out: 0x102\n"
    assert not [r for r in caplog.records if r.name.startswith("megamoe_plugin")]  # not also through the root logger
    framework_logger.setLevel(logging.INFO)  # the framework's level decides, also when it changes later
    serving.logger.info("progress")
    assert _framework_output(framework_logger) == "timed out: 0x102\nprogress\n"
