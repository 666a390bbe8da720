"""Requests with sampling options are served with EAGLE trees, losslessly (issue 62), on the tiny float32 Llama with
a trained EAGLE-3 head: greedy output in a mixed batch of 8 (options on four requests, or six different ones at
once) equals vanilla's with the logprobs vanilla returns, and the requests with options, run alone, get drafts
accepted with none served without speculation. The default suite runs every option at once, with a fixed tree and
with ``tree.auto``; each option on its own is marked slow (the draft-model tree covers each in the default suite,
tests/tree/test_engine_tree_options.py)."""

from __future__ import annotations

import pytest
from controller_costs import steps_cost_nothing
from option_requests import (
    OPTION_NAMES,
    assert_same_outputs,
    generate_outputs,
    only_options,
    speculation_of,
    vanilla_outputs,
    with_every_option,
    with_option,
)

DYNAMIC = {"top_k": 3, "depth": 4, "budget": 10}
AUTO = DYNAMIC | {"sources": {"prompt_lookup": {"nodes": 3}}, "auto": True}


def _check(llm_pool, target, head, tree: dict, name: str, requests) -> None:
    expected = vanilla_outputs(llm_pool, target, name, requests)
    llm = llm_pool.get(target, speculative_config={"method": "eagle3", "model": str(head)},
                       additional_config={"easyspec": {"tree": tree}})
    if tree is AUTO:
        llm.collective_rpc(steps_cost_nothing)  # nodes must be verified to be checked, whatever the timings
    assert_same_outputs(generate_outputs(llm, requests), expected)
    gained = speculation_of(llm, only_options(requests))
    assert gained["requests_without_speculation"] == 0 and gained["accepted"] > 0, gained


@pytest.mark.parametrize("tree", ["dynamic", "auto"])
def test_every_option_at_once_with_eagle_trees_equals_vanilla(llm_pool, tiny_llama_dir, trained_tiny_heads, tree):
    _check(llm_pool, tiny_llama_dir, trained_tiny_heads("eagle3"), AUTO if tree == "auto" else DYNAMIC, "every",
           with_every_option())


@pytest.mark.slow
@pytest.mark.parametrize("option", OPTION_NAMES)
def test_each_option_with_eagle_trees_equals_vanilla(llm_pool, tiny_llama_dir, trained_tiny_heads, option):
    for tree in (DYNAMIC, AUTO):
        _check(llm_pool, tiny_llama_dir, trained_tiny_heads("eagle3"), tree, option, with_option(option))
