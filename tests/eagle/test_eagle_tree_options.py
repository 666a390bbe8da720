"""Requests with sampling options are served with EAGLE trees, losslessly (issue 62), on the tiny float32 Llama with
a trained EAGLE-3 head: greedy output in a mixed batch of 8 (options on four requests, or six different ones at
once) equals vanilla's with the logprobs vanilla returns, and the requests with options, run alone, get drafts
accepted with none served without speculation. The default suite runs every option at once, with a fixed tree and
with ``tree.auto``; each option on its own is marked slow (the draft-model tree covers each in the default suite,
tests/tree/test_engine_tree_options.py), and so is a JSON schema on the default target with the committed head."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.controller_costs import steps_cost_nothing
from tests.option_requests import (
    OPTION_NAMES,
    assert_same_outputs,
    generate_outputs,
    only_options,
    speculation_of,
    vanilla_outputs,
    with_every_option,
    with_option,
)
from vllm_easyspec.instruments.worker_extension import read_tree_stats

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


# a JSON answer the default target can give: the tiny vocabulary has no JSON, so the schema runs on the real models
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"]}
JSON_PROMPTS = ["Describe a programmer named Ada as JSON.", "Give a JSON record of a Python developer.",
                "Return JSON for Linus, 54, who writes C."]


@pytest.mark.slow
def test_a_json_schema_with_eagle_trees_on_the_default_target_equals_vanilla(llm_pool, real_pair):
    """The default target (float32) with the committed EAGLE-3 head and the quick start's tree (its nodes fixed, no
    ``auto``): JSON-schema answers equal vanilla's, and their branching trees are verified with a grammar mask per
    node."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    head = Path(__file__).resolve().parents[2] / "heads" / "qwen2.5-coder-0.5b-instruct-eagle3"
    target = real_pair[0]
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=PERSON))
    expected = [o.outputs[0].text for o in llm_pool.get(target).generate(JSON_PROMPTS, params, use_tqdm=False)]
    tree = {"top_k": 2, "depth": 3, "budget": 4, "sources": {"prompt_lookup": {"nodes": 4}}}
    llm = llm_pool.get(target, speculative_config={"method": "eagle3", "model": str(head)},
                       additional_config={"easyspec": {"tree": tree}})
    before = llm.collective_rpc(read_tree_stats)[0]
    got = [o.outputs[0].text for o in llm.generate(JSON_PROMPTS, params, use_tqdm=False)]
    after = llm.collective_rpc(read_tree_stats)[0]
    assert got == expected and all(text.startswith("{") for text in got)
    gained = {key: after[key] - before[key] for key in after if isinstance(after[key], int)}
    assert gained["requests_without_speculation"] == 0 and gained["accepted"] > 0, gained
    assert gained["path_requests"] < gained["tree_requests"], gained
