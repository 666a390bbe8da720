"""Request batches with the sampling options a tree serves with speculation (issue 62), structured output included,
and how their outputs are compared with vanilla vLLM's.

Each batch is the mixed batch of 8 (:data:`request_batches.MIXED`) with one option, or several, on the four
requests with the longest outputs, beside four plain ones. The values were picked so that every option changes
the tiny tree targets' greedy output (a repetition penalty breaks their loops, ``w60 w6`` and ``w23`` appear in
their plain output, ...): an option a tree ignored would show.
"""

from __future__ import annotations

from tests.request_batches import MIXED
from vllm_easyspec.instruments.worker_extension import read_tree_stats

OPTIONS: dict[str, dict] = {
    "repetition_penalty": {"repetition_penalty": 1.5},
    "presence_frequency_penalty": {"presence_penalty": 0.8, "frequency_penalty": 0.6},
    "bad_words": {"bad_words": ["w60 w6", "w23"]},
    "logit_bias": {"logit_bias": {35: 2.5, 20: -3.0, 41: 1.0}},
    "allowed_token_ids": {"allowed_token_ids": list(range(3, 40))},
    "logprobs": {"logprobs": 3, "prompt_logprobs": 2},
    "logprob_token_ids": {"logprob_token_ids": [20, 35, 41]},
}
REPORTS_ONLY = {"logprobs", "logprob_token_ids"}  # options that change no token
OPTION_NAMES = [*OPTIONS, "structured_output"]  # structured output: one of GRAMMARS per request
# grammars over the tiny vocabulary's raw token text ("w15", ...), in tokens w10..w29 (none has a prefix that is a
# token: "w3" would let a grammar over "w30" start with w3); the second's and the third's next token depends on the
# path taken, so a tree's nodes get different masks
GRAMMARS = [
    {"regex": "(w1[0-9]|w2[0-9])+"},
    {"regex": "((w15w19|w15w23|w20w21w22|w11)w13)+"},
    {"choice": ["w20w16w20w25", "w20w16w24w17", "w21w25w19"]},
    {"grammar": 'root ::= ("w21" | "w27" | "w18")+ "w19"'},
]
WITH_OPTION = (0, 3, 5, 6)  # the requests of MIXED that get the option: the longest outputs
LOGPROB_TOLERANCE = 1e-4  # float32: the tree's verify forward and vanilla's decode round differently


def structured(index: int) -> dict:
    """``structured_outputs`` with grammar ``index`` of :data:`GRAMMARS`."""
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(**GRAMMARS[index])}


def with_option(name: str) -> list[tuple[list[int], dict]]:
    """The mixed batch of 8 with option ``name`` on :data:`WITH_OPTION` (``structured_output``: each of them with
    its own grammar)."""
    def option(index: int) -> dict:
        return structured(WITH_OPTION.index(index)) if name == "structured_output" else OPTIONS[name]

    return [(prompt, options | option(index)) if index in WITH_OPTION else (prompt, options)
            for index, (prompt, options) in enumerate(MIXED)]


def with_every_option() -> list[tuple[list[int], dict]]:
    """The mixed batch of 8, six of them with different options (three with two at once), two plain."""
    combined = [OPTIONS["repetition_penalty"] | OPTIONS["logprobs"], OPTIONS["bad_words"], {},
                OPTIONS["presence_frequency_penalty"] | OPTIONS["logit_bias"], OPTIONS["allowed_token_ids"],
                OPTIONS["logit_bias"] | structured(2), OPTIONS["bad_words"] | OPTIONS["repetition_penalty"], {}]
    return [(prompt, options | extra) for (prompt, options), extra in zip(MIXED, combined, strict=True)]


def only_options(requests: list[tuple[list[int], dict]]) -> list[tuple[list[int], dict]]:
    """The requests of a batch that carry an option (plain ones have only MIXED's own)."""
    return [(prompt, options) for (prompt, options), (_, plain) in zip(requests, MIXED, strict=True)
            if options != plain]


_VANILLA: dict[str, list[dict]] = {}


def vanilla_outputs(llm_pool, target, name: str, requests) -> list[dict]:
    """:func:`generate_outputs` of an engine without speculation for ``target``, kept for the session under ``name``
    (taken before the engine under test: the pool runs one in-process engine at a time)."""
    key = f"{target}:{name}"
    if key not in _VANILLA:
        _VANILLA[key] = generate_outputs(llm_pool.get(target), requests)
    return _VANILLA[key]


def generate_outputs(llm, requests, **common) -> list[dict]:
    """Each request's output: token ids, text, finish reason, and its logprobs and prompt logprobs as
    ``{token: (logprob, rank)}`` per position (None where not asked for); greedy unless the options say so."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(**({"temperature": 0.0} | options | common)) for _, options in requests]
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in requests]
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        results.append({
            "tokens": list(completion.token_ids), "text": completion.text, "finish": completion.finish_reason,
            "logprobs": _positions(completion.logprobs), "prompt_logprobs": _positions(output.prompt_logprobs),
        })
    return results


def _positions(logprobs) -> list[dict[int, tuple[float, int]]] | None:
    if logprobs is None:
        return None
    return [None if position is None else {token: (value.logprob, value.rank) for token, value in position.items()}
            for position in logprobs]


def assert_same_outputs(got: list[dict], expected: list[dict]) -> None:
    """Token ids, text and finish reason equal; logprobs at the same positions, of the same tokens with the same
    ranks, equal within :data:`LOGPROB_TOLERANCE`."""
    assert len(got) == len(expected)
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        for key in ("tokens", "text", "finish"):
            assert ours[key] == theirs[key], (index, key)
        for key in ("logprobs", "prompt_logprobs"):
            assert (ours[key] is None) == (theirs[key] is None), (index, key)
            if ours[key] is None:
                continue
            assert len(ours[key]) == len(theirs[key]), (index, key)
            for position, (mine, reference) in enumerate(zip(ours[key], theirs[key], strict=True)):
                assert (mine is None) == (reference is None), (index, key, position)
                if mine is None:
                    continue
                assert mine.keys() == reference.keys(), (index, key, position)
                for token, (value, rank) in mine.items():
                    assert rank == reference[token][1], (index, key, position, token)
                    assert abs(value - reference[token][0]) <= LOGPROB_TOLERANCE, (index, key, position, token)


def speculation_of(llm, requests) -> dict[str, int]:
    """Run ``requests`` alone and return what the tree counters gained: ``accepted`` draft tokens and
    ``requests_without_speculation`` (served with no drafts). With every request carrying an option, accepted
    tokens are theirs."""
    before = llm.collective_rpc(read_tree_stats)[0]
    generate_outputs(llm, requests)
    after = llm.collective_rpc(read_tree_stats)[0]
    return {key: after[key] - before[key] for key in ("accepted", "requests_without_speculation", "tree_requests",
                                                      "chain_requests", "path_requests", "nodes_verified")}
