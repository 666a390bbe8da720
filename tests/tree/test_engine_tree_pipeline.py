"""Token trees at pipeline-parallel size 2 (issue 70, item 3): two stages, one core each, vLLM's multiprocessing
executor. The last stage drafts and samples; the earlier stage verifies each tree over its own layers from the parents
the scheduler sends it and commits the accepted branch the next step brings (integration/pipeline_trees.py). Greedy
output equals vanilla's at one stage (vanilla PP 2 equals PP 1: tests/test_engine_pipeline.py), both stages verified
the same trees, and branch nodes off the top path were accepted."""

from __future__ import annotations

import pytest

from tests.request_batches import MIXED, SINGLE, generate
from vllm_easyspec.instruments.worker_extension import read_tree_stats

PP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def pp2_tree_engine(llm_pool, monkeypatch, target, speculative_config: dict, tree: dict):
    for key, value in PP2_ENV.items():
        monkeypatch.setenv(key, value)
    return llm_pool.get(target, speculative_config=speculative_config, additional_config={"easyspec": {"tree": tree}},
                        pipeline_parallel_size=2, distributed_executor_backend="mp", multiprocess=True)


def assert_both_stages_verified_trees(llm) -> dict:
    first, last = llm.collective_rpc(read_tree_stats)
    assert last["steps"] > 0 and last["off_top_path_branches"] > 0, last
    same = ("steps", "tree_requests", "nodes_verified", "path_requests")
    assert {key: first[key] for key in same} == {key: last[key] for key in same}, (first, last)
    return last


def test_draft_model_trees_at_pp2_equal_vanilla(llm_pool, monkeypatch, tree_llama_dir, tiny_llama_draft_dir):
    vanilla = llm_pool.get(tree_llama_dir)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, tree_llama_dir,
                          {"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                          {"top_k": 3, "depth": 3, "budget": 8})
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert_both_stages_verified_trees(llm)


@pytest.mark.slow  # one source per layout in the default suite (the dynamic tree above)
def test_trees_merged_with_prompt_lookup_at_pp2_equal_vanilla(llm_pool, monkeypatch, tree_llama_dir,
                                                               tiny_llama_draft_dir):
    vanilla = llm_pool.get(tree_llama_dir)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, tree_llama_dir,
                          {"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                          {"top_k": 2, "depth": 2, "budget": 4,
                           "sources": {"prompt_lookup": {"nodes": 4, "min_match": 1}}})
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert assert_both_stages_verified_trees(llm)["source_nodes_accepted"] > 0


@pytest.mark.slow
def test_trees_bridged_by_text_at_pp2_equal_vanilla(llm_pool, monkeypatch, byte_level_pair):
    target, draft = byte_level_pair
    vanilla = llm_pool.get(target)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, target,
                          {"method": "draft_model", "model": str(draft), "use_heterogeneous_vocab": True},
                          {"choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "retokenize": True})
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert_both_stages_verified_trees(llm)
