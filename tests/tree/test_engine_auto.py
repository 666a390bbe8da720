"""``easyspec.tree.auto`` through a real vLLM engine on tiny float32 models: the controller measures the step's
cost at start-up, chooses every request's nodes every step, learns from verification, and speculation stays
lossless: greedy output equals output without speculation (single request and a mixed batch of 8), the
engine-level chi-square test passes at T > 0, and still rejects a biased verifier with the controller on.
(The EAGLE proposer's cases are in tests/eagle/test_eagle_tree.py.)"""

from __future__ import annotations

import pytest

from tests.controller_costs import drafting_costs_nothing, only_prompt_lookup_pays, steps_cost_nothing
from tests.distribution import (
    ALPHA,
    install_biased_rejection_sampler,
    install_biased_tree_sampler,
    restore_rejection_sampler,
    restore_tree_sampler,
    run_distribution_test,
)
from tests.request_batches import MIXED, SINGLE, generate
from vllm_easyspec.instruments.worker_extension import read_controller_stats, read_tree_stats

TREES = {
    "static-lookup": {"choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]], "sources": {"prompt_lookup": {"nodes": 3}}},
    "dynamic": {"top_k": 2, "depth": 3, "budget": 6},
    "iid": {"choices": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], "draw": "sample"},
    # one matching token suffices: an engine of its own, whose pinned costs would change other tests' choices
    "static-unigram-lookup": {"choices": [[0], [1], [0, 0]],
                              "sources": {"prompt_lookup": {"nodes": 3, "min_match": 1, "max_match": 2}}},
}


def _auto_engine(llm_pool, target, draft, shape: str, auto: dict | bool = True, **options):
    return llm_pool.get(target, speculative_config={"method": "draft_model", "model": str(draft)},
                        additional_config={"easyspec": {"tree": TREES[shape] | {"auto": auto}} | options})


@pytest.mark.parametrize(("shape", "n"), [("static-lookup", 1), ("dynamic", 2)])
def test_auto_trees_equal_vanilla(llm_pool, tree_llama_dir, tiny_llama_draft_dir, shape, n):
    vanilla = llm_pool.get(tree_llama_dir)
    single, mixed = generate(vanilla, SINGLE), generate(vanilla, MIXED)
    llm = _auto_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, shape, layer_parallel_size=n)
    llm.collective_rpc(drafting_costs_nothing)  # nodes must be verified to be checked, whatever the timings
    assert generate(llm, SINGLE) == single
    assert generate(llm, MIXED) == mixed
    stats = llm.collective_rpc(read_controller_stats)[0]
    tree = llm.collective_rpc(read_tree_stats)[0]
    # the controller chose nodes every drafting step, verification taught it, and its cost model was measured
    # at start-up (rows 1, 2, 3, ...) and kept current by the engine's steps
    assert stats["steps"] > 0 and stats["nodes_chosen"] > 0 and stats["realised_accepted"] > 0
    assert stats["predicted_accepted"] > 0 and sum(stats["nodes_per_request"].values()) == stats["requests"]
    assert stats["verify_curve"]["rows"][:2] == [1, 2] and stats["cost_observations"]["verify"] > 0
    assert all(t > 0 for t in stats["verify_curve"]["seconds"])
    assert stats["cost_observed_seconds"]["verify"] > 0 and stats["cost_predicted_seconds"]["verify"] > 0
    assert stats["calibration_conditional"] and stats["calibration_path"]
    assert tree["accepted"] > 0 and tree["chain_fallbacks"] == 0
    # vLLM's metrics show the same controller (the worker's snapshot, read by the front end's collector)
    seen = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:easyspec_auto_")}
    assert seen["vllm:easyspec_auto_steps"].value == stats["steps"]
    assert seen["vllm:easyspec_auto_nodes_per_request"].count == stats["requests"]
    assert seen["vllm:easyspec_auto_realised_accepted"].value == stats["realised_accepted"]


@pytest.mark.parametrize("shape", [pytest.param("dynamic", marks=pytest.mark.slow), "iid"])
def test_distribution_with_auto_trees_matches_target(llm_pool, tree_llama_dir, tiny_llama_draft_dir, shape):
    llm = _auto_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, shape)
    llm.collective_rpc(steps_cost_nothing)
    before = llm.collective_rpc(read_tree_stats)[0]
    result = run_distribution_test(llm, tree_llama_dir, temperature=1.0)
    tree_requests = llm.collective_rpc(read_tree_stats)[0]["tree_requests"] - before["tree_requests"]
    assert tree_requests >= 0.9 * result.num_samples  # nearly every sample's second token came from a tree step
    assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"


def test_distribution_test_rejects_a_biased_verifier_under_auto(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    llm = _auto_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, "iid", auto={"max_nodes": 6})
    llm.collective_rpc(steps_cost_nothing)
    llm.collective_rpc(install_biased_tree_sampler)
    try:
        result = run_distribution_test(llm, tree_llama_dir, temperature=1.0)
    finally:
        llm.collective_rpc(restore_tree_sampler)
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["tree_requests"] >= 0.9 * result.num_samples  # the biased sampler had trees to verify
    assert result.p_value < ALPHA, f"biased verifier not detected: chi2={result.statistic:.1f} p={result.p_value:.2e}"


# every token of the tiny vocabulary but the special ones, so the first sampled token is nearly always in the
# prompt and a unigram prompt lookup offers the tokens that followed it
LOOKUP_PROMPT = [1, *range(3, 64)]


def test_steps_that_draft_nothing_verify_prompt_lookup_paths_alone_and_equal_vanilla(
        llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    vanilla = llm_pool.get(tree_llama_dir)
    single, mixed = generate(vanilla, SINGLE), generate(vanilla, MIXED)
    llm = _auto_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, "static-unigram-lookup")
    llm.collective_rpc(only_prompt_lookup_pays)
    before = llm.collective_rpc(read_controller_stats)[0]
    assert generate(llm, SINGLE) == single
    assert generate(llm, MIXED) == mixed
    stats = llm.collective_rpc(read_controller_stats)[0]
    steps = {key: stats[key] - before[key] for key in ("steps", "lookup_only_steps", "realised_accepted")}
    # no step drafted; lookup paths were verified alone, and some of their nodes were accepted
    assert 0 < steps["lookup_only_steps"] <= steps["steps"] and steps["realised_accepted"] > 0
    grown = {int(depth) for depth, count in stats["depth_per_step"].items()
             if count > before["depth_per_step"].get(depth, 0)}
    assert grown == {0}


@pytest.mark.parametrize("biased", [False, True])
def test_distribution_with_prompt_lookup_paths_alone_matches_target(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                    biased):
    llm = _auto_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, "static-unigram-lookup")
    llm.collective_rpc(only_prompt_lookup_pays)
    before = llm.collective_rpc(read_controller_stats)[0]
    if biased:  # the paths verify as vLLM verifies a chain: a biased chain verifier must be caught
        llm.collective_rpc(install_biased_rejection_sampler)
    try:
        result = run_distribution_test(llm, tree_llama_dir, temperature=1.0, prompt=LOOKUP_PROMPT)
    finally:
        if biased:
            llm.collective_rpc(restore_rejection_sampler)
    stats = llm.collective_rpc(read_controller_stats)[0]
    assert stats["nodes_chosen"] - before["nodes_chosen"] >= 0.9 * result.num_samples  # a path nearly every time
    if biased:
        assert result.p_value < ALPHA, f"biased verifier not detected: chi2={result.statistic:.1f}"
    else:
        assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"
