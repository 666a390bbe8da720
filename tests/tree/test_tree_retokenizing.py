"""Bridging vocabularies by text (``tree.retokenize``): token bytes, re-encoding drafted trees into target
trees, and the draft's view of target tokens it lacks (pure, no engine)."""

from __future__ import annotations

import pytest
import torch

from vllm_easyspec.tree.retokenizing import (
    TreeRetokenizer,
    approximate_target_to_draft,
    complete_text,
    token_bytes,
)


def longest_match_encoder(vocab: dict[str, int]):
    """Texts -> ids, each step taking the longest vocabulary piece that matches (like BPE on these strings)."""
    def encode(texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            ids, at = [], 0
            while at < len(text):
                piece = max((p for p in vocab if text.startswith(p, at)), key=len)
                ids.append(vocab[piece])
                at += len(piece)
            out.append(ids)
        return out

    return encode


# A toy target vocabulary.
TARGET = {"):\n": 10, "):": 11, "\n": 12, "  ": 13, "x": 14, "  x": 15, ")": 16, ":": 17, " ": 18, "é": 19}
SPECIAL_EOS = 99
encode_target = longest_match_encoder(TARGET)


# Draft vocabulary: 0 is a special end-of-text token, 5 a special token without a target counterpart.
DRAFT_BYTES = [None, b"):", b"\n", b"  ", b"x", None, "é".encode()[:1], "é".encode()[1:]]


def retokenizer() -> TreeRetokenizer:
    return TreeRetokenizer(DRAFT_BYTES, {0: SPECIAL_EOS}, encode_target)


def test_a_drafted_chain_becomes_the_target_tokens_of_its_text_with_provisional_ends_last():
    # draft "):" "\n" "  " "x" reads "):\n  x", which the target writes "):\n" "  x"
    tokens, parents = retokenizer().retokenize([1, 2, 3, 4], [-1, 0, 1, 2], max_nodes=8)
    # first: each leaf's whole encoding, inner nodes without their last (provisional) token: "):\n" -> "  x";
    # then the inner nodes' last tokens: "):" (a sibling of "):\n") and "  " (a sibling of "  x")
    assert tokens == [10, 15, 11, 13]
    assert parents == [-1, 0, -1, 0]


def test_cutting_the_node_count_keeps_a_tree_and_the_best_paths_first():
    tokens, parents = retokenizer().retokenize([1, 2, 3, 4], [-1, 0, 1, 2], max_nodes=2)
    assert (tokens, parents) == ([10, 15], [-1, 0])
    assert retokenizer().retokenize([1, 2], [-1, 0], max_nodes=0) == ([], [])


def test_branches_share_prefixes_and_siblings_stay_distinct():
    # root children "):" and "x"; "):" has children "\n" and "  "
    tokens, parents = retokenizer().retokenize([1, 4, 2, 3], [-1, -1, 0, 0], max_nodes=16)
    texts = {token: text for text, token in TARGET.items()}
    paths = set()
    for node in range(len(tokens)):
        path, at = [], node
        while at >= 0:
            path.append(texts[tokens[at]])
            at = parents[at]
        paths.add("".join(reversed(path)))
    assert paths == {"):\n", "):  ", "x", "):"}
    for parent in set(parents):
        siblings = [tokens[i] for i in range(len(tokens)) if parents[i] == parent]
        assert len(siblings) == len(set(siblings))
    assert all(parent < node for node, parent in enumerate(parents))


def test_special_tokens_end_a_path_and_unmapped_ones_are_dropped():
    # "x" then end-of-text (maps to the target's eos), then "x" below it: nothing continues past the eos
    tokens, parents = retokenizer().retokenize([4, 0, 4], [-1, 0, 1], max_nodes=8)
    assert (tokens, parents) == ([14, SPECIAL_EOS], [-1, 0])
    # special token 5 has no target counterpart: it and everything below it give no nodes
    assert retokenizer().retokenize([5, 4, 4], [-1, 0, -1], max_nodes=8) == ([14], [-1])


def test_a_token_ending_inside_a_character_waits_for_the_rest():
    # the two bytes of "é" are two draft tokens; the first alone is no text
    assert complete_text("é".encode()[:1]) == ""
    tokens, parents = retokenizer().retokenize([6, 7], [-1, 0], max_nodes=8)
    assert (tokens, parents) == ([19], [-1])


def test_encodings_are_cached_by_text():
    calls: list[list[str]] = []

    def counting(texts: list[str]) -> list[list[int]]:
        calls.append(texts)
        return encode_target(texts)

    bridge = TreeRetokenizer(DRAFT_BYTES, {}, counting)
    bridge.retokenize([1, 2], [-1, 0], 4)
    bridge.retokenize([1, 2], [-1, 0], 4)
    assert calls == [["):", "):\n"]]


def test_target_tokens_the_draft_lacks_reach_it_as_their_last_draft_token():
    encode_draft = longest_match_encoder({"):": 1, "\n": 2, "  ": 3, "x": 4})
    target_bytes = [b"):\n", b"  x", b"x", None]
    table = torch.tensor([-1, -1, 4, -1])  # target 2 ("x") is shared; 3 is special
    assert approximate_target_to_draft(table, target_bytes, encode_draft) == 2
    assert table.tolist() == [2, 4, 4, -1]


def test_token_bytes_reads_byte_level_bpe_and_sentencepiece_vocabularies():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["def f(x):\n    return x + 1\n", "naïve café\t tab"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    table = token_bytes(fast)
    assert table[fast.eos_token_id] is None
    for index in range(len(fast)):
        if table[index] is not None:
            assert fast.decode([index]).encode() == table[index] or not table[index].isascii()
    text = "naïve café\t tab"
    assert b"".join(table[i] for i in fast.encode(text)) == text.encode()

    class SentencePieceLike:
        all_special_ids = [0]

        def get_vocab(self):
            return {"<s>": 0, "\u2581the": 1, "cat": 2, "<0x0A>": 3}

        def __len__(self):
            return 4

    assert token_bytes(SentencePieceLike()) == [None, b" the", b"cat", b"\n"]


def test_token_bytes_refuses_a_vocabulary_without_byte_text(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="neither a byte-level BPE nor a SentencePiece tokenizer.*remove retokenize"):
        token_bytes(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
