"""EAGLE trainer unit tests on tiny random targets (no vLLM engine needed)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.eagle.eagle_helpers import train_args
from vllm_easyspec_train import checkpoint as ckpt
from vllm_easyspec_train.errors import HiddenSizeMismatchError, NotEnoughDataError, UnsupportedTargetError
from vllm_easyspec_train.trainer import epoch_batches, init_from_head, run_train_eagle, train


def _weights(d):
    return load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_train_writes_reference_layout_and_manifest(tmp_path, tiny_llama_dir, tiny_text_dir, fmt):
    extra = ["--draft-vocab-size", "40"] if fmt == "eagle3" else []
    train(train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir, fmt, extra))
    out = tmp_path / "h"
    w = _weights(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    if fmt == "eagle":
        assert w["fc.weight"].shape == (128, 256)
        assert "layers.0.self_attn.q_proj.weight" in w and not any(k.startswith("midlayer.") for k in w)
        assert "lm_head.weight" not in w and "embed_tokens.weight" not in w
    else:
        assert w["fc.weight"].shape == (128, 384)
        assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 256
        assert w["lm_head.weight"].shape == (40, 128) and cfg["draft_vocab_size"] == 40
        ids = torch.arange(40) + w["d2t"]
        assert torch.equal(w["t2d"].nonzero().flatten(), ids)
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert all(v.dtype == torch.bfloat16 for k, v in w.items() if k not in ("d2t", "t2d"))
    man = json.loads((out / "eagle_manifest.json").read_text())
    assert man["command"].startswith("vllm-easyspec train-eagle --target")
    assert man["data"]["sources"][0]["kind"] == "local-text"
    assert len(man["heldout"]["agreement"]) == 3 and man["training"]["steps"] == 6
    # the reader gets back the same tensors
    head = ckpt.load_head(out)
    again = ckpt.state_dict_reference(head)
    assert set(again) == set(w) and all(torch.equal(again[k], w[k]) for k in w)


def _padded(batches, lengths):
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def test_epoch_batches_cover_every_sequence_once_with_little_padding():
    g = torch.Generator().manual_seed(3)
    lengths = (torch.randint(20, 1200, (1001,), generator=g)).tolist()
    first = epoch_batches(lengths, 4, seed=0, epoch=0)
    assert sorted(i for b in first for i in b) == list(range(1001))
    assert all(1 <= len(b) <= 4 for b in first) and len(first) == 251
    assert first == epoch_batches(lengths, 4, seed=0, epoch=0)  # a resumed epoch sees the same batches
    assert first != epoch_batches(lengths, 4, seed=0, epoch=1)
    shuffled = torch.randperm(1001, generator=g).tolist()
    plain = [shuffled[a:a + 4] for a in range(0, 1001, 4)]
    assert _padded(first, lengths) < 1.1 * sum(lengths) < _padded(plain, lengths)
    # the batch order is not sorted by length: long and short batches interleave
    maxima = [max(lengths[i] for i in b) for b in first]
    assert maxima != sorted(maxima) and maxima != sorted(maxima, reverse=True)


def test_seed_determinism(tmp_path, tiny_llama_dir, tiny_text_dir):
    for run in ("a", "b"):
        train(train_args(tiny_llama_dir, tmp_path / run, tmp_path / "w", tiny_text_dir, "eagle3",
                         ["--draft-vocab-size", "40"]))
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    train(train_args(tiny_llama_dir, tmp_path / "c", tmp_path / "w", tiny_text_dir, "eagle3",
                     ["--draft-vocab-size", "40", "--seed", "1"]))
    c = _weights(tmp_path / "c")
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_resume_equals_uninterrupted(tmp_path, tiny_qwen2_dir, tiny_text_dir):
    train(train_args(tiny_qwen2_dir, tmp_path / "full", tmp_path / "w", tiny_text_dir, "eagle"))
    res = train(train_args(tiny_qwen2_dir, tmp_path / "int", tmp_path / "w", tiny_text_dir, "eagle",
                           ["--stop-after", "2"]))
    assert res["stopped"] == 2 and not (tmp_path / "int" / "model.safetensors").exists()
    assert torch.load(tmp_path / "int" / "train_state.pt", weights_only=False)["step"] == 2
    res = train(train_args(tiny_qwen2_dir, tmp_path / "int", tmp_path / "w", tiny_text_dir, "eagle", ["--resume"]))
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "int")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the manifest records both commands and the steps each ran
    stages = res["manifest"]["stages"]
    assert [(s["from_step"], s["to_step"]) for s in stages] == [(0, 2), (2, 6)]
    assert "--stop-after 2" in stages[0]["command"] and "--resume" in stages[1]["command"]
    # the tokens trained on carry across the resume: the same count as the uninterrupted run's
    full = json.loads((tmp_path / "full" / "eagle_manifest.json").read_text())["history"]
    assert [h["tokens_seen"] for h in res["manifest"]["history"]] == [h["tokens_seen"] for h in full]
    # 6 steps of up to 4 windows of 64 tokens (an epoch's one short batch may be among them)
    assert 0 < full[-1]["loss_tokens_seen"] <= full[-1]["tokens_seen"]
    assert full[-1]["tokens_seen"] % 64 == 0 and 5 * 4 * 64 < full[-1]["tokens_seen"] <= 6 * 4 * 64


def test_eagle_learns_on_tiny_target(tmp_path, tiny_llama_dir, tiny_text_dir):
    res = train(train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir, "eagle",
                           ["--max-steps", "30", "--eval-every", "30", "--lr", "2e-3"]))
    man = res["manifest"]
    last = man["history"][-1]["heldout"]
    assert last["agreement"][0] > 0.5, last
    assert last["accept_length_k"] > 1.5


def test_unsupported_architecture(tmp_path, tiny_moe_dir, tiny_text_dir, capsys):
    with pytest.raises(UnsupportedTargetError, match="MixtralForCausalLM"):
        train(train_args(tiny_moe_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir))
    assert run_train_eagle(train_args(tiny_moe_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir)) == 2
    assert "not supported" in capsys.readouterr().err


def test_too_little_data(tmp_path, tiny_llama_dir, tiny_text_dir):
    with pytest.raises(NotEnoughDataError, match="too little training data"):
        train(train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir, "eagle",
                         ["--text-tokens", "100"]))


def test_hidden_size_mismatch(tmp_path, tiny_llama_dir, tiny_text_dir):
    from dataclasses import replace

    from vllm_easyspec_train.model import EagleHead, head_config_from_target

    tcfg = json.loads((tiny_llama_dir / "config.json").read_text())
    narrow = replace(head_config_from_target(tcfg, "eagle"), hidden_size=64, intermediate_size=128,
                     num_attention_heads=2, num_key_value_heads=1)
    ckpt.save_head(EagleHead(narrow), tmp_path / "h64")
    with pytest.raises(HiddenSizeMismatchError, match="hidden size 64"):
        train(train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir, "eagle",
                         ["--init-from", str(tmp_path / "h64"), "--max-steps", "1"]))


def test_init_from_a_head_with_another_draft_vocabulary_keeps_the_new_one(tiny_llama_dir):
    from vllm_easyspec_train.model import EagleHead, head_config_from_target

    cfg = head_config_from_target(json.loads((tiny_llama_dir / "config.json").read_text()), "eagle3", 8)
    torch.manual_seed(0)
    src, head = EagleHead(cfg), EagleHead(cfg)
    src.set_draft_vocab(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]))
    head.set_draft_vocab(torch.tensor([5, 6, 7, 8, 20, 21, 22, 23]))
    target_lm = torch.randn(cfg.vocab_size, cfg.hidden_size)
    info = init_from_head(head, src, target_lm)
    assert info["shared_draft_tokens"] == 4
    assert torch.equal(head.draft_ids(), torch.tensor([5, 6, 7, 8, 20, 21, 22, 23]))
    assert torch.equal(head.lm_head.weight[:4], src.lm_head.weight[4:])  # tokens 5..8: src's trained rows
    assert torch.equal(head.lm_head.weight[4:], target_lm[[20, 21, 22, 23]])  # new tokens: the target's rows
    assert torch.equal(head.fc.weight, src.fc.weight) and torch.equal(head.norm.weight, src.norm.weight)
    wider = EagleHead(head_config_from_target(json.loads((tiny_llama_dir / "config.json").read_text()), "eagle3",
                                              8, intermediate_size=2 * cfg.intermediate_size))
    with pytest.raises(HiddenSizeMismatchError, match="intermediate_size"):
        init_from_head(wider, src, target_lm)
