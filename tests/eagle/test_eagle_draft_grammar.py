"""An EAGLE-3 head with a reduced output vocabulary (48 of the tiny Llama's 64 tokens, ``d2t``) drafts only what a
structured-output request's grammar allows (issue 62): greedy output equals vanilla's and every node verified for
a structured request is valid after the request's output (tests/tree/test_engine_draft_grammar.py has the
checks). Marked slow: training the head takes a while; the draft model's tree runs in the default suite."""

from __future__ import annotations

import pytest
import torch

from tests.option_requests import vanilla_outputs, with_option
from tests.tree.test_engine_draft_grammar import check_chains_follow_grammars, check_drafts_follow_grammars

TREE = {"top_k": 3, "depth": 4, "budget": 10}


@pytest.mark.slow
@pytest.mark.parametrize("steps", ["trees", "chains"])
def test_eagle3_drafts_follow_the_grammar_and_outputs_equal_vanilla(llm_pool, tiny_llama_dir, trained_tiny_heads,
                                                                    tiny_tokenizer_dir, tmp_path, steps):
    requests = with_option("structured_output")
    expected = vanilla_outputs(llm_pool, tiny_llama_dir, "structured_output", requests)
    tree = TREE if steps == "trees" else TREE | {"budget_by_batch": {"3": {"chain": 3}}}
    llm = llm_pool.get(tiny_llama_dir, speculative_config={"method": "eagle3", "model": str(trained_tiny_heads("eagle3"))},
                       additional_config={"easyspec": {"tree": tree}})
    if steps == "trees":
        check_drafts_follow_grammars(llm, requests, expected, tiny_tokenizer_dir, tmp_path / "trace.jsonl")
    else:  # a position where the grammar allows none of the head's 48 tokens cannot be masked
        from safetensors.torch import load_file

        d2t = load_file(str(trained_tiny_heads("eagle3") / "model.safetensors"))["d2t"]
        draftable = set((torch.arange(d2t.shape[0]) + d2t).tolist())
        check_chains_follow_grammars(llm, requests, expected, tiny_tokenizer_dir, draftable)
