"""Invariants of the launch heuristics over the shape limits of docs/design.md section 2."""
import itertools
import random

import pytest

from megamoe_plugin.heuristics import (
    IMPLEMENTED_BLOCK_M,
    MAX_STAGES,
    TIERS,
    MIN_STAGES,
    NUMERICS_MODES,
    SMEM_LIMIT,
    KernelConfig,
    default_config,
    default_num_stages,
    expected_tokens_per_expert,
    max_pipeline_stages,
    implemented_block_m,
    select_block_m,
    smem_bytes,
)

# Section 2 limits.
DIMS = range(128, 16384 + 1, 128)
TOPKS = range(1, 17)
LOCAL_EXPERTS = range(1, 513)
RANKS = (1, 2, 4, 8)
MAX_TOKENS = 16384
SM_COUNTS = (1, 7, 66, 78, 114, 132)
ALL_TIER_SETS = [s for n in range(1, len(IMPLEMENTED_BLOCK_M) + 1) for s in itertools.combinations(IMPLEMENTED_BLOCK_M, n)]


def random_shapes(count, seed=0):
    """(R, E, K, H, I, tokens) across the limits, corners first."""
    yield from [(1, 1, 1, 128, 128, 0), (8, 8 * 512, 16, 16384, 16384, MAX_TOKENS),
                (8, 8, 16, 128, 16384, MAX_TOKENS), (1, 512, 1, 16384, 128, 1)]
    rng = random.Random(seed)
    for _ in range(count):
        ranks = rng.choice(RANKS)
        yield (ranks, ranks * rng.choice(LOCAL_EXPERTS), rng.choice(TOPKS), rng.choice(DIMS), rng.choice(DIMS),
               rng.choice((0, 1, MAX_TOKENS, rng.randint(0, MAX_TOKENS))))


def test_expected_tokens_per_expert():
    assert expected_tokens_per_expert(8, 8, 8, 256) == 2.0
    assert expected_tokens_per_expert(1, 1, 6, 32) == 0.1875
    assert expected_tokens_per_expert(0, 4, 16, 512) == 0.0


@pytest.mark.parametrize("args, name", [((-1, 1, 1, 1), "num_tokens"), ((1, 0, 1, 1), "num_ranks"),
                                        ((1, 1, 0, 1), "num_topk"), ((1, 1, 1, 0), "num_experts")])
def test_expected_tokens_per_expert_rejects(args, name):
    with pytest.raises(ValueError, match=name):
        expected_tokens_per_expert(*args)


def test_select_block_m_preferred_tiers():
    all_tiers = IMPLEMENTED_BLOCK_M
    assert [select_block_m(x, all_tiers) for x in (0, 4, 4.5, 8, 8.5, 24, 24.5, 64, 64.5, 8192)] == \
        [8, 8, 16, 16, 32, 32, 64, 64, 128, 128]


def test_select_block_m_nearest_supported():
    assert all(select_block_m(x, (64,)) == 64 for x in (0, 16, 64, 1e6))
    assert [select_block_m(x, (32, 128)) for x in (24, 25, 64, 65)] == [32, 128, 128, 128]  # 64 wanted: tie -> larger
    assert [select_block_m(x, (64, 128)) for x in (0, 64, 65)] == [64, 64, 128]
    assert [select_block_m(x, (32,)) for x in (0, 1e6)] == [32, 32]


def test_the_tier_table():
    """What each tier is (csrc/megamoe/config.cuh): one rebalanced tier (128), which exact numerics
    does not implement, and which runs 64 without fast_math."""
    from megamoe_plugin.heuristics import REBALANCED_BLOCK_M, runnable_block_m

    assert [(t.block_m, t.rebalanced, t.exact) for t in TIERS] == [
        (8, False, True), (16, False, True), (32, False, True), (64, False, True), (128, True, False)]
    assert REBALANCED_BLOCK_M == 128
    assert [runnable_block_m(t.block_m, False) for t in TIERS] == [8, 16, 32, 64, 64]
    assert [runnable_block_m(t.block_m, True) for t in TIERS] == [8, 16, 32, 64, 128]


def test_select_block_m_defaults_to_implemented_tiers():
    assert IMPLEMENTED_BLOCK_M == (8, 16, 32, 64, 128)
    assert (select_block_m(0), select_block_m(6), select_block_m(24), select_block_m(64), select_block_m(1e6)) == (
        8, 16, 32, 64, 128)
    # Exact L1 has no BLOCK_M 128: its largest tier is 64.
    assert implemented_block_m("exact") == (8, 16, 32, 64)
    assert select_block_m(1e6, implemented_block_m("exact")) == 64
    assert default_config(1, 32, 8, 7168, 2048, 8192, 132, "exact").block_m == 64
    assert default_config(1, 32, 8, 7168, 2048, 8192, 132, "fast").block_m == 128


def test_select_block_m_supported_and_monotone():
    grid = sorted({0.0, 16.0, 64.0, *(x / 8 for x in range(0, 2000)),
                   *(MAX_TOKENS * r * k / e for r in RANKS for k in TOPKS for e in (r, r * 32, r * 512))})
    for tiers in ALL_TIER_SETS:
        chosen = [select_block_m(x, tiers) for x in grid]
        assert set(chosen) <= set(tiers)
        assert chosen == sorted(chosen), tiers


@pytest.mark.parametrize("expected, tiers", [(-1, None), (1, ()), (1, (48,)), (1, (64, 256))])
def test_select_block_m_rejects(expected, tiers):
    with pytest.raises(ValueError):
        select_block_m(expected, tiers)


def test_smem_bytes_worked_example():
    # Stage: 64*128 A + 256*128 B + (64 + 4)*4 token scales = 41232 -> 41984 (1024-aligned).
    # Fixed, exact: 1024 barriers + 2*8*64*4 amax + (3*32+1)*4 expert tables + 2*64*4 L1 token
    # scales = 5988 -> 6144, + 2*64*128*2 L1 token staging, + 1024 alignment.
    assert smem_bytes(64, 4, 32, "exact") == 4 * 41984 + 6144 + 32768 + 1024 == 207872
    assert max_pipeline_stages(64, 32, numerics="exact") == 4
    # Fast: no L1 token scales or staging, but the epilogues' quad lines: 1024 + 4096 + 388 = 5508
    # -> 5520 (16-aligned) + 8*8*64 = 9616 -> 10240, + 1024.
    assert smem_bytes(64, 5, 32, "fast") == 5 * 41984 + 10240 + 1024 == 221184
    assert max_pipeline_stages(64, 32, numerics="fast") == 5
    assert smem_bytes(64, 4, 32) == smem_bytes(64, 4, 32, "fast")  # fast is the default


def test_numerics_is_checked():
    with pytest.raises(ValueError, match=r"numerics must be one of \('fast', 'exact'\), got 'fp8'"):
        smem_bytes(64, 4, 32, "fp8")


@pytest.mark.parametrize("block_m", IMPLEMENTED_BLOCK_M)
def test_stages_are_1024_aligned_and_hold_their_tiles(block_m):
    stage = smem_bytes(block_m, 2, 1) - smem_bytes(block_m, 1, 1)
    assert stage % 1024 == 0
    tiles_and_scales = block_m * 128 + 256 * 128 + (block_m + 4) * 4
    assert tiles_and_scales <= stage < tiles_and_scales + 1024


def test_max_pipeline_stages_fits_for_every_tier_and_expert_count():
    for block_m, experts, numerics in itertools.product(IMPLEMENTED_BLOCK_M, LOCAL_EXPERTS, NUMERICS_MODES):
        stages = max_pipeline_stages(block_m, experts, numerics=numerics)
        assert stages >= MIN_STAGES
        assert (smem_bytes(block_m, stages, experts, numerics) <= SMEM_LIMIT
                < smem_bytes(block_m, stages + 1, experts, numerics))


def test_max_pipeline_stages_refuses_fewer_than_two():
    limit = smem_bytes(64, 2, 32) - 1
    assert max_pipeline_stages(64, 32, smem_limit=limit + 1) == 2
    with pytest.raises(ValueError, match="only 1 pipeline stage.*at least 2"):
        max_pipeline_stages(64, 32, smem_limit=limit)
    with pytest.raises(ValueError, match="only 0 pipeline stage"):
        max_pipeline_stages(64, 32, smem_limit=100)


@pytest.mark.parametrize("args", [(48, 2, 1), (64, 0, 1), (64, 2, 0)])
def test_smem_bytes_rejects(args):
    with pytest.raises(ValueError):
        smem_bytes(*args)


def test_default_num_stages_caps():
    assert default_num_stages(64, 32, 7168, 2048, numerics="exact") == 4  # what fits
    assert default_num_stages(64, 32, 7168, 2048) == 5  # fast: no FP16 token staging
    assert default_num_stages(64, 32, 2048, 768, numerics="exact") == 4  # 6 k-blocks: fit binds first
    assert default_num_stages(64, 32, 4096, 384) == 3  # 3 k-blocks
    assert default_num_stages(64, 32, 128, 128) == MIN_STAGES  # 1 k-block, but never below 2
    assert default_num_stages(32, 1, 16384, 16384, smem_limit=1 << 30) == MAX_STAGES


def test_kernel_config_key_and_fields():
    config = KernelConfig(block_m=64, num_stages=5, num_sms=132)
    assert config.key() == "bm64_st5_sm132"
    assert (config.block_n, config.block_k) == (256, 128)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_m=48, num_stages=4, num_sms=132), "block_m"),
    (dict(block_m=64, num_stages=1, num_sms=132), "num_stages"),
    (dict(block_m=64, num_stages=5, num_sms=0), "num_sms"),
    (dict(block_m=64, num_stages=5, num_sms=132, block_n=128), "block_n"),
])
def test_kernel_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**kwargs)


def test_kernel_config_keys_are_distinct_and_file_name_safe():
    configs = [KernelConfig(block_m=64, num_stages=s, num_sms=n) for s in range(2, 9) for n in (1, 13, 132)]
    keys = [c.key() for c in configs]
    assert len(set(keys)) == len(keys)
    assert all(k.replace("_", "").isalnum() for k in keys)


def test_default_config_invariants_across_limits():
    for ranks, experts, topk, hidden, inter, tokens in random_shapes(3000):
        local = experts // ranks
        config = default_config(ranks, experts, topk, hidden, inter, tokens, 132)
        assert config.block_m in IMPLEMENTED_BLOCK_M
        more = default_config(ranks, experts, topk, hidden, inter, min(MAX_TOKENS, 2 * tokens + 1), 132)
        assert more.block_m >= config.block_m  # more rows per expert never picks a smaller tile
        assert MIN_STAGES <= config.num_stages <= MAX_STAGES
        assert config.num_stages <= max(MIN_STAGES, min(hidden, inter) // 128)
        assert smem_bytes(config.block_m, config.num_stages, local) <= SMEM_LIMIT
        assert config.num_sms == 132


def test_default_config_block_m_for_a_deepseek_v3_shape():
    """8 ranks, 256 experts, top-8: tokens / 4 rows per expert, the tiers' measured ranges
    (up to 4, 8, 24, 64 rows, then 128 in fast mode; exact stops at 64)."""
    def block_m(tokens, numerics="fast"):
        return default_config(8, 256, 8, 7168, 2048, tokens, 132, numerics).block_m

    assert [block_m(t) for t in (0, 16, 17, 32, 33, 96, 97, 256, 257, MAX_TOKENS)] == \
        [8, 8, 16, 16, 32, 32, 64, 64, 128, 128]
    assert [block_m(t, "exact") for t in (16, 257, MAX_TOKENS)] == [8, 64, 64]


@pytest.mark.parametrize("args, message", [
    ((3, 32, 8, 7168, 2048, 8, 132), "multiple of num_ranks"),
    ((1, 32, 8, 7000, 2048, 8, 132), "hidden"),
    ((1, 32, 8, 7168, 0, 8, 132), "intermediate_size"),
    ((1, 32, 8, 7168, 2048, -1, 132), "num_tokens"),
    ((1, 32, 8, 7168, 2048, 8, 0), "num_sms"),
])
def test_default_config_rejects(args, message):
    with pytest.raises(ValueError, match=message):
        default_config(*args)
