"""Token trees at tensor-parallel size 2 for every draft-model source (issue 70, item 5): a dynamic tree, a tree
merged with prompt lookup, a tree bridged by text across vocabularies, and ``tree.auto``; the EAGLE head's is in
``tests/eagle/test_eagle_tree.py``. Greedy output at TP 2 equals vanilla's at TP 1, both ranks verified the same
trees. Each engine runs its two ranks in processes of their own (one core each), so these are ``slow``; ``tree.auto``
takes rank 0's decisions at every rank (engine-free here)."""

from __future__ import annotations

import pytest

from tests.request_batches import MIXED, SINGLE, generate
from vllm_easyspec.instruments.worker_extension import read_tree_stats

TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
SOURCES = {
    "dynamic": {"top_k": 3, "depth": 3, "budget": 8},
    "prompt_lookup": {"top_k": 2, "depth": 2, "budget": 4, "sources": {"prompt_lookup": {"nodes": 4, "min_match": 1}}},
    "auto": {"top_k": 2, "depth": 3, "budget": 6, "auto": True},
}


def two_rank_tree_engine(llm_pool, monkeypatch, target, speculative_config: dict, tree: dict, **layout):
    """A tree engine whose two ranks (``layout``: tensor_parallel_size or pipeline_parallel_size 2) run in processes
    of their own, one core each."""
    for key, value in TP2_ENV.items():
        monkeypatch.setenv(key, value)
    return llm_pool.get(target, speculative_config=speculative_config, additional_config={"easyspec": {"tree": tree}},
                        distributed_executor_backend="mp", multiprocess=True, **layout)


def tp2_tree_engine(llm_pool, monkeypatch, target, speculative_config: dict, tree: dict):
    return two_rank_tree_engine(llm_pool, monkeypatch, target, speculative_config, tree, tensor_parallel_size=2)


def assert_both_ranks_verified_trees(llm) -> None:
    ranks = llm.collective_rpc(read_tree_stats)
    assert len(ranks) == 2 and ranks[0] == ranks[1], ranks
    assert ranks[0]["steps"] > 0 and ranks[0]["accepted"] > 0, ranks[0]


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SOURCES))
def test_draft_model_trees_at_tp2_equal_vanilla(llm_pool, monkeypatch, tree_llama_dir, tiny_llama_draft_dir, source):
    vanilla = llm_pool.get(tree_llama_dir)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = tp2_tree_engine(llm_pool, monkeypatch, tree_llama_dir,
                          {"method": "draft_model", "model": str(tiny_llama_draft_dir)}, SOURCES[source])
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert_both_ranks_verified_trees(llm)


@pytest.mark.slow
def test_trees_bridged_by_text_at_tp2_equal_vanilla(llm_pool, monkeypatch, byte_level_pair):
    target, draft = byte_level_pair
    vanilla = llm_pool.get(target)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = tp2_tree_engine(llm_pool, monkeypatch, target,
                          {"method": "draft_model", "model": str(draft), "use_heterogeneous_vocab": True},
                          {"choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "retokenize": True})
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert_both_ranks_verified_trees(llm)


def test_auto_takes_rank_zeros_decisions_at_every_rank():
    """Engine-free: the policy's depth plans and node choices are what ``agree`` makes of its controller's (at TP 2,
    rank 0's broadcast: before, each rank planned from its own timings, drafted a different number of levels, and
    the engine hung in a collective)."""
    import types

    from vllm_easyspec.integration.node_policy import AutoBudget
    from vllm_easyspec.tree.config import TreeConfig

    seen = []
    controller = types.SimpleNamespace(plan_depth=lambda *args: 3, choose=lambda offered, batch: ["rank 1's"])
    clock = types.SimpleNamespace(poll=lambda: None)
    budget = AutoBudget(TreeConfig(top_k=2, depth=3, budget=6, auto={}), controller, clock,
                        agree=lambda decision: seen.append(decision) or "rank 0's")
    assert budget.plan_depth(["a"], 4, {}, None) == "rank 0's"
    assert seen == [3]
