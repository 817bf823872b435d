"""The heuristics and config-table modules run in the per-call path and in processes
that have not imported torch yet, and the timeline's layout is read without torch: they
must import only the standard library (and the package's own modules, such as
megamoe_plugin.abi, whose extension needs nothing else)."""
import ast
import sys

import pytest

from megamoe_plugin import configs, heuristics, timeline


@pytest.mark.parametrize("module", [heuristics, configs, timeline], ids=lambda m: m.__name__)
def test_module_imports_only_the_standard_library(module):
    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
