"""Tree rejection sampler: greedy cases with hand-written expectations, stochastic edge cases whose
outcome is forced, output contract, reproducibility, and the vLLM filtering semantics."""

from __future__ import annotations

import pytest
import torch

from tests.tree.tree_views import verify_layout
from vllm_easyspec.tree.building import ChildDrawMode, TokenTreeBatch
from vllm_easyspec.tree.sampling import apply_sampling_constraints, tree_rejection_sample

NEG = float("-inf")


def _tree(tokens, parents, mode="without_replacement", draft_probs=None, num_nodes=None):
    tokens = torch.tensor(tokens)
    parents = torch.tensor(parents)
    if tokens.ndim == 1:
        tokens, parents = tokens[None], parents[None]
    if num_nodes is None:
        num_nodes = torch.full((tokens.shape[0],), tokens.shape[1])
    return TokenTreeBatch(tokens, parents, torch.as_tensor(num_nodes), mode, draft_probs=draft_probs)


def _argmax_logits(rows: int, vocab: int, argmax: dict[int, int]) -> torch.Tensor:
    """Logits ``[1, rows, vocab]`` whose argmax at row r is ``argmax[r]`` (token 0 elsewhere)."""
    logits = torch.zeros(1, rows, vocab)
    for r in range(rows):
        logits[0, r, argmax.get(r, 0)] = 5.0
    return logits


# Tree used by the greedy tests (node: token, parent):
#   root -> n0:2 -> n2:1
#        -> n1:3 -> n3:0 -> n4:4
GREEDY_TOKENS = [2, 3, 1, 0, 4]
GREEDY_PARENTS = [-1, -1, 0, 1, 3]


def test_greedy_full_path_and_bonus():
    tree = _tree(GREEDY_TOKENS, GREEDY_PARENTS)
    # query rows: 0 = root, i + 1 = node i. root->3 picks n1, n1->0 picks n3, n3->4 picks n4, n4->1 bonus.
    logits = _argmax_logits(6, 5, {0: 3, 2: 0, 4: 4, 5: 1})
    out = tree_rejection_sample(tree, logits)
    assert out.output_token_ids.tolist() == [[3, 0, 4, 1]]
    assert out.output_token_ids.dtype == torch.int32
    assert out.accepted_nodes.tolist() == [[1, 3, 4]]
    assert out.num_accepted.tolist() == [3]
    assert out.bonus_token_ids.tolist() == [1]


def test_greedy_stops_at_first_mismatch():
    tree = _tree(GREEDY_TOKENS, GREEDY_PARENTS)
    # root->2 picks n0; n0's argmax 3 != n2's token 1 -> bonus 3 after one accepted token.
    out = tree_rejection_sample(tree, _argmax_logits(6, 5, {0: 2, 1: 3}))
    assert out.output_token_ids.tolist() == [[2, 3, -1, -1]]
    assert out.accepted_nodes.tolist() == [[0, -1, -1]]
    # root argmax 4 matches no child: only the bonus token.
    out = tree_rejection_sample(tree, _argmax_logits(6, 5, {0: 4}))
    assert out.output_token_ids.tolist() == [[4, -1, -1, -1]]
    assert out.num_accepted.tolist() == [0]


def test_greedy_prefers_longest_path_among_duplicate_siblings():
    # IID drafts may repeat a token among siblings: n0:2 (leaf) and n1:2 -> n2:1.
    tree = _tree([2, 2, 1], [-1, -1, 1], mode="iid_from_draft", draft_probs=torch.full((1, 4, 4), 0.25))
    out = tree_rejection_sample(tree, _argmax_logits(4, 4, {0: 2, 1: 3, 2: 1, 3: 0}))
    assert out.output_token_ids.tolist() == [[2, 1, 0]]
    assert out.accepted_nodes.tolist() == [[1, 2]]


def test_greedy_ragged_batch_with_flat_vllm_logits():
    # request 0: root -> n0:1 -> n1:2 ; request 1: a single node n0:3 (padding column 1).
    tree = _tree([[1, 2], [3, 0]], [[-1, 0], [-1, -1]], num_nodes=[2, 1])
    vocab = 4
    rows0 = _argmax_logits(3, vocab, {0: 1, 1: 2, 2: 3})[0]  # accept both, bonus 3
    rows1 = _argmax_logits(2, vocab, {0: 0, 1: 0})[0]  # root argmax 0 != 3: bonus 0
    flat = torch.cat([rows0, rows1])  # vLLM order: [root, nodes...] per request, no padding rows
    out = tree_rejection_sample(tree, flat, output_width=5)
    assert out.output_token_ids.tolist() == [[1, 2, 3, -1, -1], [0, -1, -1, -1, -1]]
    assert out.accepted_nodes.tolist() == [[0, 1], [-1, -1]]


def test_temperature_zero_rows_are_greedy_in_a_mixed_batch():
    tree = _tree([[2, 3], [2, 3]], [[-1, -1], [-1, -1]])
    logits = torch.cat([_argmax_logits(3, 4, {0: 3, 2: 1})] * 2)
    logits[1, 0] = torch.tensor([NEG, NEG, 0.0, NEG])  # stochastic row: p(root->2) = 1
    logits[1, 1] = torch.tensor([NEG, 0.0, NEG, NEG])  # after n0 only token 1 is possible
    out = tree_rejection_sample(tree, logits, temperature=torch.tensor([0.0, 0.7]),
                                generator=torch.Generator().manual_seed(0))
    assert out.output_token_ids.tolist() == [[3, 1], [2, 1]]


def test_stochastic_certain_acceptance_and_certain_rejection():
    tree = _tree(GREEDY_TOKENS, GREEDY_PARENTS)
    gen = torch.Generator().manual_seed(1)
    logits = torch.full((64, 6, 5), NEG)
    # root: p = 1 on token 3 -> n1 always accepted; n1: p = 1 on token 0 -> n3; n3: p(4) = 0 so n4 is
    # always rejected and the bonus is drawn from p with token 4 removed: uniform over {1, 2}.
    logits[:, 0, 3] = 0.0
    logits[:, 2, 0] = 0.0
    logits[:, 4, 1] = 0.0
    logits[:, 4, 2] = 0.0
    logits[:, 1] = 0.0
    logits[:, 3] = 0.0
    logits[:, 5] = 0.0
    tree = _tree([GREEDY_TOKENS] * 64, [GREEDY_PARENTS] * 64)
    out = tree_rejection_sample(tree, logits, temperature=torch.ones(64), generator=gen)
    assert (out.num_accepted == 2).all()
    assert out.accepted_nodes[:, :2].tolist() == [[1, 3]] * 64
    bonus = out.bonus_token_ids
    assert set(bonus.tolist()) == {1, 2}
    assert (out.output_token_ids[:, 3] == -1).all()


def test_iid_draft_equal_to_target_is_always_accepted():
    # q == p at every node: min(1, p/q) = 1, so the first child of every node is accepted.
    vocab, batch = 5, 256
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, 4, vocab, generator=gen)
    probs = logits.softmax(-1)
    tokens = torch.multinomial(probs[:, 0], 2, replacement=True, generator=gen)
    child = torch.multinomial(probs[torch.arange(batch), 1], 1, generator=gen)
    tree = TokenTreeBatch(torch.cat([tokens, child], 1), torch.tensor([[-1, -1, 0]] * batch),
                          torch.full((batch,), 3), ChildDrawMode.IID_FROM_DRAFT, draft_probs=probs)
    out = tree_rejection_sample(tree, logits, temperature=torch.ones(batch), generator=gen)
    assert out.accepted_nodes.tolist() == [[0, 2]] * batch


def test_per_request_generators_make_rows_reproducible_across_batches():
    vocab = 6
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (4, 5), generator=gen)
    parents = torch.tensor([[-1, -1, 0, 0, 2]] * 4)
    logits = torch.randn(4, 6, vocab, generator=gen)
    tree = TokenTreeBatch(tokens, parents, torch.full((4,), 5), "without_replacement")
    results = []
    for other_seed in (11, 12):
        generators = {2: torch.Generator().manual_seed(42)}
        out = tree_rejection_sample(tree, logits, temperature=torch.full((4,), 1.5),
                                    generator=torch.Generator().manual_seed(other_seed), generators=generators)
        results.append(out.output_token_ids[2].tolist())
    assert results[0] == results[1]
    single = TokenTreeBatch(tokens[2:3], parents[2:3], torch.tensor([5]), "without_replacement")
    out = tree_rejection_sample(single, logits[2:3], temperature=torch.tensor([1.5]),
                                generators={0: torch.Generator().manual_seed(42)})
    assert out.output_token_ids[0].tolist() == results[0]


def test_output_contract_and_errors():
    tree = _tree(GREEDY_TOKENS, GREEDY_PARENTS)
    logits = torch.randn(1, 6, 5)
    out = tree_rejection_sample(tree, logits, temperature=torch.tensor([1.0]),
                                generator=torch.Generator().manual_seed(0), output_width=6)
    ids = out.output_token_ids[0].tolist()
    n = int(out.num_accepted)
    assert ids[n + 1:] == [-1] * (6 - n - 1) and min(ids[: n + 1]) >= 0
    assert ids[:n] == [GREEDY_TOKENS[i] for i in out.accepted_nodes[0, :n].tolist()]
    with pytest.raises(ValueError, match="output_width"):
        tree_rejection_sample(tree, logits, output_width=3)
    with pytest.raises(ValueError, match="target_logits"):
        tree_rejection_sample(tree, torch.randn(1, 5, 5))
    with pytest.raises(ValueError, match="draft_probs is required"):
        _tree([1], [-1], mode="iid_from_draft")


def test_sampling_constraints_semantics():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    # top-k=2 keeps both logits equal to the 2nd largest (ties kept) and nothing else
    out = apply_sampling_constraints(logits, torch.ones(2), top_k=torch.tensor([2, 5]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True, True]
    assert not torch.isinf(out[1]).any()
    # temperature divides (greedy rows are left at scale 1)
    out = apply_sampling_constraints(logits, torch.tensor([0.5, 0.0]))
    assert torch.equal(out, torch.stack([logits[0] * 2, logits[1]]))
    # top-p = 0.5 on p = softmax([0,0,0,0,5]) (top mass 0.974) keeps only token 4; p = 1 keeps all
    out = apply_sampling_constraints(logits, torch.ones(2), top_p=torch.tensor([1.0, 0.5]))
    assert torch.isinf(out[1]).tolist() == [True, True, True, True, False]
    assert not torch.isinf(out[0]).any()


@pytest.mark.slow
def test_sampling_constraints_match_vllm():
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen).round(decimals=1)  # rounding creates ties
    temperature = torch.rand(64, generator=gen) + 0.2
    k = torch.randint(1, 51, (64,), generator=gen)
    p = torch.rand(64, generator=gen) * 0.9 + 0.1
    ours = apply_sampling_constraints(logits, temperature, k, p)
    theirs = topk_topp.apply_top_k_top_p_pytorch(logits / temperature[:, None], k, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])


def test_request_without_drafts_only_samples_the_bonus():
    # vLLM can schedule a request with no draft tokens next to others: it gets just a bonus token.
    tree = _tree([[1, 2], [0, 0]], [[-1, 0], [-1, -1]], num_nodes=[2, 0])
    logits = torch.full((2, 3, 4), NEG)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 0.0  # request 0: accept both, bonus 3
    logits[1, 0, 2] = 0.0  # request 1: root row only; the bonus must be 2
    for temperature in (None, torch.tensor([1.0, 1.0])):
        out = tree_rejection_sample(tree, logits, temperature=temperature, generator=torch.Generator().manual_seed(0))
        assert out.output_token_ids.tolist() == [[1, 2, 3], [2, -1, -1]]
        assert out.num_accepted.tolist() == [2, 0]
    layout = verify_layout(tree, torch.tensor([4, 9]))
    assert layout.cu_query_lens.tolist() == [0, 3, 4] and layout.positions.tolist() == [4, 5, 6, 9]
