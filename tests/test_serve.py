"""End to end through ``vllm serve``: the plugin's options arrive by CLI flags, greedy completions equal an
engine without speculation, vLLM's speculative metrics are exported, and a bad option stops the server
with one line naming the fix."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from tests.serving import free_port, post, serve_command, serving

pytestmark = pytest.mark.engine  # every test here starts a server

PROMPT = "w5 w9 w13 w17"
MAX_TOKENS = 24


def test_vllm_serve_with_plugin_is_greedy_exact(tmp_path, llm_pool, tiny_llama_dir, tiny_llama_draft_dir):
    from vllm import SamplingParams

    expected = llm_pool.get(tiny_llama_dir).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].text

    port = free_port()
    spec = {"method": "draft_model", "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 3}
    command = serve_command(
        tiny_llama_dir, port, "--speculative-config", json.dumps(spec), "--additional-config",
        json.dumps({"easyspec": {}}),
    )  # fmt: skip
    with serving(command, port, tmp_path / "serve.log"):
        body = {"model": str(tiny_llama_dir), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        completion = post(port, "/v1/completions", body)
        assert completion["choices"][0]["text"] == expected
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and float(drafts[0].split()[-1]) > 0


@pytest.mark.slow  # a refusal through the server in the default suite: test_vllm_serve_rejects_a_bad_tree_in_one_line
def test_vllm_serve_rejects_bad_options_in_one_line(tiny_llama_dir, tiny_llama_draft_dir):
    easyspec, message = {"layer_groups": [[0, 1]]}, "contains layer 0, the first layer"
    spec = {"method": "draft_model", "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 3}
    command = serve_command(
        tiny_llama_dir, free_port(), "--speculative-config", json.dumps(spec), "--additional-config",
        json.dumps({"easyspec": easyspec}),
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if message in line]
    assert lines, (result.stdout + result.stderr)[-3000:]


def test_vllm_serve_with_trees_is_greedy_exact(tmp_path, llm_pool, tiny_llama_dir):
    """Trees with prompt-lookup candidates, sized by the controller (``tree.auto``), through
    `vllm-easyspec serve --additional-config`: concurrent greedy completions (one with a repetition penalty,
    applied per node) equal an engine without speculation, vLLM's speculative counters count tree
    nodes per depth, the controller's figures are in ``/metrics`` and its cost curve in the log, and a
    malformed request gets a 400 without harming the server."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from vllm import SamplingParams

    prompts = ["w5 w9 w13 w17", "w40 w41 w42", "w7", "w60 w3 w3 w3 w21 w8 w30"]
    penalties = [1.0, 1.0, 1.5, 1.0]
    vanilla = llm_pool.get(tiny_llama_dir)
    expected = [
        vanilla.generate([p], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                             repetition_penalty=r), use_tqdm=False)[0].outputs[0].text
        for p, r in zip(prompts, penalties, strict=True)
    ]
    port = free_port()
    # the target drafts for itself: its trees are accepted, so the controller, which prices a depth by the
    # nodes it offered, keeps drafting (a random draft's trees are not worth a row, and it would stop)
    spec = {"method": "draft_model", "model": str(tiny_llama_dir)}
    lookup = {"prompt_lookup": {"nodes": 2, "min_match": 1, "max_match": 3}}
    tree = {"easyspec": {"tree": {"top_k": 2, "depth": 3, "budget": 6, "sources": lookup, "auto": True},
                         "layer_parallel_size": 2}}
    command = serve_command(
        tiny_llama_dir, port, "--speculative-config", json.dumps(spec), "--additional-config", json.dumps(tree),
    )  # fmt: skip
    with serving(command, port, tmp_path / "serve.log"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)

        def complete(index: int) -> str:
            completion = client.completions.create(
                model=str(tiny_llama_dir), prompt=prompts[index], max_tokens=MAX_TOKENS, temperature=0.0,
                extra_body={"ignore_eos": True, "repetition_penalty": penalties[index]},
            )
            return completion.choices[0].text

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            assert list(pool.map(complete, range(len(prompts)))) == expected
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=str(tiny_llama_dir), prompt=prompts[0], max_tokens=-3)
        assert complete(0) == expected[0]  # still serving
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        counters = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_") and "{" in line and "position" not in line}
        per_depth = [line for line in metrics.splitlines()
                     if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
        assert counters["vllm:spec_decode_num_drafts_total"] > 0
        # a tree step verifies at most the six drafted nodes plus the two that prompt lookup merged in
        drafts, nodes = counters["vllm:spec_decode_num_drafts_total"], counters["vllm:spec_decode_num_draft_tokens_total"]
        assert drafts <= nodes <= 8 * drafts
        assert len(per_depth) == 8 and float(per_depth[0].split()[-1]) > 0
        auto = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:easyspec_auto_") and "{" in line}
        assert auto["vllm:easyspec_auto_steps_total"] > 0
        # every scheduled node was chosen (some chosen for a request's last step are never scheduled)
        assert nodes <= auto["vllm:easyspec_auto_nodes_chosen_total"] <= nodes + 8 * len(prompts) + 8
        assert "vllm:easyspec_auto_verify_seconds" in auto and "vllm:easyspec_auto_nodes_per_request_bucket" in auto
    assert "easyspec.tree.auto: step cost measured" in (tmp_path / "serve.log").read_text()


def test_vllm_serve_rejects_a_bad_tree_in_one_line(tiny_llama_dir, tiny_llama_draft_dir):
    spec = {"method": "draft_model", "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 5}
    tree = {"easyspec": {"tree": {"choices": [[0], [1]]}}}
    command = serve_command(
        tiny_llama_dir, free_port(), "--speculative-config", json.dumps(spec), "--additional-config", json.dumps(tree),
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    message = "num_speculative_tokens = 5 but easyspec.tree has 2 nodes"
    assert [line for line in (result.stdout + result.stderr).splitlines() if message in line], (
        (result.stdout + result.stderr)[-3000:]
    )
