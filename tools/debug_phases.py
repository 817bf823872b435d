"""Runs the kernel phase by phase on one small case and checks each phase's output
against the reference's intermediates (docs/design.md section 2 steps).

    python3 tools/debug_phases.py [H I K E N] [--phases 2,4,5,6,0] [--pool-rows P]

--pool-rows: pools of P rows (buffer.BufferShape.pool_rows), fewer than the call needs, so that it
runs in pool windows; only the whole call (phase 0) is checked then.
--shared-experts S: S shared experts beside the E routed ones, which every token passes through
(staged by mm.stage_inputs); only the whole call (phase 0) is checked then.
--weights mxfp4: MXFP4 experts (testing.random_mxfp4_layer, read at 4 bits) in fast numerics; only the
whole call (phase 0) is checked then.
"""
import argparse
import math

import torch

import megamoe_plugin as mm
from megamoe_plugin.fp8 import dequantize_per_token_group
from megamoe_plugin.buffer import SIGNAL_WORDS
from megamoe_plugin.heuristics import WEIGHT_FORMATS
from megamoe_plugin.testing import (check_outputs, fill_buffer, random_inputs, random_layer, random_layer_of,
                                    reference_ranks, staged_inputs, with_shared_experts)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", nargs="*", type=int, default=[2048, 768, 8, 8, 33])
    parser.add_argument("--phases", default="2,4,5,6,0")
    parser.add_argument("--pool-rows", type=int, default=None)
    parser.add_argument("--shared-experts", type=int, default=0)
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="fp8")
    args = parser.parse_args()
    H, I, K, E, N = args.shape
    if (args.pool_rows is not None or args.shared_experts or args.weights != "fp8") and args.phases != "0":
        parser.error("--pool-rows, --shared-experts and --weights mxfp4 check the whole call only: pass --phases 0")
    if args.shared_experts and args.weights != "fp8":
        parser.error("--shared-experts runs FP8 experts only (one call reads one weight format)")
    gen = torch.Generator(device="cuda").manual_seed(7)
    if args.shared_experts:
        return whole_call_with_shared_experts(H, I, K, E, N, args.shared_experts, args.pool_rows, gen)
    layer = random_layer_of(args.weights)(E, H, I, "cuda", gen)
    buf = mm.get_symm_buffer(None, E, N, K, H, I, pool_rows=args.pool_rows)
    inputs = random_inputs(N, H, E, K, "uniform", "cuda", gen)
    fill_buffer(buf, inputs)
    ranks = reference_ranks([inputs])
    ys, inter = mm.reference.mega_moe(ranks, [layer.checkpoint], E, return_intermediates=True)
    idx = inputs["topk_idx"]
    counts = torch.bincount(idx[idx >= 0], minlength=E)
    starts = torch.cumsum(counts, 0) - counts

    for phase in [int(p) for p in args.phases.split(",")]:
        y = torch.full((N, H), math.nan, dtype=torch.bfloat16, device="cuda")
        mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, _stop_after_phase=phase)
        mm.ops.synchronize()
        print(f"--- phase {phase or 'all'} ran")
        if phase == 2:
            # The call's half of the send side: its cross-rank barrier's round & 1 (dispatch.cuh send_side).
            half = int(buf.view("signals")[SIGNAL_WORDS["rank_barrier_done"]]) & 1
            assert torch.equal(buf.view("send_count")[half].long(), counts), "send_count wrong"
            offs = buf.view("send_offset")[half].long()
            lst = buf.view("send_list")
            for e in range(E):
                got = sorted(lst[offs[e]: offs[e] + counts[e]].tolist())
                want = sorted(torch.nonzero(idx.reshape(-1) == e).squeeze(1).tolist())
                assert got == want, f"send list of expert {e} wrong"
            print("send side ok")
        if phase == 4:
            src = buf.view("pool_src")
            for e in range(E):
                rows = slice(int(starts[e]), int(starts[e] + counts[e]))
                entries = src[rows, 1].long()
                assert bool((src[rows, 0] == 0).all()), f"pool_src rank wrong for expert {e}"
                assert sorted(entries.tolist()) == sorted(torch.nonzero(idx.reshape(-1) == e).squeeze(1).tolist())
                tok = entries // K
                assert torch.equal(buf.view("pool_x")[rows].view(torch.uint8), inputs["x"][tok].view(torch.uint8))
                assert torch.equal(buf.view("pool_sf")[:, rows].T, inputs["x_sf"][tok])
                assert torch.equal(buf.view("pool_weight")[rows], inputs["topk_weights"].reshape(-1)[entries])
            print("pool ok")
        if phase in (5, 6):
            src = buf.view("pool_src")
            worst = 0.0
            all_rows = []
            flips = [0, 0, 0.0]
            for e in range(E):
                n_e = int(counts[e])
                if n_e == 0:
                    continue
                rows = slice(int(starts[e]), int(starts[e] + n_e))
                entries = src[rows, 1].long()
                ref_src = inter[e]["src"]
                ref_entries = ref_src[:, 1] * K + ref_src[:, 2]
                order = torch.argsort(ref_entries)
                pos = torch.searchsorted(ref_entries[order], entries)
                ref_rows = order[pos]
                if phase == 5:
                    act = dequantize_per_token_group(buf.view("act")[rows], buf.view("act_sf")[:, rows].T.contiguous())
                    ref = inter[e]["act"][ref_rows]
                    codes = buf.view("act")[rows].view(torch.uint8)
                    ref_codes = inter[e]["act_q"][ref_rows].view(torch.uint8)
                    flips[0] += int((codes != ref_codes).sum())
                    flips[1] += codes.numel()
                    sf_rel = (buf.view("act_sf")[:, rows].T - inter[e]["act_sf"][ref_rows]).abs() / inter[e]["act_sf"][ref_rows]
                    flips[2] = max(flips[2], float(sf_rel.max()))
                else:
                    act = buf.view("combine").view(-1, H)[entries].float()
                    ref = inter[e]["l2_out"][ref_rows]
                rel = float((act - ref).norm() / ref.norm().clamp_min(1e-30))
                worst = max(worst, rel)
                if phase == 6:
                    row_rel = (act - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
                    all_rows.append(row_rel)
                    for r in torch.nonzero(row_rel > 0.02).squeeze(1).tolist()[:3]:
                        print(f"  expert {e} pool row {r} (tile row {r % 64}) entry {int(entries[r])}: rel {float(row_rel[r]):.3e}")
                if rel > 0.05:
                    print(f"expert {e}: rel err {rel:.3e}; first row got {act[0, :8].tolist()} want {ref[0, :8].tolist()}")
            print(f"phase {phase} worst expert rel err {worst:.3e}")
            if phase == 5:
                print(f"  act_q codes differing from the reference: {flips[0]} of {flips[1]} "
                      f"({flips[0] / max(flips[1], 1):.2e}); act_sf max rel diff {flips[2]:.2e}")
            if all_rows:
                q = torch.cat(all_rows)
                print("  per-row rel err quantiles 50/90/99/max:",
                      [f"{float(q.quantile(t)):.2e}" for t in (0.5, 0.9, 0.99)], f"{float(q.max()):.2e}")
        if phase == 0:  # judged for the call's numerics mode (MEGAMOE_NUMERICS)
            check_outputs([y], [inputs], [layer], E, mm.ops.resolve_numerics(None))
            print("y ok", mm.reference.calc_diff(y, ys[0]))


def whole_call_with_shared_experts(H, I, K, E, N, S, pool_rows, gen):
    buf = mm.get_symm_buffer(None, E, N, K, H, I, pool_rows=pool_rows, num_shared_experts=S)
    layer = with_shared_experts(random_layer(E, H, I, "cuda", gen), random_layer(S, H, I, "cuda", gen).checkpoint)
    inputs = random_inputs(N, H, E, K, "uniform", "cuda", gen)
    mm.stage_inputs(buf, inputs["hidden_states"], inputs["topk_idx"], inputs["topk_weights"], shared_scale=0.5)
    y = torch.full((N, H), math.nan, dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
    mm.ops.synchronize()
    print(f"--- phase all ran ({S} shared experts)")
    check_outputs([y], [staged_inputs(buf, N)], [layer], buf.shape.num_experts, mm.ops.resolve_numerics(None))
    print("y ok")


if __name__ == "__main__":
    main()
