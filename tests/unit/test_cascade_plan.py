"""Cascade planning (pure, no torch): groups of decode rows sharing full prefix blocks, and the
cost model that keeps a group only where a shared pass beats the plain kernel. Block size 4."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.common.engine.cascade_plan import (
    COST_MODELS,
    CascadeConfig,
    CascadeCostModel,
    CascadeGroup,
    CascadePlan,
    cascade_config,
    find_groups,
    group_saving,
    plan_cascade,
    step_costs,
)

BS = 4


def test_rows_with_the_same_first_blocks_form_a_group_with_their_common_prefix():
    tables = [
        (10, 11, 12, 13, 14, 50),  # shares 5 blocks with row 2
        (20, 21, 22, 23, 24),  # alone
        (10, 11, 12, 13, 14, 15, 60),
        (10, 11, 12, 13, 70),  # shares only 4 with rows 0 and 2
    ]
    lens = [22, 20, 26, 17]
    assert find_groups(tables, lens, BS, min_shared_blocks=4) == (CascadeGroup((0, 2, 3), 4),)
    assert find_groups(tables, lens, BS, min_shared_blocks=5) == (CascadeGroup((0, 2), 5),)


def test_a_shared_block_must_be_full_for_every_member():
    # Row 1's context ends inside block 13: only blocks 10..12 are full for it.
    tables = [(10, 11, 12, 13, 14), (10, 11, 12, 13)]
    assert find_groups(tables, [20, 15], BS, 2) == (CascadeGroup((0, 1), 3),)
    # A block is full once its last slot holds a token.
    assert find_groups(tables, [20, 16], BS, 2) == (CascadeGroup((0, 1), 4),)
    # Fewer full blocks than the minimum: no group.
    assert find_groups(tables, [20, 7], BS, 2) == ()


def test_separate_prefixes_give_separate_groups_in_row_order():
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    tables = [b + (9,), a + (10,), b + (11,), a + (12,), (13,)]
    lens = [18, 18, 18, 18, 3]
    assert find_groups(tables, lens, BS, 4) == (CascadeGroup((0, 2), 4), CascadeGroup((1, 3), 4))


def test_no_groups_without_sharing():
    assert find_groups([(1, 2, 3, 4, 5), (6, 7, 8, 9, 10)], [20, 20], BS, 4) == ()
    assert find_groups([], [], BS, 4) == ()


COST = CascadeCostModel(
    per_token=1.0, shared_per_query=0.25, shared_per_token=1.0, per_group=100.0, per_merged_row=10.0
)


def test_group_saving_grows_with_group_size_and_shared_length():
    # saving = (per_token - shared_per_query) * M * S - shared_per_token * S - per_group - per_merged_row * M
    g = CascadeGroup(tuple(range(8)), 64 // BS)  # M = 8, S = 64
    assert group_saving(g, BS, COST) == pytest.approx(0.75 * 8 * 64 - 64 - 100 - 80)
    small = CascadeGroup((0, 1), 1)  # M = 2, S = 4: the fixed costs win
    assert group_saving(small, BS, COST) < 0
    assert group_saving(CascadeGroup((0, 1), 64), BS, COST) > 0
    bigger = CascadeGroup(tuple(range(16)), 64 // BS)
    assert group_saving(bigger, BS, COST) > group_saving(g, BS, COST)


def test_plan_keeps_only_groups_that_pay():
    shared = tuple(range(100, 164))  # 64 blocks = 256 tokens
    tables = [shared + (1,), shared + (2,), (3, 4, 5, 6, 7), (3, 4, 5, 6, 8)]
    lens = [257, 258, 20, 19]
    plan = plan_cascade(tables, lens, BS, CascadeConfig(min_shared_blocks=4, cost=COST))
    # Rows 2 and 3 share 4 blocks (16 tokens): 0.75 * 2 * 16 = 24 < fixed costs; rows 0, 1 pay.
    assert plan == CascadePlan((CascadeGroup((0, 1), 64),), BS)
    assert plan.num_queries == 2
    assert plan.shared_blocks(tables) == (shared,)
    plain, cascade = step_costs(plan, lens, COST)
    assert plain == sum(lens) and cascade < plain
    # Suffix lengths enter both sides alike: a longer suffix changes both costs by the same amount.
    plain2, cascade2 = step_costs(plan, [357, 258, 20, 19], COST)
    assert plain2 - plain == pytest.approx(cascade2 - cascade) == pytest.approx(100)


def test_plan_is_none_when_nothing_pays_or_groups_are_too_small():
    tables = [(1, 2, 3, 4, 9), (1, 2, 3, 4, 10)]
    assert plan_cascade(tables, [17, 18], BS, CascadeConfig(cost=COST)) is None
    long_tables = [tuple(range(64)) + (100 + i,) for i in range(3)]
    lens = [257] * 3
    assert plan_cascade(long_tables, lens, BS, CascadeConfig(cost=COST)) is not None
    assert plan_cascade(long_tables, lens, BS, CascadeConfig(min_group_size=4, cost=COST)) is None


def test_cascade_config_of_each_mode_and_dtype():
    assert cascade_config("off") is None
    auto = cascade_config("auto", 6, "float32")
    assert auto == CascadeConfig(min_shared_blocks=6, cost=COST_MODELS["float32"])
    assert cascade_config("auto").cost == COST_MODELS["bfloat16"]
    with pytest.raises(ValueError, match="cascade must be one of"):
        cascade_config("on")


def test_calibrated_models_pay_for_the_issue_shape_not_for_a_pair_of_short_prompts():
    big = CascadeGroup(tuple(range(64)), 2048 // 16)  # 64 requests sharing 2k tokens
    pair = CascadeGroup((0, 1), 4)  # two requests sharing 64 tokens
    for cost in COST_MODELS.values():
        assert group_saving(big, 16, cost) > 0
        assert group_saving(pair, 16, cost) < 0


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        CascadeConfig(min_shared_blocks=0)
    with pytest.raises(ValueError):
        CascadeConfig(min_group_size=1)


def test_module_imports_without_torch():
    code = "import sys\nsys.modules['torch'] = None\nimport baton.common.engine.cascade_plan\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
