"""The drafter proposes only what a structured-output request's grammar allows (issue 62), through a real engine on
the tiny float32 models: with regex, choice and grammar requests beside plain ones, greedy output equals vanilla's,
and every node verified for a structured request (read from the step trace) is valid after the request's output,
where unmasked drafting verified forbidden nodes; so is every chain vLLM's own ``propose`` drafts in a
``budget_by_batch`` chain step (recorded in the worker), where unmasked chains held forbidden tokens. With a
reasoning parser, a structured request verifies trees inside its reasoning section (it got none before), its
drafts follow the grammar after the section, and its output equals vanilla's under the same parser. The default suite runs the draft model's static tree; a dynamic
tree with prompt-lookup nodes under ``tree.auto`` is marked slow (the EAGLE-3 head with a reduced vocabulary:
tests/eagle/test_eagle_draft_grammar.py)."""

from __future__ import annotations

import functools
import json

import pytest

from tests.controller_costs import steps_cost_nothing
from tests.option_requests import (
    GRAMMARS,
    WITH_OPTION,
    assert_same_outputs,
    generate_outputs,
    vanilla_outputs,
    with_option,
)

STATIC = {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}  # test_engine_tree_options'
AUTO = {"top_k": 3, "depth": 3, "budget": 8, "sources": {"prompt_lookup": {"nodes": 3}}, "auto": True}
CHAINS = STATIC | {"budget_by_batch": {"3": {"chain": 3}}}  # from 3 running requests on, vLLM's chains of 3


def _trace_to(worker, path: str | None) -> None:
    worker.model_runner._step_trace = path


def traced_nodes(llm, requests, trace) -> tuple[list[dict], list[tuple[int, list[int], list[int]]]]:
    """Run ``requests`` with the step trace on: their outputs, and per traced tree (request index, the request's
    output through the tree's root, each node's path)."""
    first = llm.request_counter.counter  # vLLM numbers a call's requests in order: "<n>-<suffix>"
    llm.collective_rpc(functools.partial(_trace_to, path=str(trace)))
    try:
        outputs = generate_outputs(llm, requests)
    finally:
        llm.collective_rpc(functools.partial(_trace_to, path=None))
    trees = []
    for line in trace.read_text().splitlines():
        for traced in json.loads(line)["requests"]:
            index = int(traced["req_id"].split("-")[0]) - first
            through_root = outputs[index]["tokens"][: traced["prefix_len"] + 1 - len(requests[index][0])]
            paths = []
            for token, parent in zip(traced["tokens"], traced["parents"], strict=True):
                paths.append([*(paths[parent] if parent >= 0 else []), token])
            trees.append((index, through_root, paths))
    return outputs, trees


def forbidden_nodes(trees, grammar_of: dict[int, dict], tokenizer_dir,
                    draftable: set[int] | None = None) -> tuple[int, int]:
    """(nodes of structured requests checked, nodes their grammar forbids after the output through the root);
    ``draftable``: the target ids a draft can propose (a forbidden node counts only where the grammar allowed one
    of them)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.utils import choice_as_grammar

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    checked = forbidden = 0
    for index, through_root, paths in trees:
        spec = grammar_of.get(index)
        if spec is None:
            continue
        compiled = (compiler.compile_regex(spec["regex"]) if "regex" in spec else
                    compiler.compile_grammar(choice_as_grammar(spec["choice"]) if "choice" in spec else spec["grammar"]))
        for path in paths:
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[tokenizer.eos_token_id])
            checked += 1
            for token in [*through_root, *path]:
                if matcher.is_terminated():  # after the grammar's end (ignore_eos) nothing is constrained, as in vLLM
                    break
                bitmask = xgr.allocate_token_bitmask(1, vocab)
                matcher.fill_next_token_bitmask(bitmask, 0)
                if not matcher.accept_token(token):
                    allowed = {t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
                    forbidden += draftable is None or bool(allowed & draftable)
                    break
    return checked, forbidden


def check_drafts_follow_grammars(llm, requests, expected, tokenizer_dir, trace) -> None:
    generate_outputs(llm, requests)  # the worker compiles the grammars: the traced run masks from its first step
    outputs, trees = traced_nodes(llm, requests, trace)
    assert_same_outputs(outputs, expected)
    grammar_of = {index: GRAMMARS[WITH_OPTION.index(index)] for index in WITH_OPTION}
    checked, forbidden = forbidden_nodes(trees, grammar_of, tokenizer_dir)
    assert checked > 20 and forbidden == 0, (checked, forbidden)


@pytest.mark.parametrize("tree", ["static", pytest.param("auto", marks=pytest.mark.slow)])
def test_drafted_nodes_follow_the_grammar_and_outputs_equal_vanilla(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                   tiny_tokenizer_dir, tmp_path, tree):
    requests = with_option("structured_output")
    expected = vanilla_outputs(llm_pool, tree_llama_dir, "structured_output", requests)
    llm = llm_pool.get(tree_llama_dir, speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": STATIC if tree == "static" else AUTO}})
    if tree == "auto":
        llm.collective_rpc(steps_cost_nothing)  # nodes must be verified to be checked, whatever the timings
    check_drafts_follow_grammars(llm, requests, expected, tiny_tokenizer_dir, tmp_path / "trace.jsonl")


def _record_chains(worker) -> None:
    """Wrap the worker's chain drafting to record, per chain step and request, its output through the step's bonus
    token and the chain drafted after it."""
    drafting = worker.model_runner.drafter.tree_drafting
    drafting.recorded_chains = recorded = []
    draft_chain = drafting.draft_chain

    def recording(**arguments):
        chains = draft_chain(**arguments)
        batch = drafting.batch
        bonus = arguments["next_token_ids"].tolist()
        for row, (req_id, chain) in enumerate(zip(drafting._request_ids(len(chains)), chains.tolist(), strict=True)):
            output = drafting._history(row, req_id, bonus[row])[int(batch.num_prompt_tokens[row]):]
            recorded.append((req_id, output.tolist(), chain))
        return chains

    drafting.draft_chain = recording


def _recorded_chains(worker) -> list:
    drafting = worker.model_runner.drafter.tree_drafting
    del drafting.draft_chain
    return drafting.__dict__.pop("recorded_chains")


def check_chains_follow_grammars(llm, requests, expected, tokenizer_dir, draftable: set[int] | None = None) -> None:
    generate_outputs(llm, requests)  # the worker compiles the grammars: the recorded run masks from its first step
    first = llm.request_counter.counter
    llm.collective_rpc(_record_chains)
    try:
        outputs = generate_outputs(llm, requests)
    finally:
        (recorded,) = llm.collective_rpc(_recorded_chains)
    assert_same_outputs(outputs, expected)
    chains = [(int(req_id.split("-")[0]) - first, output, [chain[: depth + 1] for depth in range(len(chain))])
              for req_id, output, chain in recorded]
    grammar_of = {index: GRAMMARS[WITH_OPTION.index(index)] for index in WITH_OPTION}
    checked, forbidden = forbidden_nodes(chains, grammar_of, tokenizer_dir, draftable)
    assert checked > 20 and forbidden == 0, (checked, forbidden)


def test_chain_steps_draft_what_the_grammar_allows_and_outputs_equal_vanilla(llm_pool, tree_llama_dir,
                                                                             tiny_llama_draft_dir, tiny_tokenizer_dir):
    requests = with_option("structured_output")
    expected = vanilla_outputs(llm_pool, tree_llama_dir, "structured_output", requests)
    llm = llm_pool.get(tree_llama_dir, speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": CHAINS}})
    check_chains_follow_grammars(llm, requests, expected, tiny_tokenizer_dir)


REASONING_PARSER = "easyspec-tiny-think"  # reasoning from the start, ended by w42 (mid-output in the structured requests)


def _register_reasoning_parser() -> None:
    from vllm.reasoning import ReasoningParserManager
    from vllm.reasoning.basic_parsers import BaseThinkingReasoningParser

    class TinyThinking(BaseThinkingReasoningParser):
        start_token = "w62"
        end_token = "w42"

    ReasoningParserManager.register_module(REASONING_PARSER, force=True, module=TinyThinking)


def _content(prompt: list[int], output: list[int]) -> list[int]:
    """The output the grammar constrains: all of it where the prompt ends the section, else what follows w42."""
    return output if not _in_reasoning(prompt) else output[output.index(42) + 1:]


def _in_reasoning(tokens: list[int]) -> bool:
    """The parser's reading: the section is open unless w42 comes after the last w62."""
    ends = [index for index, token in enumerate(tokens) if token == 42]
    return not ends or 62 in tokens[ends[-1]:]


def test_a_reasoning_section_verifies_trees_and_outputs_equal_vanilla(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                      tiny_tokenizer_dir, tmp_path):
    _register_reasoning_parser()  # the pool's in-process engines see it
    requests = with_option("structured_output")
    expected = generate_outputs(llm_pool.get(tree_llama_dir, reasoning_parser=REASONING_PARSER), requests)
    llm = llm_pool.get(tree_llama_dir, speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": STATIC}}, reasoning_parser=REASONING_PARSER)
    generate_outputs(llm, requests)  # the worker compiles the grammars: the traced run masks from its first step
    outputs, trees = traced_nodes(llm, requests, tmp_path / "trace.jsonl")
    assert_same_outputs(outputs, expected)
    reasoning = [paths for index, through_root, paths in trees
                 if index in WITH_OPTION and _in_reasoning([*requests[index][0], *through_root])]
    assert sum(map(len, reasoning)) > 20, reasoning  # the parser's sections, from vanilla's output
    assert not any(42 in path for paths in reasoning for path in paths)  # no node ends the section
    # after the section the drafts follow the grammar over the content (the step whose bonus token ends the
    # section drafts unmasked: the worker's matcher follows the output, not the bonus token)
    content = [(index, _content(requests[index][0], through_root), paths) for index, through_root, paths in trees
               if index in WITH_OPTION and not _in_reasoning([*requests[index][0], *through_root[:-1]])]
    grammar_of = {index: GRAMMARS[WITH_OPTION.index(index)] for index in WITH_OPTION}
    checked, forbidden = forbidden_nodes(content, grammar_of, tiny_tokenizer_dir)
    assert checked > 20 and forbidden == 0, (checked, forbidden)
