"""Level-by-level tree drafting (engine-free): the frontier mask names exactly a node's forwarded
ancestors, and drafting with a model that sees only what the mask allows builds the same tree as expanding
every node from its full root-to-node path."""

from __future__ import annotations

import pytest
import torch

from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.config import TreeConfig
from vllm_easyspec.tree.drafting import LevelwiseTreeDraft
from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

VOCAB = 11


def path_logits(root_token: int, path: tuple[int, ...]) -> torch.Tensor:
    """A deterministic 'model': logits after the root and the tokens of ``path``."""
    generator = torch.Generator().manual_seed(hash((root_token, path)) % (2**31))
    return torch.randn(VOCAB, generator=generator) * 3


def draft_with_masks(config: TreeConfig, roots: list[int], greedy: list[bool], generators=None):
    """Drive LevelwiseTreeDraft, recovering each frontier node's path only from the stash and the mask."""
    batch = len(roots)
    draft = LevelwiseTreeDraft(config, torch.stack([path_logits(r, ()) for r in roots]), greedy,
                               temperatures=torch.ones(batch), generators=generators)
    stash_paths: list[list[tuple[int, ...]]] = [[] for _ in roots]  # path of every stashed node
    while not draft.done:
        tokens = draft.frontier_tokens()
        mask = draft.frontier_mask()
        parent_columns = draft.frontier_parent_columns()
        stash = len(stash_paths[0])
        assert mask.shape == (batch, tokens.shape[1], stash + tokens.shape[1])
        logits = torch.zeros(batch, tokens.shape[1], VOCAB)
        new_paths = []
        for b in range(batch):
            row_paths = []
            for f in range(tokens.shape[1]):
                ancestors = [stash_paths[b][s] for s in range(stash) if mask[b, f, s]]
                assert mask[b, f, stash + f] and mask[b, f, stash:].sum() == 1  # itself, no sibling
                parent_path = max(ancestors, key=len) if ancestors else ()
                assert len(ancestors) == len(parent_path) == draft.frontier_depth - 1  # all ancestors, one per depth
                column = int(parent_columns[b, f])  # where a drafter reads the parent's output
                assert (stash_paths[b][column] if column >= 0 else ()) == parent_path
                path = parent_path + (int(tokens[b, f]),)
                row_paths.append(path)
                logits[b, f] = path_logits(roots[b], path)
            new_paths.append(row_paths)
        for b in range(batch):
            stash_paths[b].extend(new_paths[b])
        draft.expand(logits)
    assert len(stash_paths[0]) == config.forwarded_nodes  # the slots a GPU drafter's levels write
    return draft.build()


def expected_static_tokens(config: TreeConfig, root: int) -> list[int]:
    template = config.template()
    tokens: list[int] = []
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(template.parents):
        parent_path = paths[parent] if parent >= 0 else ()
        ranked = torch.topk(path_logits(root, parent_path), template.ranks[node] + 1).indices
        tokens.append(int(ranked[template.ranks[node]]))
        paths.append(parent_path + (tokens[-1],))
    return tokens


STATIC = TreeConfig(choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]])


def test_static_tree_equals_full_path_expansion():
    trees = draft_with_masks(STATIC, [3, 7], [True, True])
    for b, root in enumerate([3, 7]):
        assert trees.tokens[b].tolist() == expected_static_tokens(STATIC, root)
    assert trees.parents[0].tolist() == list(STATIC.template().parents)
    assert trees.draw_modes == [ChildDrawMode.WITHOUT_REPLACEMENT] * 2


def test_dynamic_tree_masks_and_budget():
    config = TreeConfig(top_k=3, depth=4, budget=10)
    trees = draft_with_masks(config, [2, 5, 9], [True, False, True])
    assert trees.tokens.shape == (3, 10)
    # every kept node's parent is kept and comes first
    assert bool((trees.parents < torch.arange(10)[None]).all())
    # the root's children are the top-k of the root logits, best first
    for b, root in enumerate([2, 5, 9]):
        children = [int(t) for t, p in zip(trees.tokens[b], trees.parents[b]) if p == -1]
        top = torch.topk(path_logits(root, ()), len(children)).indices.tolist()
        assert children == top


def test_sampled_rows_draw_iid_and_keep_q():
    config = TreeConfig(choices=[[0], [1], [0, 0]], draw="sample")
    generators = {1: torch.Generator().manual_seed(5)}
    trees = draft_with_masks(config, [4, 4], [True, False], generators=generators)
    assert trees.draw_modes == [ChildDrawMode.WITHOUT_REPLACEMENT, ChildDrawMode.IID_FROM_DRAFT]
    assert set(trees.draft_probs) == {1}
    q = trees.draft_probs[1]
    assert q.shape == (4, VOCAB)
    torch.testing.assert_close(q[0], torch.softmax(path_logits(4, ()), -1))
    assert float(q[2].sum()) == 0.0  # node 1 is a leaf: never expanded


def test_verify_step_layout_positions_and_moves():
    # request 0: root at 10, nodes 0..3 with parents -1, -1, 0, 2 ; request 1: root at 4, one node
    step = TreeVerifyStep([
        TreeRequest(batch_row=1, query_start=3, prefix_len=10, tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2]),
        TreeRequest(batch_row=2, query_start=8, prefix_len=4, tokens=[9], parents=[-1]),
    ])
    rows, positions = step.row_positions()
    assert rows.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert positions.tolist() == [10, 11, 11, 12, 13, 4, 5]
    mask = step.attention_mask
    assert mask[0, 4].tolist() == [True, True, False, True, True]  # node 3: root, 0, 2, itself
    assert mask[1, 1].tolist() == [True, True, False, False, False]
    assert mask[1, 3].tolist() == [True, False, False, False, False]  # padding row sees the root only
    branch = step.accepted_moves(torch.tensor([[0, 2, 3], [0, -1, -1]]), torch.tensor([3, 1]))
    assert branch.request_index.tolist() == [0, 0, 0, 1]
    assert branch.source_column.tolist() == [1, 3, 4, 1]
    assert branch.destination.tolist() == [11, 12, 13, 5]
    assert branch.tokens.tolist() == [5, 7, 8, 9]
    source, destination = step.branch_rows(branch)  # node 2 (row 6) moves to P + 2 (row 5), node 3 to row 6
    assert source.tolist() == [4, 6, 7, 9] and destination.tolist() == [4, 5, 6, 9]
    assert step.left_the_top_path(branch) == set()  # 0, 2, 3: each its parent's first child
    other = step.accepted_moves(torch.tensor([[1, -1], [0, -1]]), torch.tensor([1, 1]))
    assert step.left_the_top_path(other) == {0}  # node 1 is the root's second child


def test_verify_step_rejects_a_node_before_its_parent():
    with pytest.raises(ValueError, match="parents must come first"):
        TreeRequest(batch_row=0, query_start=0, prefix_len=3, tokens=[1, 2], parents=[1, -1])


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 9])
def test_dynamic_tree_drafted_within_a_node_limit_is_the_best_nodes_of_the_full_tree(limit):
    """``budget_by_batch`` drafts a smaller EAGLE-2 tree (fewer levels): its nodes are exactly the ``limit``
    best-scoring candidates of the full tree, so following the batch never drafts a worse tree than a cut."""
    full_config = TreeConfig(top_k=3, depth=4, budget=10)
    small_config = full_config.drafted_within(limit)
    assert small_config.budget == min(limit, 10) and small_config.depth == min(4, limit)
    roots = [2, 5, 9]
    full, small = draft_with_masks(full_config, roots, [True] * 3), draft_with_masks(small_config, roots, [True] * 3)

    def paths_and_scores(trees, b):
        paths: list[tuple[int, ...]] = []
        scores: list[float] = []
        for token, parent in zip(trees.tokens[b].tolist(), trees.parents[b].tolist(), strict=True):
            prefix = paths[parent] if parent >= 0 else ()
            logprobs = torch.log_softmax(path_logits(roots[b], prefix), dim=-1)
            paths.append(prefix + (token,))
            scores.append((scores[parent] if parent >= 0 else 0.0) + float(logprobs[token]))
        return paths, scores

    for b in range(len(roots)):
        full_paths, full_scores = paths_and_scores(full, b)
        best = sorted(range(len(full_paths)), key=lambda i: (-full_scores[i], len(full_paths[i]), i))[:limit]
        small_paths, _ = paths_and_scores(small, b)
        assert sorted(small_paths) == sorted(full_paths[i] for i in best)
    assert full_config.drafted_within(10) is full_config and STATIC.drafted_within(2) is STATIC


def test_draft_probabilities_move_to_their_target_ids():
    """An i.i.d. tree's ``q`` rows over the draft vocabulary reach the verifier at target ids: an EAGLE-3 head's
    reduced vocabulary through ``d2t``, a draft model's through vLLM's mapping (only its mappable tokens)."""
    from types import SimpleNamespace

    from vllm_easyspec.integration.tree_drafting import _spread, _to_target_vocab

    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    spread = _spread(probs, torch.tensor([2, 5, 7, 9]), 10)
    assert spread.shape == (2, 10) and torch.equal(spread[:, [2, 5, 7, 9]], probs)
    assert spread.sum(-1).tolist() == pytest.approx(probs.sum(-1).tolist())
    mapping = SimpleNamespace(intersection_mask_draft=torch.tensor([True, False, True, True]),
                              draft_to_target_ids=torch.tensor([3, -1, 0, 8]), target_vocab_size=10)
    moved = _to_target_vocab(probs, mapping)
    expected = torch.zeros(2, 10)
    expected[:, [3, 0, 8]] = probs[:, [0, 2, 3]]
    assert torch.equal(moved, expected)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_states_an_eagle_level_feeds_are_dense_rows_of_each_nodes_parent(batch):
    """A compiled head reads its input with the strides it was traced with: the first level's states (every node's
    parent is its root) and a later level's (stash or root) are dense ``[B * F, H]`` rows, not views."""
    from vllm_easyspec.integration.tree_drafting import _parent_states

    hidden = 4
    root = torch.arange(batch * hidden, dtype=torch.float32).view(batch, hidden)
    first = _parent_states(root, root.new_zeros(batch, 0, hidden), torch.full((batch, 2), -1))
    assert first.is_contiguous() and first.stride() == (hidden, 1)
    assert torch.equal(first, root.repeat_interleave(2, dim=0))
    stash = 100 + torch.arange(batch * 2 * hidden, dtype=torch.float32).view(batch, 2, hidden)
    parents = torch.tensor([[1, -1, 0]] * batch)
    later = _parent_states(root, stash, parents)
    assert later.is_contiguous() and later.shape == (batch * 3, hidden)
    expected = torch.stack([torch.stack([stash[b, 1], root[b], stash[b, 0]]) for b in range(batch)])
    assert torch.equal(later, expected.view(batch * 3, hidden))


def test_drafting_a_dynamic_tree_on_a_device_waits_for_nothing():
    """Greedy EAGLE-2 drafting of a batch with its logits on a device (``fake_device``): the levels, their
    masks, the levels' cache slots and query starts (a GPU drafter's attention metadata) and the tree it builds
    never make the host wait for the device (the checks that would are taken on the host only; the verify step
    checks the trees it verifies, on the host)."""
    from tests.fake_device import counting_syncs, on_host, second_device
    from vllm_easyspec.integration.tree_attention import DraftTreeAttention, TreeLevelMetadata

    config = TreeConfig.model_validate({"top_k": 2, "depth": 3, "budget": 5})
    roots = [1, 2]

    def draft(device):
        root_logits = torch.stack([path_logits(r, ()) for r in roots]).to(device)
        state = DraftTreeAttention(prefix_lens=torch.tensor([20, 33], dtype=torch.int32).to(device),
                                   block_table=torch.tensor([[4, 9, 0], [2, 3, 7]], dtype=torch.int32).to(device))
        draft = LevelwiseTreeDraft(config, root_logits, [True, True], temperatures=torch.zeros(2), generators={})
        slots = []
        while not draft.done:
            tokens = draft.frontier_tokens()
            level = TreeLevelMetadata(state, tokens.shape[1], draft.frontier_mask())
            slots += [level.slots(block_size=16, max_model_len=48), level.query_starts]
            draft.frontier_parent_columns()
            logits = torch.randn(2, tokens.shape[1], VOCAB, generator=torch.Generator().manual_seed(tokens.shape[1]))
            draft.expand(logits.to(device))
        trees = draft.build()
        return [on_host(x).tolist() for x in (trees.tokens, trees.parents, trees.logprobs, *slots)]

    expected = draft(torch.device("cpu"))
    with second_device() as device, counting_syncs() as waits:
        got = draft(device)
    project = [(what, where) for what, where in waits.waits if where != "?"]  # "?": this test's own copies
    assert not project, project
    assert got == expected
