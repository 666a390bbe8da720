"""``vllm-easyspec serve`` with EAGLE trees holds a concurrent load (issue 12), on the tiny float32 Llama with a
head trained in the test session: 16 concurrent streams mixing greedy, seeded sampling, requests with a repetition
penalty (applied per node) and streams the client aborts, plus malformed requests. Greedy
outputs equal an engine without speculation, every stream that was not aborted gets all its tokens, each
malformed request gets a 400 naming the problem, and the server stays healthy throughout."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from tests.serving import free_port, serve_command, serving

pytestmark = pytest.mark.engine  # every test here starts a server

MAX_TOKENS = 24
PROMPTS = [
    "w5 w9 w13 w17", "w40 w41 w42", "w7", "w60 w3 w3 w3 w21 w8 w30", "w12 w12 w30 w12 w12", "w33 w17 w50",
    "w9 w9", "w22 w23 w24 w25 w26", "w61 w4 w27", "w14 w2 w14", "w44 w19 w23", "w3 w3 w3",
    "w8 w16 w32", "w50 w51", "w11 w22 w33 w44", "w6 w60",
]  # fmt: skip
# request kinds by index: greedy, seeded sampling, greedy with a repetition penalty, aborted stream
KINDS = ["greedy"] * 8 + ["seeded"] * 4 + ["penalty"] * 2 + ["aborted"] * 2
MALFORMED = [
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 2.0}, "top_p"),
]


def _expected_greedy(llm, prompt: str, repetition_penalty: float = 1.0) -> str:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            repetition_penalty=repetition_penalty)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def _healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        return response.status == 200


async def _load(client, model: str) -> list[dict]:
    async def one(index: int) -> dict:
        kind = KINDS[index]
        options = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
        if kind == "seeded":
            options = {"temperature": 0.7, "seed": index, "extra_body": {"ignore_eos": True}}
        elif kind == "penalty":
            options["extra_body"] = {"ignore_eos": True, "repetition_penalty": 1.3}
        stream = await client.completions.create(model=model, prompt=PROMPTS[index], max_tokens=MAX_TOKENS,
                                                 stream=True, **options)
        text, chunks, finish = "", 0, None
        async for chunk in stream:
            choice = chunk.choices[0]
            text += choice.text
            chunks += 1
            finish = choice.finish_reason or finish
            if kind == "aborted" and chunks == 3:
                await stream.close()  # the client goes away mid-stream
                break
        return {"index": index, "kind": kind, "text": text, "finish": finish}

    return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


@pytest.mark.slow  # the server with trees: tests/test_serve.py in the default suite
def test_serve_with_eagle_trees_holds_a_concurrent_load(tmp_path, llm_pool, tiny_llama_dir, trained_tiny_heads):
    _serve_under_load(tmp_path, llm_pool, tiny_llama_dir, trained_tiny_heads("eagle3"))


@pytest.mark.slow
def test_serve_with_eagle_trees_on_the_default_target(tmp_path, llm_pool, real_pair):
    """The same load on Qwen2.5-Coder-0.5B with the committed EAGLE-3 head (float32)."""
    head = Path(__file__).resolve().parents[2] / "heads" / "qwen2.5-coder-0.5b-instruct-eagle3"
    _serve_under_load(tmp_path, llm_pool, real_pair[0], head)


def _serve_under_load(tmp_path, llm_pool, target, head) -> None:
    import openai

    vanilla = llm_pool.get(target)
    expected = {i: _expected_greedy(vanilla, PROMPTS[i], 1.3 if KINDS[i] == "penalty" else 1.0)
                for i in range(len(PROMPTS)) if KINDS[i] in ("greedy", "penalty")}
    port = free_port()
    spec = {"method": "eagle3", "model": str(head)}
    tree = {"top_k": 3, "depth": 3, "budget": 6, "sources": {"prompt_lookup": {"nodes": 2, "min_match": 1}}}
    command = serve_command(
        target, port, "--speculative-config", json.dumps(spec),
        "--additional-config", json.dumps({"easyspec": {"tree": tree}}), max_num_seqs=16,
    )  # fmt: skip
    with serving(command, port, tmp_path / "serve.log"):
        model = str(target)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=180)
        results = asyncio.run(_load(client, model))
        assert _healthy(port)
        for result in results:
            if result["kind"] in ("greedy", "penalty"):
                assert result["text"] == expected[result["index"]], result
            if result["kind"] != "aborted":
                assert result["finish"] == "length", result  # nothing lost: all MAX_TOKENS tokens came

        sync = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        for bad, field in MALFORMED:
            try:
                sync.completions.create(model=model, prompt=PROMPTS[0], **({"max_tokens": 4} | bad))
            except openai.BadRequestError as error:
                assert error.status_code == 400 and field in str(error), str(error)
            else:
                raise AssertionError(f"{bad} was accepted")
        assert _healthy(port)
        again = sync.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert again.choices[0].text == expected[0]  # still serving, still exact

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0
    log = (tmp_path / "serve.log").read_text()
    assert "served without speculation" not in log  # penalties are applied per node (issue 62)
