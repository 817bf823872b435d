"""`python -m megamoe_plugin.bench` (megamoe_plugin.bench.cli)."""
import sys

from .cli import main

sys.exit(main())
