"""Requests with sampling options are served with token trees, losslessly (issue 62), through a real vLLM engine on
tiny float32 models with a draft-model tree.

- For each option (repetition penalty, presence and frequency penalties, ``bad_words``, ``logit_bias``,
  ``allowed_token_ids``, ``logprobs`` with ``prompt_logprobs``, ``logprob_token_ids``, structured output): greedy
  output in a mixed batch of 8 (four requests with the option, four plain) equals vanilla's, token for token, with
  the logprobs vanilla returns; and the requests with the option, run alone, get drafts accepted in branching trees
  and none is served without speculation.
- Every option at once in one batch, also while ``budget_by_batch`` switches to chains (penalties and bad words go
  through vLLM's own chain sampler, ``logit_bias`` makes its step a tree step) and under ``tree.auto``.
- ``min_p`` and ``logit_bias`` are accepted by a tree engine, which vLLM refuses with speculation.
- Structured output (regex, choice, grammar) masks each node's row with the grammar's state along the node's path.
- Bad input: an invalid grammar gets vLLM's own error and the engine serves on; a grammar no token can start is
  served as vanilla serves it; logprobs in a processed ``logprobs_mode`` fall back exactly, with one log line each.
- At T > 0 the engine-level chi-square test passes with penalties, with ``min_p`` and with a structured-output
  choice, and rejects a biased tree verifier with each.

Marked slow: each option on its own under ``tree.auto`` and ``budget_by_batch`` chains, and ``min_p``'s chi-square
in chain steps (the default suite keeps one engine test per option, and every option at once with ``auto`` and in
chain steps).
"""

from __future__ import annotations

import types

import pytest

from tests.controller_costs import steps_cost_nothing
from tests.distribution import ALPHA, chi_square_against, install_biased_tree_sampler, restore_tree_sampler
from tests.option_requests import (
    OPTION_NAMES,
    REPORTS_ONLY,
    assert_same_outputs,
    generate_outputs,
    only_options,
    speculation_of,
    vanilla_outputs,
    with_every_option,
    with_option,
)
from vllm_easyspec.instruments.worker_extension import read_tree_stats

STATIC = {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}
AUTO = {"top_k": 2, "depth": 3, "budget": 6, "sources": {"prompt_lookup": {"nodes": 3}}, "auto": True}
CHAINS = STATIC | {"budget_by_batch": {"3": {"chain": 3}}}  # from 3 running requests on, chains of 3


def _engine(llm_pool, target, draft, tree: dict):
    return llm_pool.get(target, speculative_config={"method": "draft_model", "model": str(draft)},
                        additional_config={"easyspec": {"tree": tree}})


def _assert_speculated(llm, requests, branching: bool = False) -> None:
    """The requests with options, run alone, got drafts accepted and none was served without speculation; with
    ``branching``, trees that branch were verified for them (a structured-output tree cut to a chain by vLLM's chain
    validation would verify one node per step)."""
    gained = speculation_of(llm, only_options(requests))
    assert gained["requests_without_speculation"] == 0 and gained["accepted"] > 0, gained
    if branching:
        assert gained["path_requests"] < gained["tree_requests"] < gained["nodes_verified"], gained


@pytest.mark.parametrize("option", OPTION_NAMES)
def test_requests_with_an_option_are_speculated_and_equal_vanilla(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                   option):
    requests = with_option(option)
    expected = vanilla_outputs(llm_pool, tree_llama_dir, option, requests)
    plain = vanilla_outputs(llm_pool, tree_llama_dir, "plain", with_option("logprobs"))  # the option changes the output
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, STATIC)
    assert_same_outputs(generate_outputs(llm, requests), expected)
    if option not in REPORTS_ONLY:
        assert [out["tokens"] for out in expected] != [out["tokens"] for out in plain]
    _assert_speculated(llm, requests, branching=True)


@pytest.mark.parametrize("tree", ["auto", "chains"])
def test_every_option_at_once_is_speculated_and_equals_vanilla(llm_pool, tree_llama_dir, tiny_llama_draft_dir, tree):
    requests = with_every_option()
    expected = vanilla_outputs(llm_pool, tree_llama_dir, "every", requests)
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, AUTO if tree == "auto" else CHAINS)
    if tree == "auto":
        llm.collective_rpc(steps_cost_nothing)  # nodes must be verified to be checked, whatever the timings
    assert_same_outputs(generate_outputs(llm, requests), expected)
    _assert_speculated(llm, requests)


@pytest.mark.slow
@pytest.mark.parametrize("option", OPTION_NAMES)
def test_an_option_under_auto_and_in_chain_steps_equals_vanilla(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                 option):
    requests = with_option(option)
    expected = vanilla_outputs(llm_pool, tree_llama_dir, option, requests)
    for tree in (AUTO, CHAINS):
        llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, tree)
        if tree is AUTO:
            llm.collective_rpc(steps_cost_nothing)
        assert_same_outputs(generate_outputs(llm, requests), expected)
        _assert_speculated(llm, requests)


@pytest.mark.slow  # LLM()'s own processes take 25-40 s to start on 2 cores
def test_structured_output_trees_reach_a_scheduler_in_another_process(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """The node parents travel to the scheduler on vLLM's ``DraftTokenIds``, pickled between the worker's process
    and the engine core's: there too, structured-output requests verify branching trees and equal vanilla."""
    requests = with_option("structured_output")
    expected = vanilla_outputs(llm_pool, tree_llama_dir, "structured_output", requests)
    llm = llm_pool.get(tree_llama_dir, multiprocess=True, additional_config={"easyspec": {"tree": STATIC}},
                       speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)})
    assert_same_outputs(generate_outputs(llm, requests), expected)
    _assert_speculated(llm, requests, branching=True)


def test_min_p_and_logit_bias_are_accepted_with_a_tree(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """vLLM refuses both whenever speculation is configured; a tree engine serves them (a sampled ``min_p``
    request runs to its length; the chi-square test below checks its law)."""
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, STATIC)
    requests = [([1, 7], {"max_tokens": 12, "ignore_eos": True, "temperature": 0.9, "min_p": 0.2, "seed": 1}),
                ([1, 40, 41], {"max_tokens": 12, "ignore_eos": True, "logit_bias": {35: 3.0}})]
    outputs = generate_outputs(llm, requests)
    assert [len(out["tokens"]) for out in outputs] == [12, 12]


# ---- bad input: vLLM's own error, or an exact fallback, never the engine down ------------------------------------

def test_an_invalid_grammar_gets_vllms_error_and_the_engine_serves_on(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """An invalid JSON schema and an invalid regex are refused before they reach the engine, as vLLM refuses them
    without speculation; a grammar no token can start (``xyz``) is served exactly as vanilla serves it; the engine
    then serves the mixed batch with structured output exactly."""
    from vllm.sampling_params import StructuredOutputsParams

    invalid = [{"json": {"type": "nonsense"}}, {"regex": "(w1["}]
    impossible = [([1, 7], {"max_tokens": 6, "structured_outputs": StructuredOutputsParams(regex="xyz")})]
    expected = vanilla_outputs(llm_pool, tree_llama_dir, "impossible", impossible)
    plain = vanilla_outputs(llm_pool, tree_llama_dir, "structured_output", with_option("structured_output"))
    vanilla_errors = []
    for spec in invalid:
        with pytest.raises(Exception) as refused:  # noqa: PT011 - whatever vLLM raises, the tree engine must too
            generate_outputs(llm_pool.get(tree_llama_dir), [([1, 7], {"max_tokens": 4,
                                                             "structured_outputs": StructuredOutputsParams(**spec)})])
        vanilla_errors.append(type(refused.value))
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, STATIC)
    for spec, error in zip(invalid, vanilla_errors, strict=True):
        with pytest.raises(error):
            generate_outputs(llm, [([1, 7], {"max_tokens": 4, "structured_outputs": StructuredOutputsParams(**spec)})])
    assert_same_outputs(generate_outputs(llm, impossible), expected)
    assert_same_outputs(generate_outputs(llm, with_option("structured_output")), plain)


def test_min_tokens_beyond_a_grammars_end_keeps_its_stop_token_as_vanilla(llm_pool, tree_llama_dir,
                                                                           tiny_llama_draft_dir):
    """A grammar that ends after two tokens under ``min_tokens`` 5: vLLM bans the stop token for the first five
    outputs but gives it back in a row the grammar leaves empty otherwise, so the request ends after the grammar's
    end; so must the tree's rows."""
    from vllm.sampling_params import StructuredOutputsParams

    requests = [(prompt, {"max_tokens": 12, "min_tokens": 5,
                          "structured_outputs": StructuredOutputsParams(choice=["w20w21", "w28w25"])})
                for prompt, _ in with_option("structured_output")[:4]]
    expected = vanilla_outputs(llm_pool, tree_llama_dir, "min_tokens_grammar", requests)
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, STATIC)
    assert_same_outputs(generate_outputs(llm, requests), expected)
    assert all(out["finish"] == "stop" and len(out["tokens"]) == 3 for out in expected)


def test_logprobs_in_a_processed_mode_fall_back_exactly_with_one_log_line_each(llm_pool, tree_llama_dir,
                                                                                tiny_llama_draft_dir):
    """The one option of this list a tree does not serve: processed logprobs (the tree sampler returns raw ones).
    Its requests get no drafts (one log line each) and equal vanilla's in the same mode; the others are speculated."""
    requests = with_option("logprobs")
    expected = generate_outputs(llm_pool.get(tree_llama_dir, logprobs_mode="processed_logprobs"), requests)
    llm = llm_pool.get(tree_llama_dir, speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": STATIC}}, logprobs_mode="processed_logprobs")
    before = llm.collective_rpc(read_tree_stats)[0]
    assert_same_outputs(generate_outputs(llm, requests), expected)
    after = llm.collective_rpc(read_tree_stats)[0]
    assert after["requests_without_speculation"] - before["requests_without_speculation"] == len(only_options(requests))
    assert after["accepted"] > before["accepted"]  # the plain requests beside them were speculated


def _engine_config(additional_config: dict):
    """What the seams read of an engine's config: its ``easyspec`` options, a speculative config, a batch size."""
    return types.SimpleNamespace(additional_config=additional_config, speculative_config=types.SimpleNamespace(method="eagle3"),
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=4))


def test_only_a_tree_engine_lets_min_p_and_logit_bias_through_and_builds_their_processors():
    """Without a tree, vLLM's refusal and its processors (``MinTokensLogitsProcessor`` only) stay as they are."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    from vllm_easyspec.integration import request_options

    request_options.install()
    tree, chain = _engine_config({"easyspec": {"tree": {"choices": [[0]]}}}), _engine_config({"easyspec": {}})
    validate = request_options._validate_params(lambda self, params: params._validate_spec_decode(object()))
    for params in (SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(logit_bias={3: 1.0})):
        validate(types.SimpleNamespace(vllm_config=tree), params)
        with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
            validate(types.SimpleNamespace(vllm_config=chain), params)
    build = request_options._build_logitsprocs(build_logitsprocs)
    kinds = {name: {type(p) for p in build(config, "cpu", False, False).all}
             for name, config in (("tree", tree), ("chain", chain))}
    assert {LogitBiasLogitsProcessor, MinPLogitsProcessor} <= kinds["tree"]
    assert not {LogitBiasLogitsProcessor, MinPLogitsProcessor} & kinds["chain"]


# ---- T > 0: the engine-level chi-square test with per-node options ---------------------------------------------

PROMPT = [1, 17, 42, 5, 33, 9]
# each option's temperature: at 2.0 the tiny target's law has 21 cells of 5 expected samples or more once min_p
# 0.05 has removed 30% of its mass (at 1.0 it would leave one)
# a choice among the target's likelier first tokens of w10..w29 (its favourite, w22, left out) and their likelier
# followers: the second token's mask depends on the first, and at temperature 1.5 11 cells expect 5 samples or more.
# The tiny vocabulary's raw text makes "w3" a prefix of "w30", which a grammar over "w30" lets through first:
# tokens w10..w29 have no such prefix.
CHOICE = ["w21w19", "w21w27", "w21w28", "w10w20", "w10w18", "w28w20", "w28w25", "w28w11", "w28w26", "w28w29",
          "w11w14", "w11w27"]
SAMPLED_OPTIONS = {
    "penalties": {"repetition_penalty": 1.8, "presence_penalty": 0.7, "frequency_penalty": 0.4, "temperature": 1.0},
    "min_p": {"min_p": 0.05, "temperature": 2.0},
    "structured_choice": {"choice": CHOICE, "temperature": 1.5},
}
SAMPLES = 4000


def _choice_allows(output: list[int]) -> list[int]:
    """The tokens :data:`CHOICE` allows after ``output`` (each choice is two tokens of the tiny vocabulary)."""
    pairs = [[int(word) for word in choice.split("w")[1:]] for choice in CHOICE]
    return sorted({pair[len(output)] for pair in pairs if pair[: len(output)] == output})


def _sampling_options(options: dict) -> dict:
    """``SAMPLED_OPTIONS`` entry as ``SamplingParams`` arguments."""
    from vllm.sampling_params import StructuredOutputsParams

    if "choice" not in options:
        return options
    return {key: value for key, value in options.items() if key != "choice"} | {
        "structured_outputs": StructuredOutputsParams(choice=options["choice"])}


def _exact_law(model_dir, options: dict):
    """P(t1, t2 | PROMPT) under ``options``, in float64 from the target itself, with vLLM's definitions: the
    grammar's mask (a choice: the tokens that continue one of its strings), repetition penalty over the prompt and
    the output (positive logits divided, negative ones multiplied), frequency and presence penalties over the
    output, then temperature, then min-p."""
    import torch
    from transformers import AutoModelForCausalLM

    def processed(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        if "choice" in options:
            allowed = torch.full_like(logits, float("-inf"))
            allowed[_choice_allows(output)] = 0.0
            logits = logits + allowed
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[PROMPT + output] = True
        penalty = options.get("repetition_penalty", 1.0)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        counts = torch.zeros_like(logits)
        for token in output:
            counts[token] += 1
        logits = logits - options.get("frequency_penalty", 0.0) * counts
        logits = logits - options.get("presence_penalty", 0.0) * (counts > 0)
        probs = torch.softmax(logits / options["temperature"], dim=-1)
        probs = torch.where(probs < probs.max() * options.get("min_p", 0.0), 0.0, probs)
        return torch.nan_to_num(probs / probs.sum())  # a first token no choice starts with: never sampled

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        first = processed(model(torch.tensor([PROMPT])).logits[0, -1], [])
        vocab = first.shape[0]
        second = model(torch.tensor([PROMPT + [token] for token in range(vocab)])).logits[:, -1]
        return first[:, None] * torch.stack([processed(second[token], [token]) for token in range(vocab)])


def _chi_square(llm, model_dir, options: dict):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=2, min_tokens=2, seed=seed, ignore_eos=True, **_sampling_options(options))
              for seed in range(SAMPLES)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * SAMPLES, params, use_tqdm=False)
    return chi_square_against(_exact_law(model_dir, options), [tuple(o.outputs[0].token_ids[:2]) for o in outputs])


@pytest.mark.parametrize(("options", "tree"), [
    ("penalties", "static"), ("min_p", "static"), ("structured_choice", "static"),
    # vLLM's chain sampler ignores min_p: a chain step with min_p is the tree sampler's
    pytest.param("min_p", "chains", marks=pytest.mark.slow),
])
def test_distribution_with_per_node_options_matches_the_target(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                options, tree):
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, STATIC if tree == "static" else CHAINS)
    result = _chi_square(llm, tree_llama_dir, SAMPLED_OPTIONS[options])
    assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"


@pytest.mark.parametrize("options", list(SAMPLED_OPTIONS))
def test_distribution_test_with_per_node_options_rejects_a_biased_tree_verifier(llm_pool, tree_llama_dir,
                                                                                tiny_llama_draft_dir, options):
    llm = _engine(llm_pool, tree_llama_dir, tiny_llama_draft_dir, STATIC)
    llm.collective_rpc(install_biased_tree_sampler)
    try:
        result = _chi_square(llm, tree_llama_dir, SAMPLED_OPTIONS[options])
    finally:
        llm.collective_rpc(restore_tree_sampler)
    assert result.p_value < ALPHA, f"biased verifier not detected: chi2={result.statistic:.1f} p={result.p_value:.2e}"
