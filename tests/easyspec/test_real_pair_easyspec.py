"""Slow: the default real pair (SmolLM2-135M-Instruct drafting for Qwen2.5-Coder-0.5B-Instruct across
vocabularies) keeps greedy float32 output identical to no speculation with fuzzy drafting, fused on one
process and tensor_parallel on 2 CPU ranks. Run with ``pytest -m slow tests/easyspec``."""

from __future__ import annotations

import pytest

from tests.engine_pool import greedy_tokens
from vllm_easyspec.instruments.worker_extension import read_drafting_stats
from vllm_easyspec.models import prompt_token_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@pytest.fixture(scope="module")
def prompt_ids(real_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_pair[0])
    texts = ["Write a Python function that reverses a string.", "Why is the sky blue? Answer briefly."]
    return [prompt_token_ids(tokenizer, text) for text in texts]


def _greedy(llm, prompts) -> list[list[int]]:
    return greedy_tokens(llm, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def vanilla_tokens(llm_pool, real_pair, prompt_ids):
    return _greedy(llm_pool.get(real_pair[0], max_model_len=1024), prompt_ids)


@pytest.mark.parametrize(("mode", "tp"), [("fused", 1), ("tensor_parallel", 2)])
def test_real_pair_greedy_equals_vanilla(llm_pool, monkeypatch, real_pair, prompt_ids, vanilla_tokens, mode, tp):
    if tp == 2:
        for key, value in TP2_ENV.items():
            monkeypatch.setenv(key, value)
    target, draft = real_pair
    llm = llm_pool.get(
        target,
        max_model_len=1024,
        speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 4,
            "use_heterogeneous_vocab": True,
        }  # fmt: skip
        | ({"draft_tensor_parallel_size": 1} if tp == 2 else {}),  # SmolLM2's 9 heads do not shard over 2
        additional_config={"easyspec": {"layer_parallel_size": 2, "mode": mode}},
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
    )
    assert _greedy(llm, prompt_ids) == vanilla_tokens
    stats = llm.collective_rpc(read_drafting_stats)[0]
    assert stats["mode"] == mode and stats["fuzzy_forwards"] > 0
