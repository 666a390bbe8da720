"""``easyspec.tree.uniform`` through a real vLLM engine on tiny float32 models (issue 61, item 1): every request of
every tree verify step schedules ``1 + N`` tokens (its tree padded with nodes that are never accepted), read from the
step trace, and output stays exact: greedy output equals vanilla's in a mixed batch for a static tree whose size
follows the batch (``budget_by_batch``, chain steps included), a dynamic tree with prompt lookup and ``auto``, and
the engine-level chi-square test passes for i.i.d.-drawn trees cut to a few real nodes and padded. The engine-free
checks, and a sampler that took padding as real nodes failing them, are in tests/tree/test_tree_uniform.py."""

from __future__ import annotations

import json

import pytest

from tests.controller_costs import drafting_costs_nothing
from tests.distribution import ALPHA, run_distribution_test
from tests.request_batches import MIXED, generate
from tests.tree.test_engine_tree import _vanilla
from vllm_easyspec.instruments.step_trace import main as check_trace
from vllm_easyspec.instruments.worker_extension import read_tree_stats

LOOKUP = {"prompt_lookup": {"nodes": 3, "min_match": 1, "max_match": 2}}
UNIFORM_TREES = {
    # batch 4 to 6: 3 real nodes of 8; from 7 on a chain of 2 (vLLM's chain step, not padded)
    "static": {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]],
               "budget_by_batch": {"4": 3, "7": {"chain": 2}}},
    "dynamic-lookup": {"top_k": 3, "depth": 3, "budget": 8, "sources": LOOKUP},  # lookup adds 0 to 3 nodes
    "auto": {"choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]], "sources": LOOKUP, "auto": True},
}


def trace_to(worker, path: str) -> None:
    """Worker-side: trace this runner's tree verify steps to ``path`` (as ``VLLM_EASYSPEC_STEP_TRACE`` does)."""
    worker.model_runner._step_trace = path


# dynamic-lookup in the default suite; the static tree with budget_by_batch (chain steps too) and auto: slow
@pytest.mark.parametrize("shape", [shape if shape == "dynamic-lookup" else pytest.param(shape, marks=pytest.mark.slow)
                                   for shape in UNIFORM_TREES])
def test_uniform_tree_steps_schedule_n_nodes_per_request_and_equal_vanilla(llm_pool, tree_llama_dir,
                                                                           tiny_llama_draft_dir, tmp_path, shape):
    vanilla = _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)
    llm = llm_pool.get(tree_llama_dir, speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": UNIFORM_TREES[shape] | {"uniform": True}}})
    if shape == "auto":
        llm.collective_rpc(drafting_costs_nothing)  # nodes must be verified to be checked, whatever the timings
    trace = tmp_path / "trace.jsonl"
    llm.collective_rpc(trace_to, args=(str(trace),))
    before = llm.collective_rpc(read_tree_stats)[0]
    try:
        assert generate(llm, MIXED) == vanilla
    finally:
        llm.collective_rpc(trace_to, args=(None,))
    stats = llm.collective_rpc(read_tree_stats)[0]
    nodes = llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    requests = [request for step in steps for request in step["requests"]]
    assert len(steps) == stats["steps"] - before["steps"] > 0
    # every request of every tree step verified N nodes; some of them padding, never accepted
    assert all(step["num_draft_tokens"] == [nodes] * len(step["num_draft_tokens"]) for step in steps)
    assert all(len(request["tokens"]) == nodes for request in requests)
    assert any(request["real_nodes"] < nodes for request in requests)
    assert all(column <= request["real_nodes"] for request in requests for column, _, _ in request["accepted"])
    assert stats["padding_nodes"] - before["padding_nodes"] == sum(nodes - r["real_nodes"] for r in requests)
    assert stats["accepted"] > before["accepted"]
    assert check_trace([str(trace)]) == 0  # every greedy step's verdict is its real nodes'
    if shape == "static":
        assert stats["chain_steps"] > before["chain_steps"]  # chain steps keep their own length


@pytest.mark.slow  # 4,000 sampled requests of 7 rows each; the engine-free chi-square is in the default suite
def test_distribution_with_padded_trees_matches_target(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """i.i.d.-drawn trees (SpecInfer's rule, which a padding node taken as a draw would bias) cut to their 3 root
    children and padded to 6 nodes, below the third child: the first two tokens keep the target's law."""
    tree = {"choices": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], "draw": "sample", "budget_by_batch": {"1": 3},
            "uniform": True}
    llm = llm_pool.get(tree_llama_dir, speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": tree}})
    result = run_distribution_test(llm, tree_llama_dir, temperature=1.0)
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["tree_requests"] >= result.num_samples and stats["padding_nodes"] == 3 * stats["tree_requests"]
    assert 0 < stats["accepted"] < stats["nodes_verified"]
    assert result.p_value >= ALPHA, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"
