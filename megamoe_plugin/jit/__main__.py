"""`python -m megamoe_plugin.jit` (megamoe_plugin.jit.cli). The CLI runs from this module,
not from the package's __init__: the package imports megamoe_plugin.jit (ops needs it)
before runpy would execute it again as __main__, which makes runpy warn "found in
sys.modules"."""
import sys

from .cli import main

sys.exit(main())
