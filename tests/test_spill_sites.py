"""megamoe_plugin.jit.spill_sites: which spill instructions lie inside a WGMMA main loop (the innermost
loop that holds a GMMA), read from nvdisasm-shaped text; tools/spill_sites.py's variant names."""
import importlib.util
from pathlib import Path

from megamoe_plugin.jit.spill_sites import spill_sites

_spec = importlib.util.spec_from_file_location(
    "spill_sites", Path(__file__).resolve().parents[1] / "tools" / "spill_sites.py")
spill_sites_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spill_sites_tool)

# Two functions. In the first: a tile loop (.L_x_1) around a k-block loop (.L_x_2) holding the GMMA,
# a spill before the tile loop, one in the tile loop outside the k-block loop, one in the k-block loop
# and one after it; a forward branch (.L_x_9) is no loop, nor is the out-of-line stub after EXIT
# (.L_x_7, entered by BRA.DIV) that branches back to the GMMA (.L_x_8): read as a loop, it would hold
# the spill after the k-block loop. The second function has a loop with no GMMA.
SASS = """
//--------------------- .text.megamoe_fused_kernel --------------------------
.text.megamoe_fused_kernel:
        /*0000*/                   STL [R1], R2 ;
.L_x_1:
        /*0010*/                   LDL R0, [R1] ;
.L_x_2:
        /*0018*/                   BRA.DIV UR4, `(.L_x_7) ;
.L_x_8:
        /*0020*/                   HGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0030*/                   STL.64 [R1+0x8], R4 ;
        /*0040*/              @!P0 BRA `(.L_x_2) ;
        /*0050*/                   LDL.LU R3, [R1+0x4] ;
        /*0060*/               @P1 BRA `(.L_x_9) ;
        /*0070*/                   BRA `(.L_x_1) ;
.L_x_9:
        /*0080*/                   EXIT ;
.L_x_7:
        /*0090*/                   VOTE.ALL P0, P0 ;
        /*00a0*/                   BRA `(.L_x_8) ;
//--------------------- .text.megamoe_window_kernel --------------------------
.text.megamoe_window_kernel:
.L_x_3:
        /*0000*/                   STL [R1], R2 ;
        /*0010*/                   BRA `(.L_x_3) ;
"""


def test_spills_inside_the_innermost_gmma_loop_only_count_as_main_loop():
    sites = spill_sites(SASS)
    got = [(s.function, s.instruction.split()[0], s.in_main_loop) for s in sites]
    assert got == [("megamoe_fused_kernel", "STL", False), ("megamoe_fused_kernel", "LDL", False),
                   ("megamoe_fused_kernel", "STL.64", True), ("megamoe_fused_kernel", "LDL.LU", False),
                   ("megamoe_window_kernel", "STL", False)]


def test_variant_names_parse_back_into_variants():
    v = spill_sites_tool.variant_of("h7168_i2048_k8_e64_r2_bm64_st5_fm1_fast_win")
    assert v.name() == "h7168_i2048_k8_e64_r2_bm64_st5_fm1_fast_win" and v.windowed and v.fast_math
    v = spill_sites_tool.variant_of("h384_i256_k4_e4_r1_bm128_st4_fm1_fast_timeline")
    assert v.timeline and not v.windowed


def test_variant_names_round_trip():
    """The tool rebuilds a variant from the name the JIT prints, MXFP4 (_w4) and windowed ones too."""
    for name in ("h7168_i2048_k8_e32_r1_bm64_st5_fm1_fast", "h7168_i2048_k8_e32_r1_bm64_st5_fm1_fast_win",
                 "h4096_i2048_k6_e32_r1_bm8_st10_fm1_fast_w4", "h384_i256_k4_e8_r1_bm32_st2_fm0_exact_timeline"):
        assert spill_sites_tool.variant_of(name).name() == name
