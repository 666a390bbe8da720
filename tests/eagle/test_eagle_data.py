"""EAGLE training data: the held-out split is stable as data grows, and a grown data set
reuses the responses and features it already has (no vLLM engine needed)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from vllm_easyspec_train import data as eagle_data
from vllm_easyspec_train import features as eagle_features


def _seqs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"tokens": [rng.randrange(3, 64) for _ in range(rng.randrange(8, 20))], "loss_start": 0,
             "source": "t"} for _ in range(n)]


def test_heldout_split_is_stable_when_data_grows():
    base = _seqs(200, 0)
    tr1, va1 = eagle_data.split_heldout(base, 0.1, 0, 10)
    tr2, va2 = eagle_data.split_heldout(base + _seqs(200, 1), 0.1, 0, 10)
    key = lambda s: tuple(s["tokens"])  # noqa: E731
    assert {key(s) for s in va1} <= {key(s) for s in va2}
    assert {key(s) for s in tr1} <= {key(s) for s in tr2}
    assert 8 <= len(va1) <= 35  # about 10% of 200
    # a different seed draws a different split
    _, va3 = eagle_data.split_heldout(base, 0.1, 1, 10)
    assert {key(s) for s in va3} != {key(s) for s in va1}


def test_heldout_split_always_has_both_sides():
    tr, va = eagle_data.split_heldout(_seqs(3, 2), 0.0, 0, 10)
    assert len(va) == 1 and len(tr) == 2
    tr, va = eagle_data.split_heldout(_seqs(3, 2), 1.0, 0, 10)
    assert len(va) == 2 and len(tr) == 1


def test_self_distill_generates_only_new_prompts(tmp_path, monkeypatch, tiny_llama_dir):
    generated: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        prompts = json.loads(open(cmd[cmd.index("--prompts-json") + 1]).read())
        generated.append(prompts)
        with open(cmd[cmd.index("--out") + 1], "a") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p, "prompt_ids": [1, 2], "response_ids": [len(p), 5]}) + "\n")

        class Done:
            returncode = 0
            stdout = "EASYSPEC_GEN_INFO " + json.dumps({"n_prompts": len(prompts)})
            stderr = ""
        return Done()

    monkeypatch.setattr(eagle_data.subprocess, "run", fake_run)
    first, info1 = eagle_data.self_distill(str(tiny_llama_dir), ["a", "bb"], tmp_path, 16, 0)
    second, info2 = eagle_data.self_distill(str(tiny_llama_dir), ["a", "bb", "ccc"], tmp_path, 16, 0)
    assert generated == [["a", "bb"], ["ccc"]]
    assert info1["n_reused"] == 0 and info2["n_reused"] == 2
    rows = [json.loads(line) for line in open(second)]
    assert [r["prompt"] for r in rows] == ["a", "bb", "ccc"] and rows[2]["response_ids"] == [3, 5]
    # other settings (here max_new_tokens) never reuse
    eagle_data.self_distill(str(tiny_llama_dir), ["a"], tmp_path, 32, 0)
    assert generated[-1] == ["a"]


def test_features_of_a_grown_set_reuse_the_earlier_cache(tmp_path, monkeypatch, tiny_llama_dir):
    old, new = _seqs(4, 3), _seqs(3, 4)
    computed: list[int] = []
    real = eagle_features._extract_into

    def counting(target, seqs, todo, *a, **k):
        computed.extend(len(seqs[j]["tokens"]) for j in todo)
        return real(target, seqs, todo, *a, **k)

    monkeypatch.setattr(eagle_features, "_extract_into", counting)
    kw = {"aux_layer_ids": [1, 2], "dtype": "float32", "store_dtype": torch.float32, "log": lambda *a: None}
    a = eagle_features.extract(str(tiny_llama_dir), old, tmp_path, **kw)
    n_old = len(computed)
    grown = eagle_features.extract(str(tiny_llama_dir), new + old, tmp_path, **kw)
    assert n_old == 4 and sorted(computed[n_old:]) == sorted(len(s["tokens"]) for s in new)
    for i in range(4):
        assert torch.equal(grown.get(3 + i)["final"], a.get(i)["final"])
        assert torch.equal(grown.get(3 + i)["aux"], a.get(i)["aux"])
    # the reused features are the ones a fresh extraction gives
    fresh = eagle_features.extract(str(tiny_llama_dir), new + old, tmp_path / "fresh", **kw)
    for i in range(7):
        torch.testing.assert_close(fresh.get(i)["final"], grown.get(i)["final"], atol=1e-4, rtol=1e-4)


def test_an_interrupted_extraction_resumes_at_its_next_shard(tmp_path, monkeypatch, tiny_llama_dir):
    seqs = _seqs(9, 5)
    monkeypatch.setattr(eagle_features, "SHARD_TOKENS", 40)  # about 3 sequences a shard
    shards = eagle_features.shard_ranges(seqs, 40)
    assert len(shards) >= 3 and shards[0][0] == 0 and shards[-1][1] == 9
    assert all(a < b for a, b in shards) and all(b == a2 for (_, b), (a2, _) in zip(shards, shards[1:]))
    computed: list[int] = []
    real = eagle_features._extract_into

    class Interrupted(Exception):
        pass

    def failing_on_second_shard(target, shard_seqs, todo, *a, **k):
        if computed:
            raise Interrupted
        computed.extend(len(shard_seqs[j]["tokens"]) for j in todo)
        return real(target, shard_seqs, todo, *a, **k)

    kw = {"aux_layer_ids": [1, 2], "dtype": "float32", "store_dtype": torch.float32, "log": lambda *a: None}
    monkeypatch.setattr(eagle_features, "_extract_into", failing_on_second_shard)
    with pytest.raises(Interrupted):
        eagle_features.extract(str(tiny_llama_dir), seqs, tmp_path, **kw)
    assert not list(tmp_path.glob("features-*/meta.json"))  # an interrupted cache is never taken as complete
    first = len(computed)

    def counting(target, shard_seqs, todo, *a, **k):
        computed.extend(len(shard_seqs[j]["tokens"]) for j in todo)
        return real(target, shard_seqs, todo, *a, **k)

    monkeypatch.setattr(eagle_features, "_extract_into", counting)
    resumed = eagle_features.extract(str(tiny_llama_dir), seqs, tmp_path, **kw)
    a, b = shards[0]
    assert first == b - a and len(computed) == len(seqs)  # the first shard was not extracted again
    assert len(list(resumed.path.glob("shard-*.pt"))) == len(shards)
    fresh = eagle_features.extract(str(tiny_llama_dir), seqs, tmp_path / "fresh", **kw)
    for i in range(len(seqs)):
        assert resumed.get(i)["tokens"].tolist() == seqs[i]["tokens"] and resumed.sequence_length(i) == len(seqs[i]["tokens"])
        for name in ("final", "aux", "top1"):
            torch.testing.assert_close(resumed.get(i)[name], fresh.get(i)[name], atol=1e-4, rtol=1e-4)
