"""Merging candidates from other sources into a drafted token tree (SpecInfer's merge-based construction;
docs/design.md, "Merged candidates: prompt lookup"): :func:`prompt_lookup` proposes the path that followed the
context's latest earlier n-gram match, and :func:`merge_path` follows the tree while the path's tokens are
already children (shared prefixes become one node) and appends the rest, at most ``max_new`` nodes.

Invariants: the merged tree keeps every node of the drafted tree at its index, new nodes come after them
(parents first), and siblings stay distinct tokens. Deterministic children verify exactly as top-k children, so
merging is lossless for trees drawn ``WITHOUT_REPLACEMENT``; a tree of i.i.d. draws cannot take them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prompt_lookup(history: Sequence[int] | np.ndarray, min_match: int, max_match: int, length: int) -> list[int]:
    """The up to ``length`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``history`` of ``max_match`` down to ``min_match`` tokens; empty if no such suffix occurred before. Cost:
    one vectorised pass over the history, then work per earlier occurrence of its last token."""
    if length < 1 or min_match < 1 or len(history) < 2:
        return []
    tokens = np.asarray(history, dtype=np.int64)
    total = len(tokens)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier occurrence of a suffix would end
    for size in range(min(max_match, total - 1), min_match - 1, -1):
        candidates = ends[ends >= size - 1]
        matches = np.ones(len(candidates), dtype=bool)
        for back in range(1, size):
            matches &= tokens[candidates - back] == tokens[total - 1 - back]
        hits = candidates[matches]
        if len(hits):
            end = int(hits[-1])  # the most recent
            return tokens[end + 1:end + 1 + length].tolist()
    return []


def merge_path(tokens: Sequence[int], parents: Sequence[int], path: Sequence[int],
               max_new: int) -> tuple[list[int], list[int], int]:
    """``(tokens, parents, nodes added)`` of the tree with ``path`` (tokens after the root) merged in."""
    tokens, parents = list(tokens), list(parents)
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, node)
    current, added = -1, 0
    for token in path:
        existing = children.get(current, {}).get(token)
        if existing is not None:
            current = existing
            continue
        if added >= max_new:
            break
        tokens.append(token)
        parents.append(current)
        current = len(tokens) - 1
        children.setdefault(parents[-1], {})[token] = current
        added += 1
    return tokens, parents, added
