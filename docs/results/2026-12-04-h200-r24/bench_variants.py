"""The variants python -m megamoe_plugin.bench --configs v3,v4flash selects on an H200 (both numerics)."""
import sys
sys.path.insert(0, ".")
from megamoe_plugin.configs import REFERENCE_SHAPES
from megamoe_plugin.jit import check_variants
from tests.gpu.cases import call_variants
out = []
for name in ("v3", "v4flash"):
    ref = REFERENCE_SHAPES[name]
    out += call_variants(1, ref.num_local_experts, ref.num_topk, ref.hidden, ref.intermediate_size, 8192, 132, (True,))
sys.exit(1 if check_variants(list(dict.fromkeys(out))) else 0)
