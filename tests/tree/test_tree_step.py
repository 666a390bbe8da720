"""The tree step's values, without an engine: options read once, pending trees cut to their budget, the tree
sampler's verdict from logits alone, and the batch split covering every field of vLLM's attention metadata."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.sampling import tree_rejection_sample
from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep


def test_split_verify_batch_knows_every_field_of_vllms_common_attention_metadata():
    """A field vLLM adds to ``CommonAttentionMetadata`` must get a rule in ``SUB_BATCH_FIELDS`` (a sub-batch
    built without it would silently take the field's default)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_easyspec.integration.tree_attention import SUB_BATCH_FIELDS

    assert {f.name for f in dataclasses.fields(CommonAttentionMetadata)} == set(SUB_BATCH_FIELDS)


def test_pending_trees_are_cut_to_their_budget_and_say_whether_they_are_chains():
    from vllm_easyspec.integration.tree_step import PendingTree

    wide = PendingTree.within(3, [5, 6, 7, 8], [-1, -1, 0, 1], ChildDrawMode.WITHOUT_REPLACEMENT)
    assert (wide.tokens, wide.parents, wide.node_limit, wide.is_chain) == ([5, 6, 7], [-1, -1, 0], 3, False)
    path = PendingTree.within(2, [5, 7, 6], [-1, 0, -1], ChildDrawMode.WITHOUT_REPLACEMENT)
    assert (path.tokens, path.is_chain) == ([5, 7], True)  # its first two nodes are a path
    sampled = PendingTree.within(2, [5, 7], [-1, 0], ChildDrawMode.IID_FROM_DRAFT, draft_probs=torch.ones(3, 9))
    assert not sampled.is_chain  # i.i.d. draws verify by multi-step speculative sampling
    assert PendingTree.chain([4, 4, 9]).is_chain and PendingTree.chain([4, 4, 9]).parents == [-1, 0, 1]


def test_options_are_resolved_once_per_config_and_travel_with_it(tiny_llama_dir, tiny_llama_draft_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_easyspec.integration import options

    config = EngineArgs(
        model=str(tiny_llama_dir), enforce_eager=True,
        speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 2},
        additional_config={"easyspec": {"layer_parallel_size": 2, "tree": {"choices": [[0], [1]]}}},
    ).create_engine_config()
    resolved = options.easyspec_options(config)
    assert resolved.method == "draft_model" and resolved.is_fuzzy and resolved.tree.num_nodes == 2
    assert resolved.layer_grouping.groups == ((1,), (2, 3), (4, 5), (6,))  # the 8-layer draft, N = 2

    def parse_again(additional_config):
        raise AssertionError("the front end already parsed these options")

    monkeypatch.setattr(options, "parse_easyspec_config", parse_again)
    assert options.easyspec_options(config) is resolved
    monkeypatch.undo()
    copy = pickle.loads(pickle.dumps(config))  # what an engine process receives
    assert options.easyspec_options(copy) == resolved and options.easyspec_options(copy) is not resolved


def _sampling_metadata(batch: int, vocab: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def test_the_tree_sampler_returns_a_verdict_from_logits_alone():
    """A batch [tree, request without drafts, tree] through ``TreeRejectionSampler.verify`` with no runner:
    the trees' rows are the tree rejection sampler's greedy result, the other request's row is vLLM's sampler
    (argmax), the branch is the accepted nodes' moves, and the logits are not written."""
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler

    vocab = 11
    trees = [([3, 4, 5, 3], [-1, -1, 0, 2]), ([7, 7], [-1, 0])]
    # rows: tree A's root and 4 nodes (0-4), the request without drafts (5), tree B's root and 2 nodes (6-8)
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = logits[1, 5] = 9.0  # tree A accepts node 0 (3), then its child node 2 (5) ...
    logits[3, 3] = -9.0  # ... but not node 3
    logits[6, 7], logits[7, 7] = 9.0, -9.0  # tree B accepts node 0 only
    drafts = [trees[0][0], [], trees[1][0]]
    metadata = SpecDecodeMetadata(  # as vLLM's runner lays out the rows (_calc_spec_decode_metadata)
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=[len(d) for d in drafts],
        cu_num_draft_tokens=torch.tensor([4, 4, 6], dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor([5, 6, 9], dtype=torch.int32),
        target_logits_indices=torch.tensor([0, 1, 2, 3, 6, 7], dtype=torch.int32),
        bonus_logits_indices=torch.tensor([4, 5, 8], dtype=torch.int32),
        logits_indices=torch.arange(9, dtype=torch.int32),
    )
    step = TreeVerifyStep([
        TreeRequest(batch_row=0, query_start=0, prefix_len=10, tokens=trees[0][0], parents=trees[0][1]),
        TreeRequest(batch_row=2, query_start=6, prefix_len=20, tokens=trees[1][0], parents=trees[1][1]),
    ])
    before = logits.clone()
    verdict = TreeRejectionSampler(Sampler()).verify(step, metadata, logits, _sampling_metadata(3, vocab))
    assert torch.equal(logits, before)
    output = verdict.sampler_output.sampled_token_ids
    expected = tree_rejection_sample(step.trees, _padded(step, logits), output_width=output.shape[1])
    assert output[[0, 2]].tolist() == expected.output_token_ids.tolist()
    assert output[0, :3].tolist() == [3, 5, int(logits[3].argmax())] and output[2, 0] == 7
    assert output[1].tolist() == [int(logits[5].argmax())] + [-1] * (output.shape[1] - 1)
    branch = verdict.branch
    assert branch.request_index.tolist() == [0, 0, 1]
    assert branch.source_column.tolist() == [1, 3, 1]  # nodes 0 and 2 of tree A, node 0 of tree B
    assert branch.destination.tolist() == [11, 12, 21]
    assert branch.tokens.tolist() == [3, 5, 7]


def _padded(step: TreeVerifyStep, logits: torch.Tensor) -> torch.Tensor:
    """The trees' logit rows ``[R, 1 + n, V]`` (tree A: rows 0-4, tree B: rows 6-8 of the batch)."""
    rows = [torch.arange(0, 5), torch.arange(6, 9)]
    out = torch.zeros(len(rows), step.width, logits.shape[1])
    for index, request_rows in enumerate(rows):
        out[index, : len(request_rows)] = logits[request_rows]
    return out


@pytest.mark.parametrize("budget", [{"4": 2}, {"4": {"chain": 2}}])
def test_a_step_budget_is_decided_in_one_place(budget):
    from vllm_easyspec.tree.config import StepBudget, TreeConfig

    tree = TreeConfig(top_k=2, depth=3, budget=6, budget_by_batch=budget)
    chain = isinstance(budget["4"], dict)
    assert tree.budget_at(3) == StepBudget(nodes=6, chain=False)
    assert tree.budget_at(4) == StepBudget(nodes=2, chain=chain)


def test_paths_leave_the_masked_step_and_only_nodes_verified_away_from_their_place_move():
    """A request whose nodes are one path is served where it sits (vLLM's kernel, linear slots): the masked
    step holds the other trees, each request knows its index there, and of an accepted branch only the nodes
    verified in a row other than their destination must move."""
    path = TreeRequest(batch_row=0, query_start=0, prefix_len=10, tokens=[5, 6, 7], parents=[-1, 0, 1])
    tree = TreeRequest(batch_row=1, query_start=4, prefix_len=20, tokens=[5, 6, 7], parents=[-1, -1, 1])
    one = TreeRequest(batch_row=2, query_start=8, prefix_len=30, tokens=[9], parents=[-1])
    assert path.is_path and not tree.is_path and one.is_path
    step = TreeVerifyStep([path, tree, one])
    masked, index = step.masked_part()
    assert [r.batch_row for r in masked.requests] == [1] and index.tolist() == [-1, 0, -1] and masked.width == 4
    assert TreeVerifyStep([path, one]).masked_part() is None
    assert TreeVerifyStep([tree]).masked_part()[0] is not None
    # path: nodes 0, 1 accepted (rows 1, 2 -> positions 11, 12); tree: nodes 1, 2 (rows 2, 3 -> 21, 22); one: node 0
    branch = step.accepted_moves(torch.tensor([[0, 1], [1, 2], [0, -1]]), torch.tensor([2, 2, 1]))
    moves = branch.out_of_place(step.prefix_lens)
    assert moves.request_index.tolist() == [1, 1] and moves.source_column.tolist() == [2, 3]
    assert moves.destination.tolist() == [21, 22] and moves.tokens.tolist() == [6, 7]
