"""The config's choice fields name exactly what the library implements: a value the config accepts always has
an implementation, and an implementation is always reachable from the config (one list each, kept equal here)."""

from __future__ import annotations

from typing import get_args

from lora_rl_core.algorithm import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, OFF_POLICY_MODES
from lora_rl_core.config import AlgorithmConfig, OffPolicyCorrectionConfig


def choices(field: str) -> set[str]:
    return set(get_args(AlgorithmConfig.model_fields[field].annotation))


def test_advantage_estimators_match_the_config():
    assert choices("advantage") == set(ADVANTAGE_ESTIMATORS)


def test_loss_aggregations_match_the_config():
    assert choices("loss_aggregation") == set(LOSS_AGGREGATIONS)


def test_off_policy_corrections_match_the_config():
    kinds, _, _ = get_args(OffPolicyCorrectionConfig)  # the union of the kinds, its discriminator, its input rule
    tags = {tag for kind in get_args(kinds) for tag in get_args(kind.model_fields["type"].annotation)}
    # auto: picked; none: off; m2po: a mask over the whole batch, made by the trainer (`m2po_keep_mask`)
    assert tags - {"auto", "none", "m2po"} == set(OFF_POLICY_MODES)
