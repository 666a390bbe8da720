"""Tree structure and builders: hand-written expectations and the documented errors."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tree.tree_views import (
    StaticTreeBuilder,
    is_leaf,
    node_positions,
    root_to_leaf_paths,
    verify_layout,
)
from vllm_easyspec.tree.building import (
    MAX_TREE_NODES,
    ChildDrawMode,
    DynamicTopKTreeBuilder,
    StaticTreeTemplate,
    TokenTreeBatch,
)

# request 0: root -> n0 -> n2 -> n4 ; root -> n1 -> n3      request 1: root -> n0, root -> n1 -> n2 (+ 2 pads)
TOKENS = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]])
PARENTS = torch.tensor([[-1, -1, 0, 1, 2], [-1, -1, 1, 0, 0]])


def _ragged() -> TokenTreeBatch:
    return TokenTreeBatch(TOKENS, PARENTS, torch.tensor([5, 3]), ChildDrawMode.WITHOUT_REPLACEMENT)


def test_derived_fields_of_a_ragged_batch():
    tree = _ragged()
    assert tree.depth.tolist() == [[1, 1, 2, 2, 3], [1, 1, 2, 0, 0]]
    assert tree.max_depth == 3
    assert tree.tokens[1].tolist() == [20, 21, 22, -1, -1]  # padding normalised
    assert node_positions(tree, torch.tensor([100, 7])).tolist() == [[101, 101, 102, 102, 103], [8, 8, 9, -1, -1]]
    assert tree.ancestors[0].tolist() == [[0, -1, -1], [1, -1, -1], [0, 2, -1], [1, 3, -1], [0, 2, 4]]
    assert root_to_leaf_paths(tree).tolist() == [[[1, 3, -1], [0, 2, 4]], [[0, -1, -1], [1, 2, -1]]]
    assert is_leaf(tree).tolist() == [[False, False, False, True, True], [True, False, True, False, False]]
    mask = tree.ancestor_mask()
    assert mask[0].int().tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 1, 0, 1, 0],
                                      [1, 0, 1, 0, 1]]
    assert not mask[1, 3:].any()
    children = tree.children_table()
    assert children[0].tolist() == [[0, 1], [2, -1], [3, -1], [4, -1], [-1, -1], [-1, -1]]
    assert children[1, :3].tolist() == [[0, 1], [-1, -1], [2, -1]]


def test_verify_layout_is_linear_in_slots_and_tree_in_positions():
    layout = verify_layout(_ragged(), torch.tensor([100, 7]))
    assert layout.cu_query_lens.tolist() == [0, 6, 10]
    assert layout.parents.tolist() == [-1, 0, 0, 1, 2, 3, -1, 0, 0, 2]
    assert layout.positions.tolist() == [100, 101, 101, 102, 102, 103, 7, 8, 8, 9]
    assert layout.query_tokens_without_root.tolist() == [10, 11, 12, 13, 14, 20, 21, 22]
    assert layout.ancestor_mask.shape == (10, 6)
    assert layout.ancestor_mask[5].int().tolist() == [1, 1, 0, 1, 0, 1]  # n4: root, n0, n2, itself


def test_tree_batch_errors_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"parents\[0, 1\] = 2: a node's parent must come before it"):
        TokenTreeBatch(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 2, 0]]), torch.tensor([3]),
                       "without_replacement")
    with pytest.raises(ValueError, match="empty"):
        TokenTreeBatch(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long),
                       torch.tensor([0]), "without_replacement")
    n = MAX_TREE_NODES + 1
    with pytest.raises(ValueError, match="MAX_SPEC_LEN=128"):
        TokenTreeBatch(torch.zeros(1, n, dtype=torch.long), torch.full((1, n), -1), torch.tensor([n]),
                       "without_replacement")
    with pytest.raises(ValueError, match="num_nodes"):
        TokenTreeBatch(TOKENS, PARENTS, torch.tensor([6, 3]), "without_replacement")
    with pytest.raises(ValueError, match="draft_probs is required"):
        TokenTreeBatch(TOKENS, PARENTS, torch.tensor([5, 3]), "iid_from_draft")
    with pytest.raises(ValueError, match=r"draft_probs must be \[batch, nodes \+ 1, vocab\]"):
        TokenTreeBatch(TOKENS, PARENTS, torch.tensor([5, 3]), "iid_from_draft", draft_probs=torch.ones(2, 5, 4))
    with pytest.raises(ValueError):
        TokenTreeBatch(TOKENS, PARENTS, torch.tensor([5, 3]), "guessed")


def test_choice_list_template_and_errors():
    template = StaticTreeTemplate.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert template.parents == (-1, -1, 0, 0, 1, 2)
    assert template.ranks == (0, 1, 0, 1, 0, 0)
    assert template.depth == (1, 1, 2, 2, 2, 3)
    assert template.expansion_levels() == [[-1], [0, 1], [2]]
    with pytest.raises(ValueError, match="empty"):
        StaticTreeTemplate.from_choices([])
    with pytest.raises(ValueError, match=r"its parent \(0,\) does not come before it"):
        StaticTreeTemplate.from_choices([(0, 0), (0,)])
    with pytest.raises(ValueError, match="MAX_SPEC_LEN=128"):
        StaticTreeTemplate.from_choices([(i,) for i in range(129)])
    with pytest.raises(ValueError, match="listed twice"):
        StaticTreeTemplate.from_choices([(0,), (0,)])


def test_static_builder_takes_draft_ranks_without_replacement():
    builder = StaticTreeBuilder([(0,), (2,), (0, 0), (0, 1), (2, 0)], batch_size=2, draw_mode="without_replacement")
    assert builder.nodes_to_expand() == [-1]
    root = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.2, 0.3]]))
    builder.expand(root[:, None])
    assert builder.partial_tokens.tolist() == [[1, 0, -1, -1, -1], [0, 2, -1, -1, -1]]  # ranks 0 and 2
    assert builder.nodes_to_expand() == [0, 1]
    level = torch.log(torch.tensor([[[0.2, 0.1, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]],
                                    [[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]]]))
    builder.expand(level)
    tree = builder.build()
    assert tree.tokens.tolist() == [[1, 0, 3, 2, 0], [0, 2, 1, 2, 3]]
    assert tree.parents[0].tolist() == [-1, -1, 0, 0, 1]
    assert tree.draw_mode is ChildDrawMode.WITHOUT_REPLACEMENT and tree.draft_probs is None
    with pytest.raises(RuntimeError):
        builder.expand(level)


def test_static_builder_iid_draws_and_keeps_draft_probs():
    builder = StaticTreeBuilder([(0,), (1,), (0, 0)], batch_size=1, draw_mode="iid_from_draft",
                                generator=torch.Generator().manual_seed(0))
    certain = torch.log(torch.tensor([[[0.0, 0.0, 1.0]]]))  # q puts all mass on token 2
    builder.expand(certain)
    assert builder.partial_tokens.tolist() == [[2, 2, -1]]  # i.i.d. draws may repeat
    builder.expand(torch.log(torch.tensor([[[0.5, 0.5, 0.0]]])))
    tree = builder.build()
    assert tree.tokens[0, 2].item() in (0, 1)
    assert tree.draw_mode is ChildDrawMode.IID_FROM_DRAFT
    assert tree.draft_probs[0, 0].tolist() == [0.0, 0.0, 1.0]  # row 0 = q after the root
    assert tree.draft_probs[0, 1].tolist() == [0.5, 0.5, 0.0]  # row 1 = q after node 0
    assert tree.draft_probs[0, 2].tolist() == [0.0, 0.0, 0.0]  # node 1 is a leaf


def test_eagle2_dynamic_tree_by_hand():
    root = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    builder = DynamicTopKTreeBuilder(root, top_k=2, max_depth=2, budget=4)
    assert builder.frontier_tokens.tolist() == [[0, 1]]
    builder.expand(torch.log(torch.tensor([[[0.1, 0.5, 0.3, 0.1], [0.7, 0.05, 0.2, 0.05]]])))
    # candidates: c0 tok0 .5 | c1 tok1 .3 | c2 tok1<-c0 .25 | c3 tok2<-c0 .15 | c4 tok0<-c1 .21 | c5 tok2<-c1 .06
    assert builder.candidate_parents.tolist() == [[-1, -1, 0, 0, 1, 1]]
    assert builder.frontier.tolist() == [[2, 4]]
    scores = builder.candidate_scores.exp()[0].tolist()
    assert [round(s, 4) for s in scores] == [0.5, 0.3, 0.25, 0.15, 0.21, 0.06]
    tree = builder.build()  # top 4 by score: c0, c1, c2, c4 (kept in candidate order)
    assert tree.tokens.tolist() == [[0, 1, 1, 0]]
    assert tree.parents.tolist() == [[-1, -1, 0, 1]]
    assert tree.draw_mode is ChildDrawMode.WITHOUT_REPLACEMENT


def test_eagle2_rerank_keeps_a_tree_for_random_inputs():
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    builder = DynamicTopKTreeBuilder(torch.randn(16, vocab, generator=gen).log_softmax(-1), top_k=4,
                                     max_depth=4, budget=20)
    while not builder.done:
        builder.expand(torch.randn(16, 4, vocab, generator=gen).log_softmax(-1))
    tree = builder.build()  # TokenTreeBatch validates parent-before-child
    assert tree.num_nodes.tolist() == [20] * 16
    # the kept nodes carry exactly the 20 best scores, and their tokens / parents are the candidates'
    all_scores = builder.candidate_scores
    kept = builder.kept_candidates
    best = all_scores.sort(dim=1, descending=True).values[:, :20]
    assert torch.equal(all_scores.gather(1, kept).sort(dim=1, descending=True).values, best)
    assert torch.equal(tree.tokens, builder.candidate_tokens.gather(1, kept))
    parent_candidate = torch.where(tree.parents >= 0, kept.gather(1, tree.parents.clamp(min=0)), -1)
    assert torch.equal(parent_candidate, builder.candidate_parents.gather(1, kept))


def test_eagle2_errors():
    root = torch.randn(1, 8).log_softmax(-1)
    with pytest.raises(ValueError, match="MAX_SPEC_LEN=128"):
        DynamicTopKTreeBuilder(root, top_k=8, max_depth=4, budget=129)
    with pytest.raises(ValueError, match="exceeds the 10 candidates"):
        DynamicTopKTreeBuilder(root, top_k=2, max_depth=3, budget=11)
    with pytest.raises(ValueError, match="empty"):
        DynamicTopKTreeBuilder(root, top_k=2, max_depth=3, budget=0)
    with pytest.raises(ValueError, match="top_k"):
        DynamicTopKTreeBuilder(root, top_k=9, max_depth=3, budget=4)
    with pytest.raises(ValueError, match="NaN"):
        DynamicTopKTreeBuilder(torch.full((1, 8), math.nan), top_k=2, max_depth=2, budget=4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_dynamic_builder_refuses_nan_and_plus_inf_anywhere_in_a_row(bad):
    from vllm_easyspec.tree.building import DynamicTopKTreeBuilder

    logprobs = torch.log_softmax(torch.randn(2, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    root = logprobs.clone()
    root[1, 37] = bad  # not among the row's top entries before the change
    with pytest.raises(ValueError, match="root_logprobs contains NaN or \\+inf"):
        DynamicTopKTreeBuilder(root, top_k=2, max_depth=2, budget=3)
    builder = DynamicTopKTreeBuilder(logprobs, top_k=2, max_depth=2, budget=3)
    frontier = logprobs[:, None].repeat(1, 2, 1)
    frontier[0, 1, 5] = bad
    with pytest.raises(ValueError, match="frontier_logprobs contains NaN or \\+inf"):
        builder.expand(frontier)
