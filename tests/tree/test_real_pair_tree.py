"""Slow: token trees on the default real pair (SmolLM2-135M-Instruct drafting for Qwen2.5-Coder-0.5B-Instruct
across vocabularies): greedy float32 output equals no speculation, static and dynamic trees, exact and
fuzzy drafting, at batch 1 and in a batch of 4; the committed EAGLE-3 head drafting trees for the default
target; and Gemma-3-270M's sliding windows with a text-bridged draft. Run with
``pytest -m slow tests/tree/test_real_pair_tree.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_pool import greedy_tokens
from vllm_easyspec.instruments.worker_extension import read_tree_stats
from vllm_easyspec.models import prompt_token_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
TEXTS = [
    "Write a Python function that reverses a string.",
    "Why is the sky blue? Answer briefly.",
    "def merge_sorted(a, b):",
    "Explain recursion to a ten-year-old in two sentences.",
]


@pytest.fixture(scope="module")
def prompt_ids(real_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_pair[0])
    return [prompt_token_ids(tokenizer, text) for text in TEXTS]


@pytest.fixture(scope="module")
def vanilla_tokens(llm_pool, real_pair, prompt_ids):
    return greedy_tokens(llm_pool.get(real_pair[0], max_model_len=1024), prompt_ids, MAX_TOKENS)


@pytest.mark.parametrize(
    ("tree", "n"),
    [({"choices": [[0], [1], [2], [3], [0, 0], [1, 0], [0, 0, 0]], "retokenize": False}, 1),
     ({"top_k": 4, "depth": 3, "budget": 10, "retokenize": False}, 2),
     ({"top_k": 4, "depth": 3, "budget": 10}, 1)],  # bridged by text: the default across vocabularies
    ids=["static-N1", "dynamic-N2", "retokenized-N1"],
)
def test_real_pair_trees_equal_vanilla(llm_pool, real_pair, prompt_ids, vanilla_tokens, tree, n):
    target, draft = real_pair
    llm = llm_pool.get(
        target,
        max_model_len=1024,
        speculative_config={"method": "draft_model", "model": str(draft), "use_heterogeneous_vocab": True},
        additional_config={"easyspec": {"tree": tree, "layer_parallel_size": n}},
    )
    assert greedy_tokens(llm, prompt_ids[:1], MAX_TOKENS) == vanilla_tokens[:1]
    assert greedy_tokens(llm, prompt_ids, MAX_TOKENS) == vanilla_tokens
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["steps"] > 0 and 0 < stats["accepted"] < stats["nodes_verified"]
    if tree.get("retokenize", True):  # tokens SmolLM2's vocabulary lacks (Qwen's "):\n") were proposed and accepted
        assert stats["accepted_outside_shared_vocab"] > 0
    else:
        assert stats["accepted_outside_shared_vocab"] == 0


HEAD3 = Path(__file__).resolve().parents[2] / "heads" / "qwen2.5-coder-0.5b-instruct-eagle3"


@pytest.fixture(scope="module")
def heldout_ids(real_pair):
    from transformers import AutoTokenizer

    from vllm_easyspec_train.prompts import HELDOUT_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(real_pair[0])
    return [prompt_token_ids(tokenizer, text) for text in HELDOUT_PROMPTS[:8]]


def test_committed_eagle3_head_trees_equal_vanilla(llm_pool, real_pair, heldout_ids):
    """The plugin's EAGLE proposer with the committed head drafts EAGLE-2 trees (merged with prompt lookup) for
    the default target: float32 greedy output equals no speculation at batch 1 and for 8 held-out prompts."""
    target = real_pair[0]
    vanilla = greedy_tokens(llm_pool.get(target, max_model_len=1024), heldout_ids, MAX_TOKENS)
    tree = {"top_k": 2, "depth": 3, "budget": 4, "sources": {"prompt_lookup": {"nodes": 4}}}
    llm = llm_pool.get(target, max_model_len=1024, speculative_config={"method": "eagle3", "model": str(HEAD3)},
                       additional_config={"easyspec": {"tree": tree}})
    assert greedy_tokens(llm, heldout_ids[:1], MAX_TOKENS) == vanilla[:1]
    assert greedy_tokens(llm, heldout_ids, MAX_TOKENS) == vanilla
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["steps"] > 0 and 0 < stats["accepted"] < stats["nodes_verified"]


def test_gemma3_270m_trees_equal_vanilla_past_its_sliding_window(llm_pool):
    """Gemma-3-270M (15 of 18 layers in 512-token sliding windows) served with a tree drafted by SmolLM2-135M-Instruct
    and bridged by text, merged with prompt lookup: float32 greedy output equals vanilla's on prompts of 600+ tokens
    whose outputs run past the window. vLLM 0.32 needs a draft's layers in one KV cache group, and SmolLM2's 30
    layers fit beside Gemma 3's sliding and full groups only with the hybrid KV cache manager off (one group, the
    windows applied per layer), for vLLM's draft_model chain as for trees."""
    from transformers import AutoTokenizer

    from vllm_easyspec.models import fetch_model

    target, draft = fetch_model("gemma3-270m"), fetch_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(target)
    sources = [Path(__file__).resolve().parents[2] / "vllm_easyspec" / "tree" / name
               for name in ("building.py", "sampling.py")]
    prompts = [prompt_token_ids(tokenizer, path.read_text()[:2600]) for path in sources]
    assert all(len(p) > 600 for p in prompts)
    engine = dict(max_model_len=2048, block_size=32, disable_hybrid_kv_cache_manager=True)
    vanilla = greedy_tokens(llm_pool.get(target, **engine), prompts, 48)
    tree = {"top_k": 2, "depth": 3, "budget": 6, "retokenize": True, "sources": {"prompt_lookup": {"nodes": 4}}}
    llm = llm_pool.get(target, **engine, additional_config={"easyspec": {"tree": tree}},
                       speculative_config={"method": "draft_model", "model": str(draft), "use_heterogeneous_vocab": True})
    assert greedy_tokens(llm, prompts, 48) == vanilla
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["tree_requests"] - stats["path_requests"] > 0 and stats["accepted"] > 0
