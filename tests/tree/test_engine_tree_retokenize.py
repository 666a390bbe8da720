"""Trees across vocabularies bridged by text (``tree.retokenize``, on by default for a draft model with
``use_heterogeneous_vocab``) through a real vLLM engine on a tiny float32 byte-level pair: the draft is the
target's weights over a vocabulary without the target's last 30 BPE merges. Greedy output equals output
without speculation while the outputs hold tokens the draft lacks (it reads them through their draft
encoding). That such tokens get proposed and accepted needs a draft that knows text, so the slow real-pair
test checks it (``tests/tree/test_real_pair_tree.py``). Structured-output requests among them verify only nodes
their grammar allows (retokenized trees are pruned at hand-over; their draft logits cannot be masked)."""

from __future__ import annotations

import pytest

from tests.request_batches import MIXED, SINGLE, generate
from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.instruments.worker_extension import read_tree_stats

DRAFT_VOCAB = 290  # tiny_models.build_byte_level_pair: target ids from here on are missing from the draft
TREES = {
    "static": {"choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "retokenize": True},
    "dynamic": {"top_k": 3, "depth": 3, "budget": 8},  # bridged by default
}


def _spec(draft) -> dict:
    return {"method": "draft_model", "model": str(draft), "use_heterogeneous_vocab": True}


def bridged_by_text(worker) -> bool:
    """Worker-side reader for ``LLM.collective_rpc``: whether the drafter re-encodes its trees by text."""
    return worker.model_runner.drafter.tree_drafting.retokenizer is not None


@pytest.fixture(scope="module")
def vanilla(llm_pool, byte_level_pair):
    llm = llm_pool.get(byte_level_pair[0])
    return generate(llm, SINGLE), generate(llm, MIXED)


@pytest.mark.parametrize(("shape", "n"), [pytest.param("static", 1, id="static-N1"),
                                          pytest.param("dynamic", 2, id="dynamic-N2", marks=pytest.mark.slow)])
def test_retokenized_trees_equal_vanilla(llm_pool, byte_level_pair, vanilla, shape, n):
    target, draft = byte_level_pair
    single, mixed = vanilla
    llm = llm_pool.get(target, speculative_config=_spec(draft),
                       additional_config={"easyspec": {"tree": TREES[shape],
                                                       "layer_parallel_size": n}})
    assert llm.collective_rpc(bridged_by_text) == [True]
    assert generate(llm, SINGLE) == single
    assert generate(llm, MIXED) == mixed
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["steps"] > 0 and stats["chain_fallbacks"] == 0
    assert 0 < stats["accepted"] < stats["nodes_verified"]
    outputs = [token for tokens, _, _ in single + mixed for token in tokens]
    assert any(token >= DRAFT_VOCAB for token in outputs)  # the draft's context held tokens it lacks


def test_retokenize_needs_a_pair_across_vocabularies(llm_pool, byte_level_pair):
    target, draft = byte_level_pair
    with pytest.raises(EasySpecConfigError, match="retokenize.*use_heterogeneous_vocab.*remove retokenize"):
        llm_pool.get(target, speculative_config={"method": "draft_model", "model": str(target)},
                     additional_config={"easyspec": {"tree": TREES["static"]}})


CODE_LINES = r"((def|for|if|class|return) [a-z]+[(): ]*\n)+"  # a grammar over the pair's byte-level text


def test_retokenized_trees_of_structured_requests_hold_only_nodes_the_grammar_allows(llm_pool, byte_level_pair,
                                                                                     tmp_path):
    from vllm.sampling_params import StructuredOutputsParams

    from tests.option_requests import assert_same_outputs, generate_outputs
    from tests.tree.test_engine_draft_grammar import forbidden_nodes, traced_nodes

    target, draft = byte_level_pair
    structured = {"structured_outputs": StructuredOutputsParams(regex=CODE_LINES)}
    requests = [(prompt, options | (structured if index % 2 == 0 else {})) for index, (prompt, options) in
                enumerate(MIXED)]
    expected = generate_outputs(llm_pool.get(target), requests)
    llm = llm_pool.get(target, speculative_config=_spec(draft), additional_config={"easyspec": {"tree": TREES["static"]}})
    generate_outputs(llm, requests)  # the worker compiles the grammars: the traced run prunes from its first step
    outputs, trees = traced_nodes(llm, requests, tmp_path / "trace.jsonl")
    assert_same_outputs(outputs, expected)
    checked, forbidden = forbidden_nodes(trees, {index: {"regex": CODE_LINES} for index in range(0, 8, 2)},
                                         target / "tokenizer")
    assert checked > 0 and forbidden == 0, (checked, forbidden)  # unpruned, 374 of 379 nodes were forbidden
