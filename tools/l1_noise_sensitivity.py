"""How precise must the L1 GEMM be for the per-token bounds of docs/design.md section 2?
Runs the reference with its L1 output perturbed by Gaussian noise of relative size eps
(relative to each row's largest output) and reports the error of y against the exact
reference. eps 1e-4 is FP8 tensor-core accumulation's level (fast mode), 1e-7 float32
accumulation in another order (exact mode). The routing (testing.ROUTINGS) matters: one_expert
gives each token one slot, so no averaging over K slots hides a requant flip. CPU is enough.

    python3 tools/l1_noise_sensitivity.py [H I K E N [ROUTING]]
"""
import sys

import torch

from megamoe_plugin import reference
from megamoe_plugin.testing import float64_l1, random_inputs, random_layer


def main():
    H, I, K, E, N = [int(a) for a in sys.argv[1:6]] or [2048, 768, 8, 32, 512]
    routing = sys.argv[6] if len(sys.argv) > 6 else "uniform"
    gen = torch.Generator().manual_seed(7)
    layer = random_layer(E, H, I, "cpu", gen)
    inputs = random_inputs(N, H, E, K, routing, "cpu", gen)
    ranks = [{k: v for k, v in inputs.items() if k != "hidden_states"}]
    exact = reference.mega_moe(ranks, [layer.checkpoint], E)[0].double()
    for eps in (1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 3e-7, 1e-7):
        noise = torch.Generator().manual_seed(1)

        def noisy_l1(x, x_sf, w, w_sf):
            h = float64_l1(x, x_sf, w, w_sf)
            row_max = h.abs().amax(dim=1, keepdim=True)
            return (h + eps * row_max * torch.randn(h.shape, generator=noise, dtype=torch.float64)).float()

        y = reference.mega_moe(ranks, [layer.checkpoint], E, l1_gemm=noisy_l1)[0]
        print(f"eps {eps:.0e}: {reference.error_summary(y, exact)}", flush=True)


if __name__ == "__main__":
    main()
