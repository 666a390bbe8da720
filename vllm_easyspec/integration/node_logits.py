"""Each tree node's target logits, processed as vLLM's sampler processes a request's row without speculation
(docs/design.md, "Requests a tree cannot serve exactly").

vLLM 0.32's ``Sampler`` applies, in order, ``allowed_token_ids``, ``bad_words``, ``min_tokens`` then
``logit_bias``, the repetition, frequency and presence penalties, and for sampled requests temperature, ``min_p``,
top-k and top-p. The row of node ``j`` predicts the token after the output so far plus ``j``'s own path
(:meth:`~vllm_easyspec.tree.verify_step.TreeRequest.row_paths`), so :func:`process_node_logits` applies the first
four to every row of a tree request with that history, through vLLM's own ops, and :func:`min_p_of_rows` hands
``min_p`` to the tree sampler: each row's values are vanilla vLLM's once the path is the output.

Invariant: the values are computed on the logits' device from host bookkeeping copied without waiting; nothing
here reads the device.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch
from vllm.v1.sample.ops.penalties import apply_all_penalties

from vllm_easyspec.tree.verify_step import TreeVerifyStep


def _processor(sampling_metadata, kind: type):
    """The engine's built-in logits processor of ``kind``, or None."""
    return next((processor for processor in sampling_metadata.logitsprocs.all if isinstance(processor, kind)), None)


def logit_biases(sampling_metadata) -> dict[int, dict[int, float]]:
    """``logit_bias`` of the batch's requests, by batch row (host values of vLLM's ``LogitBiasLogitsProcessor``)."""
    processor = _processor(sampling_metadata, LogitBiasLogitsProcessor)
    return {} if processor is None else processor.biases


def min_p_of_rows(sampling_metadata, batch_rows: torch.Tensor) -> torch.Tensor | None:
    """``[len(batch_rows)]`` float32 ``min_p`` of those batch rows (host values of vLLM's
    ``MinPLogitsProcessor``), or None when no request of the batch has one."""
    processor = _processor(sampling_metadata, MinPLogitsProcessor)
    if processor is None or not processor.min_p_count:
        return None
    return torch.from_numpy(np.ascontiguousarray(processor.min_p_cpu[batch_rows.numpy()]))


def process_node_logits(logits: torch.Tensor, step: TreeVerifyStep, first_logit_row: torch.Tensor,
                        sampling_metadata) -> torch.Tensor:
    """The step's logits with every row of its tree requests processed (steps 1-4 of the module docstring);
    ``first_logit_row[b]``: where batch row ``b``'s rows start in ``logits`` (host). Returns a new float32 tensor,
    or ``logits`` itself when no request of the batch asks for any of it; rows of requests without a tree are
    left as they are (vLLM's sampler processes them)."""
    (banned_requests, banned_columns), banned_tokens = step.banned_stop_tokens()
    biases = logit_biases(sampling_metadata)
    bad_words = sampling_metadata.bad_words_token_ids
    allowed = sampling_metadata.allowed_token_ids_mask
    penalties = not sampling_metadata.no_penalties
    if allowed is None and not bad_words and not biases and not penalties and not banned_tokens.numel():
        return logits

    request_batch_rows = step.batch_rows.tolist()  # host
    row_batch = torch.repeat_interleave(step.batch_rows, step.num_queries)  # [R] each row's batch row
    row_start = torch.cumsum(step.num_queries, 0) - step.num_queries  # each request's first row in ``rows``
    rows = torch.cat([first_logit_row[batch_row] + torch.arange(count) for batch_row, count in
                      zip(step.batch_rows.tolist(), step.num_queries.tolist(), strict=True)])
    device = logits.device
    rows_on_device = rows.to(device, non_blocking=True)
    out = logits.to(torch.float32, copy=True)
    part = out[rows_on_device]  # [R, V]: the tree rows, in request order, root row first

    histories: list[list[int]] = []
    if bad_words or penalties:  # the output so far (vLLM keeps it on the host when one of these needs it)
        outputs = sampling_metadata.output_token_ids
        for request, batch_row in zip(step.requests, request_batch_rows, strict=True):
            history = list(outputs[batch_row])
            histories.extend(history + path for path in request.row_paths())
    if allowed is not None:
        part.masked_fill_(allowed[row_batch.to(device, non_blocking=True)], float("-inf"))
    for index, (request, batch_row) in enumerate(zip(step.requests, request_batch_rows, strict=True)):
        words = bad_words.get(batch_row)
        if words:
            start = int(row_start[index])
            for column in range(request.num_nodes + 1):
                _apply_bad_words_single_batch(part[start + column], words, histories[start + column])
    if banned_tokens.numel():  # min_tokens: the stop tokens of the rows below the request's depth
        local = row_start[banned_requests] + banned_columns
        where = (local.to(device, non_blocking=True), banned_tokens.to(device, non_blocking=True))
        restored = torch.tensor([step.requests[index].stop_tokens_restored_when_all_banned
                                 for index in banned_requests.tolist()], dtype=torch.bool)
        kept = part[where] if bool(restored.any()) else None  # host flags: no device read
        part[where] = float("-inf")
        if kept is not None:  # as MinTokensLogitsProcessor for structured output: nothing else left, stop tokens back
            nothing_left = torch.isneginf(part[where[0]]).all(dim=-1)
            back = restored.to(device, non_blocking=True) & nothing_left & torch.isfinite(kept)
            part[where] = torch.where(back, kept, part[where])
    bias_rows, bias_tokens, bias_values = [], [], []
    for index, batch_row in enumerate(request_batch_rows):
        bias = biases.get(batch_row)
        if bias:
            for column in range(step.requests[index].num_nodes + 1):
                bias_rows.extend([int(row_start[index]) + column] * len(bias))
                bias_tokens.extend(bias.keys())
                bias_values.extend(bias.values())
    if bias_rows:
        where = (torch.tensor(bias_rows).to(device, non_blocking=True),
                 torch.tensor(bias_tokens).to(device, non_blocking=True))
        part[where] += torch.tensor(bias_values, dtype=torch.float32).to(device, non_blocking=True)
    if penalties:
        on_device = row_batch.to(device, non_blocking=True)
        part = apply_all_penalties(
            part, sampling_metadata.prompt_token_ids[on_device], sampling_metadata.presence_penalties[on_device],
            sampling_metadata.frequency_penalties[on_device], sampling_metadata.repetition_penalties[on_device],
            histories,
        )
    out[rows_on_device] = part
    return out
