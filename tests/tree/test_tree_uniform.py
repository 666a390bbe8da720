"""``easyspec.tree.uniform`` without an engine (issue 61, item 1): every request of a tree step verifies ``N`` nodes,
a smaller tree padded with nodes the tree sampler never accepts, greedy or sampled, so padding changes no output
and no output distribution. Each check is shown to fail for a sampler that took padding nodes as real ones."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from tests.tree.test_tree_step import _sampling_metadata
from tests.tree.tree_testlib import (
    ContextTable,
    Ctx,
    build_tree,
    chi_square,
    node_contexts,
    spec_decode_metadata,
)
from vllm_easyspec.easyspec.config import EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.integration.node_policy import TreeBudget
from vllm_easyspec.integration.tree_step import PendingTree, TreeVerifier
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

TOP_K = ChildDrawMode.WITHOUT_REPLACEMENT
IID = ChildDrawMode.IID_FROM_DRAFT


def test_uniform_is_a_strict_boolean_off_by_default():
    def tree(**options):
        return parse_easyspec_config({"easyspec": {"tree": {"choices": [[0], [1]]} | options}}).tree

    assert tree().uniform is False and tree(uniform=True).uniform is True
    for bad in ("yes", 1, None):
        with pytest.raises(EasySpecConfigError, match="easyspec.tree.uniform: Input should be a valid boolean"):
            tree(uniform=bad)


def test_padding_hangs_below_the_last_node_and_is_never_a_chain():
    tree = PendingTree.within(3, [5, 6, 7], [-1, -1, 0], TOP_K).padded(6)
    assert (tree.tokens, tree.parents, tree.padding, tree.real_nodes) == ([5, 6, 7, 7, 7, 7], [-1, -1, 0, 2, 3, 4], 3, 3)
    path = PendingTree.chain([4, 9]).padded(4)
    assert path.parents == [-1, 0, 1, 2] and not path.is_chain  # still one path (vLLM's kernel), never vLLM's sampler
    empty = PendingTree([], [], TOP_K, 0, False).padded(3)
    assert (empty.tokens, empty.parents, empty.real_nodes) == ([0, 0, 0], [-1, 0, 1], 0)
    assert PendingTree.chain([1, 2]).padded(2).padding == 0


def _verifier(uniform_nodes: int, req_ids=("a", "b", "c", "d")) -> TreeVerifier:
    fallback = types.SimpleNamespace(sampling_params=types.SimpleNamespace(
        logprobs=None, watermarking=True, thinking_token_budget=None, structured_outputs=None))
    states = {req_id: types.SimpleNamespace(sampling_params=None) for req_id in req_ids} | {"d": fallback}
    return TreeVerifier(states, TreeBudget(), uniform_nodes=uniform_nodes)


def _hand_over(verifier: TreeVerifier, trees: dict, no_drafts: set, chain: bool = False) -> list[list[int]]:
    """What the scheduler receives from ``trees`` / ``no_drafts`` proposed to ``verifier`` (drafter rows of 4)."""
    verifier.propose(trees, no_drafts, node_limit=4, chain=chain)
    rows = [(trees[r].tokens + [99] * 4)[:4] if r in trees else [99] * 4 for r in "abcd"]
    drafts = types.SimpleNamespace(req_ids=list("abcd"), draft_token_ids=rows)
    verifier.trim_drafts(drafts)
    return drafts.draft_token_ids


def test_uniform_hands_every_speculating_request_n_tokens_where_any_tree_has_nodes():
    trees = {"a": PendingTree.within(4, [5, 6], [-1, -1], TOP_K), "b": PendingTree([], [], TOP_K, 4, False)}
    assert _hand_over(_verifier(0), dict(trees), {"c", "d"}) == [[5, 6], [], [], []]
    uniform = _verifier(4)
    assert _hand_over(uniform, dict(trees), {"c", "d"}) == [[5, 6, 6, 6], [0] * 4, [0] * 4, []]  # d: a fallback
    assert uniform.pending["a"].real_nodes == 2 and uniform.pending["c"].padding == 4 and uniform.no_drafts == {"d"}
    # a step that drafts nothing and a chain step (budget_by_batch {"chain": k}) keep their own sizes
    assert _hand_over(_verifier(4), {"a": PendingTree([], [], TOP_K, 4, False)}, {"b", "c", "d"}) == [[]] * 4
    chain = {r: PendingTree.chain([7, 8]) for r in "abc"}
    assert _hand_over(_verifier(4), chain, {"d"}, chain=True) == [[7, 8]] * 3 + [[]]


def _step(trees: list[PendingTree], probs: list[torch.Tensor] | None = None, real: bool = True) -> TreeVerifyStep:
    """The runner's step of these pending trees (each scheduled whole); ``real=False``: padding taken as real nodes,
    the mistake every test here must catch."""
    requests, start = [], 0
    for row, tree in enumerate(trees):
        requests.append(TreeRequest(batch_row=row, query_start=start, prefix_len=7, tokens=tree.tokens,
                                    parents=tree.parents, draw_mode=tree.draw_mode, padding=tree.padding if real else 0,
                                    draft_probs=None if probs is None else probs[row][: len(tree.tokens) + 1 if not real
                                                                                      else tree.real_nodes + 1]))
        start += len(tree.tokens) + 1
    return TreeVerifyStep(requests)


def _verify(step: TreeVerifyStep, logits: torch.Tensor, temperature: float | None = None):
    from vllm.v1.sample.sampler import Sampler

    from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler

    metadata = _sampling_metadata(len(step), logits.shape[1])
    if temperature is not None:
        metadata = dataclasses.replace(metadata, temperature=torch.full((len(step),), temperature), all_greedy=False,
                                       all_random=True)
    spec = spec_decode_metadata([request.tokens for request in step.requests], "cpu")
    return TreeRejectionSampler(Sampler()).verify(step, spec, logits, metadata)


def test_greedy_never_accepts_a_padding_node_even_where_it_is_the_argmax():
    """Tree ``[3, 4, 5]`` (node 2 under node 0) padded to 6 nodes with 5s below node 2, and a request that drafted
    nothing padded to 6 nodes of token 0: the target's argmax agrees with every padding node, yet the verdict is
    the unpadded trees' (nodes 0 and 2, bonus 5; the empty tree's bonus 0)."""
    trees = [PendingTree.within(3, [3, 4, 5], [-1, -1, 0], TOP_K).padded(6), PendingTree([], [], TOP_K, 6, False).padded(6)]
    logits = torch.randn(14, 11, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = logits[1, 5] = 9.0  # root -> node 0 (3) -> node 2 (5)
    logits[3:7, 5] = 9.0  # node 2's row and every padding row: argmax 5, the padding's token
    logits[7:14, 0] = 9.0  # the empty tree: every row's argmax is its padding token 0
    verdict = _verify(_step(trees), logits)
    output = verdict.sampler_output.sampled_token_ids
    assert output[0, :3].tolist() == [3, 5, 5] and output[0, 3:].tolist() == [-1] * 4
    assert output[1].tolist() == [0] + [-1] * 6
    assert verdict.branch.source_column.tolist() == [1, 3]  # nodes 0 and 2, never a padding column (4-6)
    alone = _verify(_step(trees[1:]), logits[7:]).sampler_output.sampled_token_ids  # its rows one slice
    assert alone.tolist() == [[0] + [-1] * 6]
    wrong = _verify(_step(trees, real=False), logits).sampler_output.sampled_token_ids
    assert wrong[0, :6].tolist() == [3, 5, 5, 5, 5, 5] and wrong[1, 1] == 0  # padding taken as real: accepted


VOCAB, NODES = 5, 4


def _sampled_trees(mode: ChildDrawMode, batch: int, seed: int):
    """``batch`` requests at one root context: i.i.d. or top-k trees drafted by a draft correlated with the target,
    every third request with no drafted node, each padded to :data:`NODES`; the target's logits of every row, padding
    rows included (rows of their own paths, as in an engine), and the draft's probabilities of the real rows."""
    target = ContextTable(VOCAB, 6, seed=100 + seed)
    draft = ContextTable(VOCAB, 6, seed=200 + seed, base=target, mix=0.5)
    root = Ctx(torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
    drafted = build_tree({"choices": [[0], [1]], "mode": mode}, draft, root, torch.Generator().manual_seed(seed))
    trees, probs = [], []
    for row in range(batch):
        count = 0 if row % 3 == 2 else 2
        tree = PendingTree(drafted.tokens[row, :count].tolist(), drafted.parents[row, :count].tolist(), mode, 2, False)
        trees.append(tree.padded(NODES))
        q = drafted.draft_probs[row, : count + 1] if mode is IID else None
        if q is not None:  # what a sampler taking padding as real would read as q: the draft at each padding row
            q = torch.cat([q, q[-1:].expand(NODES - count, -1)])
        probs.append(q)
    parents = torch.tensor([tree.parents for tree in trees])
    contexts = node_contexts(parents, torch.tensor([tree.tokens for tree in trees]), root, VOCAB)
    logits = torch.cat([target.lookup(root.length, root.value)[:, None], target.lookup(contexts.length, contexts.value)],
                       1)
    return trees, (probs if mode is IID else None), logits.reshape(-1, VOCAB), target


def _two_token_counts(trees, probs, logits, target, real: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the first two output tokens (the second drawn from the target where the step emitted one) and the
    exact law of sequential sampling from the target."""
    torch.manual_seed(seed)
    output = _verify(_step(trees, probs, real), logits, temperature=1.0).sampler_output.sampled_token_ids.long()
    first, second = output[:, 0], output[:, 1].clone()
    alone = second < 0
    after_first = target.lookup(torch.ones_like(first), first).softmax(-1)
    second[alone] = torch.multinomial(after_first[alone], 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    zero = torch.zeros(1, dtype=torch.long)
    p1 = target.lookup(zero, zero)[0].double().softmax(-1)
    law = p1[:, None] * target.lookup(torch.ones(VOCAB, dtype=torch.long), torch.arange(VOCAB)).double().softmax(-1)
    return counts, law.numpy()


@pytest.mark.parametrize("mode", [IID, TOP_K], ids=["iid", "topk"])
def test_sampled_padding_keeps_the_targets_law_and_is_never_accepted(mode):
    """At T = 1 the outputs of padded steps are exactly those of the unpadded trees under the same random draws (so
    no padding node is accepted), and the first two tokens of 12k padded steps follow the target's exact law
    (chi-square). A sampler taking padding as real nodes accepts some; for i.i.d. children (SpecInfer's rule needs
    every sibling drawn from q) it also breaks the law, while for top-k children any fixed nodes keep it."""
    trees, probs, logits, target = _sampled_trees(mode, 12_000, seed=3)
    few = 600
    rows = torch.arange(few * (NODES + 1)).reshape(few, NODES + 1)
    unpadded = [PendingTree(t.tokens[: t.real_nodes], t.parents[: t.real_nodes], mode, 2, False) for t in trees[:few]]
    kept = torch.cat([rows[i, : t.real_nodes + 1] for i, t in enumerate(trees[:few])])
    outputs = []
    for step, step_logits in ((_step(trees[:few], None if probs is None else probs[:few]), logits[:rows.numel()]),
                              (_step(unpadded, None if probs is None else probs[:few]), logits[kept]),
                              (_step(trees[:few], None if probs is None else probs[:few], real=False),
                               logits[:rows.numel()])):
        torch.manual_seed(9)
        outputs.append(_verify(step, step_logits, 1.0))
    padded, plain = (verdict.sampler_output.sampled_token_ids for verdict in outputs[:2])
    assert torch.equal(padded[:, : plain.shape[1]], plain) and bool((padded[:, plain.shape[1]:] == -1).all())
    assert bool((outputs[0].branch.source_column <= 2).all())  # no padding column (3, 4) accepted
    assert bool((outputs[2].branch.source_column > 2).any())  # ... but some when taken as real nodes
    counts, law = _two_token_counts(trees, probs, logits, target, real=True, seed=5)
    statistic, p_value, _, _ = chi_square(counts, law)
    assert p_value > 1e-3, (statistic, p_value)
    if mode is IID:
        assert chi_square(_two_token_counts(trees, probs, logits, target, real=False, seed=5)[0], law)[1] < 1e-6
