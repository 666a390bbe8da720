"""At temperature > 0 token trees keep the target's output distribution (engine-level chi-square test from
tests/distribution.py), in both draw modes; the same test rejects a deliberately biased tree verifier.

The second generated token of every sample comes from a tree step: the drafter proposes a tree right after
the prefill, so a sampler that is not lossless shifts the law of the token pair.
"""

from __future__ import annotations

import pytest

from tests.distribution import ALPHA, install_biased_tree_sampler, restore_tree_sampler, run_distribution_test
from vllm_easyspec.instruments.worker_extension import read_tree_stats

DRAW_MODES = {
    # static tree, children drawn i.i.d. from the draft: SpecInfer multi-step speculative sampling
    "iid": {"choices": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], "draw": "sample"},
    # EAGLE-2 dynamic tree, top-k children: recursive rejection sampling with one-hot q
    "topk": {"top_k": 3, "depth": 3, "budget": 6},
}


def _tree_engine(llm_pool, target, draft, mode: str):
    return llm_pool.get(
        target,
        speculative_config={"method": "draft_model", "model": str(draft)},
        additional_config={"easyspec": {"tree": DRAW_MODES[mode]}},
    )


# top-k children in the default suite: the EAGLE tree distribution tests (tests/eagle/test_eagle_tree.py)
MODES = [pytest.param(mode, marks=pytest.mark.slow) if mode == "topk" else mode for mode in DRAW_MODES]


@pytest.mark.parametrize("mode", MODES)
def test_distribution_with_trees_matches_target(llm_pool, tree_llama_dir, tiny_llama_draft_dir, mode):
    llm = _tree_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, mode)
    result = run_distribution_test(llm, tree_llama_dir, temperature=1.0)
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["tree_requests"] >= result.num_samples and 0 < stats["accepted"] < stats["nodes_verified"]
    assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_distribution_test_rejects_a_biased_tree_verifier(llm_pool, tree_llama_dir, tiny_llama_draft_dir, mode):
    llm = _tree_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, mode)
    llm.collective_rpc(install_biased_tree_sampler)
    try:
        result = run_distribution_test(llm, tree_llama_dir, temperature=1.0)
    finally:
        llm.collective_rpc(restore_tree_sampler)
    assert result.p_value < ALPHA, f"biased verifier not detected: chi2={result.statistic:.1f} p={result.p_value:.2e}"


def test_distribution_with_retokenized_trees_matches_target(llm_pool, byte_level_pair):
    """Trees across vocabularies re-encoded by text (``tree.retokenize``): candidates that are a function of the
    drafted tree verify as top-k children, so the target's law holds (the biased case above covers top-k)."""
    target, draft = byte_level_pair
    llm = llm_pool.get(
        target,
        speculative_config={"method": "draft_model", "model": str(draft), "use_heterogeneous_vocab": True},
        additional_config={"easyspec": {"tree": DRAW_MODES["topk"] | {"retokenize": True}}},
    )
    result = run_distribution_test(llm, target, temperature=1.0)
    stats = llm.collective_rpc(read_tree_stats)[0]
    # a drafted tree whose text is only part of a UTF-8 character re-encodes to no nodes: that step has none
    assert stats["tree_requests"] >= 0.9 * result.num_samples and 0 < stats["accepted"] < stats["nodes_verified"]
    assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"
