"""Request options through the OpenAI server with token trees (issue 62): ``vllm-easyspec serve`` with a draft-model
tree takes the mixed batch with every option (penalties, ``logit_bias``, ``bad_words``, ``allowed_token_ids``,
``logprobs``, ``prompt_logprobs``, structured output) as concurrent completions, and a sampled ``min_p`` request, which vLLM's server
refuses with speculation. Greedy texts and logprobs equal vanilla ``LLM()``'s, drafts are accepted, and no request
is served without speculation. Slow: it starts a server (tests/tree/test_engine_tree_options.py checks each option
through ``LLM()`` in the default suite)."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.option_requests import LOGPROB_TOLERANCE, generate_outputs, with_every_option
from tests.serving import free_port, post, serve_command, serving

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STATIC = {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}


def _body(model: str, prompt: list[int], options: dict) -> dict:
    """A completions request with ``options`` (SamplingParams names: vLLM's server takes them as they are)."""
    body = {"model": model, "prompt": prompt, "temperature": 0.0} | options
    if "logit_bias" in body:  # the API takes token ids as strings
        body["logit_bias"] = {str(token): bias for token, bias in body["logit_bias"].items()}
    if "structured_outputs" in body:  # and the grammar as its fields
        grammar = body["structured_outputs"]
        body["structured_outputs"] = {name: getattr(grammar, name) for name in ("json", "regex", "choice", "grammar")
                                      if getattr(grammar, name) is not None}
    return body


def test_every_option_through_the_server_is_speculated_and_equals_vanilla(tmp_path, llm_pool, tree_llama_dir,
                                                                           tiny_llama_draft_dir):
    requests = with_every_option()
    expected = generate_outputs(llm_pool.get(tree_llama_dir), requests)
    port = free_port()
    spec = {"method": "draft_model", "model": str(tiny_llama_draft_dir)}
    command = serve_command(tree_llama_dir, port, "--speculative-config", json.dumps(spec),
                            "--additional-config", json.dumps({"easyspec": {"tree": STATIC}}))
    model = str(tree_llama_dir)
    with serving(command, port, tmp_path / "serve.log"):
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            completions = list(pool.map(lambda request: post(port, "/v1/completions", _body(model, *request)),
                                        requests))
        sampled = post(port, "/v1/completions", _body(model, [1, 7], {
            "max_tokens": 12, "ignore_eos": True, "temperature": 0.9, "min_p": 0.2, "seed": 1}))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
    for index, (completion, reference) in enumerate(zip(completions, expected, strict=True)):
        choice = completion["choices"][0]
        assert choice["text"] == reference["text"] and choice["finish_reason"] == reference["finish"], index
        if reference["logprobs"] is not None:
            values = choice["logprobs"]["token_logprobs"]
            wanted = [position[token][0] for position, token in zip(reference["logprobs"], reference["tokens"],
                                                                    strict=True)]
            assert len(values) == len(wanted)
            assert all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(values, wanted, strict=True)), index
        if reference["prompt_logprobs"] is not None:
            assert len(choice["prompt_logprobs"]) == len(reference["prompt_logprobs"])
    assert sampled["choices"][0]["finish_reason"] == "length"
    accepted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0
    assert "served without speculation" not in (tmp_path / "serve.log").read_text()
