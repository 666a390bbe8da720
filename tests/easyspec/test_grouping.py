"""Layer grouping (issue behaviour 1-2): the paper's default grouping and the validation errors."""

from __future__ import annotations

import pytest

from vllm_easyspec.easyspec.config import EasySpecConfig, EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.easyspec.layer_grouping import default_layer_groups, resolve_layer_groups


def _spans(groups):
    return [(g[0], g[-1]) for g in groups]


def test_llama3_8b_n4_is_the_papers_example():
    grouping = resolve_layer_groups(EasySpecConfig(layer_parallel_size=4), num_layers=32)
    assert _spans(grouping.fuzzy_groups) == [
        (1, 3), (4, 7), (8, 11), (12, 15), (16, 19), (20, 23), (24, 27), (28, 30)
    ]
    assert grouping.groups == grouping.fuzzy_groups
    assert grouping.mode == "fused"


@pytest.mark.parametrize(
    ("num_layers", "n"), [(L, n) for L in (3, 4, 8, 24, 30, 32) for n in (1, 2, 3, 4) if n <= max(L - 2, 1)]
)
def test_default_grouping_rule(num_layers, n):
    groups = default_layer_groups(num_layers, n)
    flat = [layer for group in groups for layer in group]
    assert flat == list(range(1, num_layers - 1))  # every middle layer once, in order; 0 and L-1 excluded
    for group in groups:
        assert {layer // n for layer in group} == {group[0] // n}  # layer i is in block floor(i / N)
        assert len(group) <= n


def test_explicit_groups_override_and_fill_singletons():
    config = EasySpecConfig(layer_groups=((2, 3), (5, 6, 7)))
    grouping = resolve_layer_groups(config, num_layers=10)
    assert grouping.groups == ((1,), (2, 3), (4,), (5, 6, 7), (8,))
    assert grouping.fuzzy_groups == ((2, 3), (5, 6, 7))


@pytest.mark.parametrize(
    ("config", "num_layers", "tp", "fragments"),
    [
        (EasySpecConfig(layer_groups=((0, 1),)), 8, 1, ["layer_groups[0]", "first", "1..6"]),
        (EasySpecConfig(layer_groups=((6, 7),)), 8, 1, ["layer_groups[0]", "last", "1..6"]),
        (EasySpecConfig(layer_groups=((1, 2), (2, 3))), 8, 1, ["overlap", "layer 2"]),
        (EasySpecConfig(layer_parallel_size=9), 8, 1, ["layer_parallel_size", "from 1 to 6"]),
        (
            EasySpecConfig(layer_parallel_size=3, mode="tensor_parallel"),
            8,
            2,
            ["tensor_parallel_size >= 3", "mode 'fused'"],
        ),
    ],
)
def test_validation_errors_name_field_and_fix(config, num_layers, tp, fragments):
    with pytest.raises(EasySpecConfigError) as info:
        resolve_layer_groups(config, num_layers=num_layers, tensor_parallel_size=tp)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_unknown_key_is_rejected_with_the_allowed_options():
    with pytest.raises(EasySpecConfigError, match=r"unknown option easyspec\.group_size.*layer_parallel_size"):
        parse_easyspec_config({"easyspec": {"group_size": 2}})


def test_auto_mode_picks_tensor_parallel_when_ranks_cover_the_groups():
    assert resolve_layer_groups(EasySpecConfig(layer_parallel_size=2), 8, tensor_parallel_size=2).mode == (
        "tensor_parallel"
    )
    assert resolve_layer_groups(EasySpecConfig(layer_parallel_size=3), 8, tensor_parallel_size=2).mode == "fused"
