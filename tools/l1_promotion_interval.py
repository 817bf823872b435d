"""Does promoting the FP8 tensor-core accumulator to float32 more often than once per
128-wide k-block bring every token within docs/design.md section 2's 1e-2 bound of the exact
reference? Emulates the kernel's L1 with cuBLAS FP8 GEMMs of k_chunk columns summed in
float32 (testing.fp8_tensor_core_l1) and reports the error of y against the exact
reference per k_chunk. Needs a GPU.

    python3 tools/l1_promotion_interval.py [H I K E N] ...
"""
import functools
import sys

import torch

from megamoe_plugin import reference
from megamoe_plugin.testing import fp8_tensor_core_l1, random_inputs, random_layer

DEFAULT_SHAPES = ((2048, 768, 8, 32, 512), (4096, 1536, 8, 8, 512), (7168, 2048, 8, 32, 512), (4096, 2048, 6, 32, 512))


def main():
    args = [int(a) for a in sys.argv[1:]]
    shapes = [tuple(args[i:i + 5]) for i in range(0, len(args), 5)] or DEFAULT_SHAPES
    for H, I, K, E, N in shapes:
        gen = torch.Generator(device="cuda").manual_seed(7)
        layer = random_layer(E, H, I, "cuda", gen)
        inputs = random_inputs(N, H, E, K, "uniform", "cuda", gen)
        ranks = [{k: v for k, v in inputs.items() if k != "hidden_states"}]
        exact = reference.mega_moe(ranks, [layer.checkpoint], E)[0]
        for k_chunk in (128, 64, 32, 16):
            l1 = functools.partial(fp8_tensor_core_l1, k_chunk=k_chunk)
            y = reference.mega_moe(ranks, [layer.checkpoint], E, l1_gemm=l1)[0]
            print(f"H{H} I{I} K{K} E{E} N{N} k_chunk {k_chunk:3d}: {reference.error_summary(y, exact)}", flush=True)


if __name__ == "__main__":
    main()
