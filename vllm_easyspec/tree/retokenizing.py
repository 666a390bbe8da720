"""Bridging a draft and a target with different vocabularies by text, not by shared token ids (docs/design.md,
"Trees across vocabularies, bridged by text").

:class:`TreeRetokenizer` re-encodes the text of each drafted node's path with the target's tokenizer and merges
the encodings into one target-vocabulary tree (a trie); the candidates depend only on the drafted tree, so they
verify exactly as top-k children. :func:`approximate_target_to_draft` feeds a target token the draft lacks as the
last token of the draft's own encoding of its text. Token texts are bytes (:func:`token_bytes`): byte-level BPE
through the GPT-2 byte alphabet, SentencePiece through ``▁`` and ``<0xNN>`` pieces.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

SENTENCEPIECE_SPACE = "\u2581"

Encoder = Callable[[list[str]], list[list[int]]]


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for every byte, inverted: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}


def _vocabulary_kind(tokenizer, pieces: list[str]) -> str | None:
    """``"byte_level"``, ``"sentencepiece"`` or None, from a fast tokenizer's decoder (else from its pieces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "sentencepiece" if any(piece.startswith(SENTENCEPIECE_SPACE) for piece in pieces) else None
    decoder = backend.decoder
    state = "" if decoder is None else json.dumps(json.loads(decoder.__getstate__()), ensure_ascii=False)
    if '"ByteLevel"' in state:
        return "byte_level"
    if "ByteFallback" in state or "Metaspace" in state or SENTENCEPIECE_SPACE in state:
        return "sentencepiece"
    return None


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each token id of ``tokenizer`` stands for; None for special tokens (and unused ids).

    Raises ValueError for a vocabulary that is neither byte-level BPE nor SentencePiece."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_ids", ()))
    table: list[bytes | None] = [None] * max(len(tokenizer), max(vocab.values()) + 1)
    ordinary = {piece: index for piece, index in vocab.items() if index not in special}
    kind = _vocabulary_kind(tokenizer, list(ordinary))
    if kind == "byte_level":
        alphabet = _byte_level_alphabet()
        for piece, index in ordinary.items():
            if all(character in alphabet for character in piece):
                table[index] = bytes(alphabet[character] for character in piece)
            else:  # an added token written as plain text
                table[index] = piece.encode()
        return table
    if kind == "sentencepiece":
        for piece, index in ordinary.items():
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table[index] = bytes([int(piece[3:5], 16)])
            else:
                table[index] = piece.replace(SENTENCEPIECE_SPACE, " ").encode()
        return table
    raise ValueError(f"{type(tokenizer).__name__} is neither a byte-level BPE nor a SentencePiece "
                     "tokenizer, so its tokens' text is unknown; tree.retokenize needs one of those for the "
                     "draft and the target; remove retokenize")


def complete_text(data: bytes) -> str:
    """``data`` decoded as UTF-8 up to its last complete character (a token may end inside one)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


class TreeRetokenizer:
    """Draft-vocabulary trees to target-vocabulary trees through their text (see the module docstring).

    ``draft_bytes[i]``: the text bytes of draft token ``i``, None for special tokens; ``special_to_target``:
    the target id of each special draft token that has one (an end-of-text token); ``encode_target``:
    texts -> target token ids, without special tokens added. Invariant of the result: parents come first,
    siblings are distinct, and every root-to-node path is a prefix of the target encoding of some drafted
    node's path text (followed by that node's special token, where it is one)."""

    def __init__(self, draft_bytes: Sequence[bytes | None], special_to_target: dict[int, int],
                 encode_target: Encoder, cache_size: int = 1 << 16) -> None:
        self.draft_bytes = draft_bytes
        self.special_to_target = special_to_target
        self.encode_target = encode_target
        self._cache: dict[str, list[int]] = {}
        self._cache_size = cache_size

    def _encode(self, texts: list[str]) -> list[list[int]]:
        missing = sorted({text for text in texts if text and text not in self._cache})
        if missing:
            if len(self._cache) + len(missing) > self._cache_size:
                self._cache.clear()
            self._cache.update(zip(missing, self.encode_target(missing), strict=True))
        return [self._cache[text] if text else [] for text in texts]

    def _path_encodings(self, tokens: Sequence[int], parents: Sequence[int]) -> list[list[int] | None]:
        """Per draft node, the target ids of its path, or None where the path cannot continue (below a
        special token)."""
        path_bytes: list[bytes | None] = []
        ends_special: list[int | None] = []
        for token, parent in zip(tokens, parents, strict=True):
            prefix = b"" if parent < 0 else path_bytes[parent]
            blocked = prefix is None or (parent >= 0 and ends_special[parent] is not None)
            piece = self.draft_bytes[token] if 0 <= token < len(self.draft_bytes) else None
            if blocked or (piece is None and token not in self.special_to_target):
                path_bytes.append(None)
                ends_special.append(None)
            elif piece is None:
                path_bytes.append(prefix)
                ends_special.append(self.special_to_target[token])
            else:
                path_bytes.append(prefix + piece)
                ends_special.append(None)
        texts = [complete_text(data) if data is not None else "" for data in path_bytes]
        encoded = self._encode(texts)
        result: list[list[int] | None] = []
        for data, special, ids in zip(path_bytes, ends_special, encoded, strict=True):
            if data is None:
                result.append(None)
            else:
                result.append(ids + [special] if special is not None else list(ids))
        return result

    def retokenize(self, tokens: Sequence[int], parents: Sequence[int], max_nodes: int) -> tuple[list[int], list[int]]:
        """The target tree (tokens, parents) of one drafted tree, at most ``max_nodes`` nodes.

        The last target token of an inner node's path is provisional (its children's text may merge into
        it: ``"):"`` becomes ``"):\\n"``), so it comes second: first every leaf's whole encoding and every
        inner node's encoding without its last token, in the drafted nodes' order (cutting that order short
        keeps the best nodes' paths), then the inner nodes' last tokens while nodes remain."""
        has_children = [False] * len(tokens)
        for parent in parents:
            if parent >= 0:
                has_children[parent] = True
        encodings = self._path_encodings(tokens, parents)
        out_tokens: list[int] = []
        out_parents: list[int] = []
        children: dict[int, dict[int, int]] = {}

        def insert(path: Sequence[int]) -> None:
            current = -1
            for token in path:
                node = children.setdefault(current, {}).get(token)
                if node is None:
                    if len(out_tokens) >= max_nodes:
                        return
                    node = len(out_tokens)
                    out_tokens.append(token)
                    out_parents.append(current)
                    children[current][token] = node
                current = node

        for path, inner in zip(encodings, has_children, strict=True):
            if path:
                insert(path[:-1] if inner else path)
        for path, inner in zip(encodings, has_children, strict=True):
            if path and inner:
                insert(path)
        return out_tokens, out_parents


def approximate_target_to_draft(target_to_draft: torch.Tensor, target_bytes: Sequence[bytes | None],
                                encode_draft: Encoder) -> int:
    """Fill the ``-1`` entries of ``target_to_draft`` (target ids the draft vocabulary lacks) with the last
    token of the draft's encoding of their text, in place; returns how many were filled. Special and
    textless tokens stay ``-1``."""
    missing = [index for index in (target_to_draft == -1).nonzero().flatten().tolist()
               if index < len(target_bytes) and target_bytes[index]]
    texts = [complete_text(target_bytes[index]) for index in missing]
    kept = [(index, text) for index, text in zip(missing, texts, strict=True) if text]
    encoded = encode_draft([text for _, text in kept]) if kept else []
    filled = 0
    for (index, _), ids in zip(kept, encoded, strict=True):
        if ids:
            target_to_draft[index] = ids[-1]
            filled += 1
    return filled
