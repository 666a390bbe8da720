"""Prompt lookup and merging a source's path into a drafted tree (pure, no engine)."""

from __future__ import annotations

import random

import torch

from vllm_easyspec.tree.building import ChildDrawMode, TokenTreeBatch
from vllm_easyspec.tree.merging import merge_path, prompt_lookup
from vllm_easyspec.tree.sampling import tree_rejection_sample


def test_prompt_lookup_takes_the_longest_suffix_and_its_most_recent_occurrence():
    history = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    # suffix [6, 7] occurs at 1 and at 6; the most recent is followed by 3, 4
    assert prompt_lookup(history, 1, 3, 3) == [3, 4, 6]
    # a longer suffix wins over a more recent shorter one: [9, 6, 7] occurs once, at 5
    assert prompt_lookup([9, 6, 7, 8, 8, 6, 7, 1, 9, 6, 7], 1, 3, 2) == [8, 8]
    assert prompt_lookup(history, 3, 3, 2) == []  # [4, 6, 7] never occurred before
    assert prompt_lookup([1, 2, 3], 1, 2, 4) == []
    assert prompt_lookup([1, 2, 1], 1, 2, 4) == [2, 1]  # the continuation may run into the suffix itself
    assert prompt_lookup([4], 1, 2, 2) == [] and prompt_lookup([1, 1], 1, 2, 0) == []


def _lookup_by_scanning(history: list[int], min_match: int, max_match: int, length: int) -> list[int]:
    """prompt_lookup's definition, word for word: every suffix size, every earlier start, most recent first."""
    total = len(history)
    for size in range(min(max_match, total - 1), min_match - 1, -1):
        for start in range(total - size - 1, -1, -1):
            if history[start:start + size] == history[total - size:]:
                return history[start + size:start + size + length]
    return []


def test_prompt_lookup_agrees_with_its_definition_on_random_histories():
    generator = random.Random(0)
    for _ in range(500):
        history = [generator.randrange(4) for _ in range(generator.randrange(1, 40))]
        low = generator.randrange(1, 4)
        high, length = generator.randrange(low, 6), generator.randrange(1, 6)
        assert prompt_lookup(history, low, high, length) == _lookup_by_scanning(history, low, high, length)


def test_merge_follows_shared_prefixes_and_appends_the_rest():
    tokens, parents = [10, 11, 12, 13], [-1, -1, 0, 0]  # root -> 10 (-> 12, 13), 11
    merged, merged_parents, added = merge_path(tokens, parents, [10, 13, 20, 21], max_new=4)
    assert merged == [10, 11, 12, 13, 20, 21] and merged_parents == [-1, -1, 0, 0, 3, 4] and added == 2
    merged, merged_parents, added = merge_path(tokens, parents, [30, 31, 32], max_new=2)
    assert merged[4:] == [30, 31] and merged_parents[4:] == [-1, 4] and added == 2
    assert merge_path(tokens, parents, [10, 12], max_new=3) == (tokens, parents, 0)
    assert merge_path([], [], [7, 8], max_new=1) == ([7], [-1], 1)


def test_a_merged_tree_verifies_greedily_along_the_source_path():
    """The target's greedy path is the source's path: the merged tree accepts all of it, the drafted tree
    alone only its first token."""
    tokens, parents, _ = merge_path([3, 4], [-1, 0], [3, 5, 6], max_new=2)  # 3 -> 4 | 3 -> 5 -> 6
    vocab = 8
    greedy = {-1: 3, 0: 5, 1: 0, 2: 6, 3: 2}  # next token the target prefers after each node (-1: root)
    logits = torch.full((1, len(tokens) + 1, vocab), -5.0)
    for node, token in greedy.items():
        logits[0, node + 1, token] = 5.0
    tree = TokenTreeBatch(
        tokens=torch.tensor([tokens]), parents=torch.tensor([parents]), num_nodes=torch.tensor([len(tokens)]),
        draw_mode=ChildDrawMode.WITHOUT_REPLACEMENT,
    )
    result = tree_rejection_sample(tree, logits, temperature=torch.zeros(1), output_width=len(tokens) + 1)
    assert result.output_token_ids[0, :4].tolist() == [3, 5, 6, 2]
    assert int(result.num_accepted[0]) == 3
