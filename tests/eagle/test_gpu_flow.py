"""The pieces of the GPU head-training flow that run without a GPU: the trainer on a second device (the
stand-in of ``fake_device``, which refuses every host/device mix CUDA refuses), features kept in memory,
both generation rounds with one engine, deadlines."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.eagle.eagle_helpers import train_args
from tests.fake_device import on_host, second_device
from vllm_easyspec_train.trainer import fit_steps, train


def _weights(d):
    return load_file(str(d / "model.safetensors"))


def test_training_on_a_second_device_gives_the_host_run_s_head(tmp_path, tiny_llama_dir, tiny_text_dir):
    common = ["--draft-vocab-size", "40", "--feature-store", "memory", "--max-steps", "4", "--eval-every", "2"]
    host = train(train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir, "eagle3", common))
    with second_device() as device:
        dev = train(train_args(tiny_llama_dir, tmp_path / "d", tmp_path / "w2", tiny_text_dir, "eagle3",
                               [*common, "--device", str(device)]))
    a, b = _weights(tmp_path / "h"), _weights(tmp_path / "d")
    assert set(a) == set(b) and all(on_host(b[k]).dtype == a[k].dtype for k in a)
    # the same values up to rounding: ops that run fused on the host (the target's attention) run
    # decomposed on the stand-in device, so the features differ in their last bits
    assert torch.equal(a["d2t"], on_host(b["d2t"])) and torch.equal(a["t2d"], on_host(b["t2d"]))
    for k in set(a) - {"d2t", "t2d"}:
        scale = a[k].float().abs().max()
        assert (a[k].float() - on_host(b[k]).float()).abs().max() <= 2 * 2**-7 * scale, k  # 2 bf16 steps
    assert json.loads((tmp_path / "d" / "config.json").read_text()) == json.loads(
        (tmp_path / "h" / "config.json").read_text())
    assert abs(dev["heldout"]["agreement"][0] - host["heldout"]["agreement"][0]) <= 0.05
    assert dev["manifest"]["training"]["device"] == "meta"
    assert dev["manifest"]["data"]["feature_cache"] == "memory:meta"
    assert not list((tmp_path / "w2").glob("features-*"))  # the memory store writes nothing


def test_fit_steps_keeps_a_run_inside_its_time():
    assert fit_steps(10, 1000, seconds_left=50.0, step_seconds=0.5) == 10 + 90
    assert fit_steps(10, 50, seconds_left=50.0, step_seconds=0.5) == 50  # the plan fits: unchanged
    assert fit_steps(10, 1000, seconds_left=-3.0, step_seconds=0.5) == 11  # at least one more step
    # an evaluation of 5 s every 10 steps costs 0.5 s a step more
    assert fit_steps(10, 1000, seconds_left=50.0, step_seconds=0.5, eval_every=10, eval_seconds=5.0) == 10 + 45


def test_a_time_budget_cuts_the_steps_and_still_writes_the_head(tmp_path, tiny_llama_dir, tiny_text_dir):
    import time

    extra = ["--draft-vocab-size", "40", "--feature-store", "memory", "--max-steps", "100000", "--eval-every", "50",
             "--time-budget", "8"]
    t0 = time.time()
    res = train(train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir, "eagle3", extra))
    training = res["manifest"]["training"]
    # fitted after the calibration steps, or stopped at the deadline on a machine slower than it measured
    assert training["planned_steps"] == 100000 and training["steps"] < 100000
    assert training["steps"] in (training.get("steps_fitted"), training.get("stopped_at_deadline"))
    assert training["time_budget"] == 8 and (tmp_path / "h" / "model.safetensors").exists()
    assert res["heldout"]["n_positions"] > 0
    assert time.time() - t0 < 8 + 15  # the budget, plus loading the target and its embeddings


class _StandInLLM:
    """What ``generate.answer_prompts`` uses of ``vllm.LLM``: a tokenizer without a chat template, and
    ``generate`` answering each prompt with ``max_tokens`` ids and a text naming its prompt length."""

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [len(w) % 50 + 3 for w in text.split()]}

    def __init__(self):
        self.calls: list[int] = []

    def get_tokenizer(self):
        return self.Tok()

    def generate(self, reqs, sp, use_tqdm=True):
        import types

        self.calls.append(len(reqs))
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
            token_ids=[7] * sp.max_tokens, text=f"answer to {len(r['prompt_token_ids'])} ids",
            finish_reason="length")]) for r in reqs]


def _stand_in_vllm(monkeypatch):
    import sys
    import types

    class SamplingParams:
        def __init__(self, temperature, max_tokens, seed):
            self.max_tokens = max_tokens

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=SamplingParams))


def _items():
    from vllm_easyspec_train.corpus import CorpusItem

    def item(text, followup=None):
        return CorpusItem("followup" if followup else "explain", ({"role": "user", "content": text},), "r", "p",
                          "s", followup=followup)

    return [item("Explain the sort helper please"), item("What does this module do"),
            item("Explain the sort helper please", "Now write tests for it."), item("Refactor the parser"),
            item("What does this module do", "Can you make it faster?")]


def test_both_rounds_with_one_engine_leave_the_data_stage_nothing_to_generate(tmp_path, monkeypatch):
    from vllm_easyspec_train import data as D
    from vllm_easyspec_train.generate import answer_corpus_items

    _stand_in_vllm(monkeypatch)
    llm, items = _StandInLLM(), _items()
    part = D.part_path(tmp_path, "/some/target", 4, 0, "bfloat16")
    info = answer_corpus_items(llm, items, str(part), max_tokens=4, chunk_size=2)
    assert info["round1"]["n_answered"] == 3 and info["round2"]["n_answered"] == 2 and llm.calls == [2, 1, 2]

    def no_generation(*a, **k):
        raise AssertionError("the data stage generated again")

    jl, dinfo = D.self_distill_items("/some/target", items, tmp_path, 4, 0, "bfloat16", lambda *a: None,
                                     generate_fn=no_generation)
    records = [json.loads(line) for line in jl.read_text().splitlines()]
    assert len(records) == 5 and dinfo["round2"]["n_prompts"] == 2
    first = {r["prompt"]: r["response_text"] for r in records if isinstance(r["prompt"], str)}
    second = [r["prompt"] for r in records if isinstance(r["prompt"], list)]
    # round 2 follows the target's own first answers
    assert [(m[0]["content"], m[1]["content"], m[2]["content"]) for m in second] == [
        ("Explain the sort helper please", first["Explain the sort helper please"], "Now write tests for it."),
        ("What does this module do", first["What does this module do"], "Can you make it faster?")]


def test_generation_stops_at_its_deadline_and_keeps_what_it_answered(tmp_path, monkeypatch):
    import time

    from vllm_easyspec_train import data as D
    from vllm_easyspec_train.generate import answer_corpus_items

    _stand_in_vllm(monkeypatch)
    llm = _StandInLLM()
    part = tmp_path / "part.jsonl"
    info = answer_corpus_items(llm, _items(), str(part), max_tokens=4, chunk_size=2, deadline=time.time() - 1)
    assert info["round1"]["stopped_at_deadline"] and info["n_response_tokens"] == 0 and not llm.calls
    # later, with time: only the missing prompts are asked
    info = answer_corpus_items(llm, _items(), str(part), max_tokens=4, chunk_size=2)
    assert info["round1"]["n_prompts"] == 3 and len(D.read_part(part)) == 5
    again = answer_corpus_items(llm, _items(), str(part), max_tokens=4, chunk_size=2)
    assert again["round1"]["n_prompts"] == 0 and again["round2"]["n_prompts"] == 0


def test_the_head_and_the_answers_come_back_in_pieces_and_unpack_checks_them(tmp_path):
    import argparse
    import os

    import pytest

    from vllm_easyspec_train import gpu_flow as G

    head = tmp_path / "head"
    head.mkdir()
    weights = os.urandom(50_000)
    (head / "model.safetensors").write_bytes(weights)
    (head / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (head / "train_state.pt").write_bytes(b"resume state: stays on the device")
    out = tmp_path / "out"
    out.mkdir()
    pieces = G.pack_head(head, out, piece_bytes=16_384)
    assert len(pieces) == 4 and all(p["bytes"] <= 16_384 for p in pieces)
    part = tmp_path / "part.jsonl"
    part.write_text('{"prompt": "a", "prompt_ids": [1], "response_ids": [2], "response_text": "b"}\n{"cut sh')
    exported = G.export_answers(part, out / G.DATA_FILE)
    assert exported["records"] == 1  # a line cut short is not exported
    flow = {"pieces": {"head": pieces, "data": [{"name": G.DATA_FILE, "bytes": exported["bytes"],
                                                  "sha256": G._sha256_file(out / G.DATA_FILE)}]}}
    (out / G.FLOW_JSON).write_text(json.dumps(flow))
    dest = tmp_path / "heads" / "new"
    G.unpack(argparse.Namespace(files=str(out), head=str(dest), corpus_manifest=None))
    assert (dest / "model.safetensors").read_bytes() == weights and not (dest / "train_state.pt").exists()
    assert json.loads((dest / "gpu_flow.json").read_text()) == flow
    again = tmp_path / "again.jsonl"
    assert G.import_answers(dest / G.DATA_FILE, again) == 1 and again.read_text() == part.read_text().split("{\"cut")[0]
    damaged = bytearray((out / pieces[1]["name"]).read_bytes())
    damaged[7] ^= 1
    (out / pieces[1]["name"]).write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="part01"):
        G.unpack(argparse.Namespace(files=str(out), head=str(tmp_path / "other"), corpus_manifest=None))


def _run_args(tmp_path, target, corpus, data, extra=()):
    from vllm_easyspec_train import gpu_flow as G

    p = __import__("argparse").ArgumentParser()
    G._add_run_arguments(p)
    return p.parse_args(["--target", str(target), "--corpus", str(corpus), "--out", str(tmp_path / "out"),
                         "--work", str(tmp_path / "work"), "--device", "cpu", "--data", str(data),
                         "--budget", "300", *extra])


def test_the_flow_trains_from_answers_of_an_earlier_window_and_returns_the_head(tmp_path, monkeypatch,
                                                                              tiny_llama_dir):
    """``gpu_flow run --data`` (the second of two windows) end to end without vLLM: the answers come from
    the stand-in engine, the trainer runs on the tiny target, the head comes back in pieces and unpacks."""
    import argparse

    from vllm_easyspec_train import gpu_flow as G
    from vllm_easyspec_train.corpus import Corpus, items_sha256
    from vllm_easyspec_train.generate import answer_corpus_items

    _stand_in_vllm(monkeypatch)
    items = _items()
    corpus = tmp_path / "corpus.jsonl.gz"
    Corpus(items, {"items_sha256": items_sha256(items), "seed": 0}).write_jsonl(corpus)
    part = tmp_path / "window1.part.jsonl"
    answer_corpus_items(_StandInLLM(), items, str(part), max_tokens=40, chunk_size=2)
    G.export_answers(part, tmp_path / "answers.jsonl.xz")
    window1 = _run_args(tmp_path / "w1", tiny_llama_dir, corpus, tmp_path / "answers.jsonl.xz", ["--stop-after-data"])
    assert G.run(window1) == 0
    flow1 = json.loads((tmp_path / "w1" / "out" / G.FLOW_JSON).read_text())
    assert flow1["phases"]["import"]["records"] == 5 and flow1["corpus"]["items_answered"] == 5
    assert "train" not in flow1["phases"] and not flow1["pieces"].get("head")

    window2 = _run_args(tmp_path, tiny_llama_dir, corpus, tmp_path / "answers.jsonl.xz", [
        "--text-tokens", "0", "--seq-len", "64", "--max-steps", "4", "--eval-every", "2", "--batch-size", "2",
        "--draft-vocab-size", "40", "--head-intermediate-size", "64", "--min-train-tokens", "50", "--threads", "2",
        "--feature-batch-tokens", "512"])
    assert G.run(window2) == 0
    flow = json.loads((tmp_path / "out" / G.FLOW_JSON).read_text())
    train = flow["phases"]["train"]
    assert train["training"]["steps"] == 4 and train["training"]["device"] == "cpu"
    assert train["heldout"]["n_positions"] > 0 and flow["pieces"]["head"]
    G.unpack(argparse.Namespace(files=str(tmp_path / "out"), head=str(tmp_path / "heads" / "new"),
                                corpus_manifest=None))
    head = tmp_path / "heads" / "new"
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 40
    manifest = json.loads((head / "eagle_manifest.json").read_text())
    src = manifest["data"]["sources"][0]
    assert src["prompt_set"] == "file:corpus-answered.jsonl.gz" and src["n_sequences"] == 5
    assert src["generation_info"]["round1"]["n_reused"] + src["generation_info"]["round1"]["n_resumed"] == 3
