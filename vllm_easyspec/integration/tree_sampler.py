"""Rejection sampling of a tree verify step: the target's logits in, a :class:`TreeVerdict` out (docs/design.md,
"One step through the seams", step 4). :class:`TreeRejectionSampler` is vLLM's ``RejectionSampler`` plus
:meth:`TreeRejectionSampler.verify`, which the runner calls for tree steps: requests without drafts go to vLLM's
sampler, every tree row is processed per node (:mod:`~vllm_easyspec.integration.node_logits`), then the real nodes
of the trees (never padding) go through :func:`vllm_easyspec.tree.sampling.tree_rejection_sample`. The sampler
writes nothing outside its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

from vllm_easyspec.integration.node_logits import min_p_of_rows, process_node_logits
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.sampling import tree_rejection_sample
from vllm_easyspec.tree.verify_step import AcceptedBranch, TreeVerifyStep


@dataclass
class TreeVerdict:
    """What a tree verify step decided: vLLM's sampler output for the whole batch, and the accepted branch
    of every tree request (:meth:`~vllm_easyspec.tree.verify_step.TreeVerifyStep.accepted_moves`)."""

    sampler_output: SamplerOutput
    branch: AcceptedBranch
    node_logits: torch.Tensor | None = None  # the rows the trees were verified against (options applied per node)


class TreeRejectionSampler(RejectionSampler):
    def verify(self, step: TreeVerifyStep, metadata, logits: torch.Tensor, sampling_metadata) -> TreeVerdict:
        """Sample a step whose tree requests are ``step``: ``metadata`` is vLLM's ``SpecDecodeMetadata`` of
        the step, ``logits`` the target's rows in its order (module docstring)."""
        batch = len(metadata.num_draft_tokens)
        width = metadata.max_spec_len + 1
        output = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
        if len(step) < batch:  # some rows have no tree: vLLM's sampler serves them, options and all
            bonus = self.sampler(
                logits=logits[metadata.bonus_logits_indices],
                sampling_metadata=replace(sampling_metadata, max_num_logprobs=None, logprob_token_ids=None),
                predict_bonus_token=True,
            )
            output[:, 0] = bonus.sampled_token_ids[:, 0].to(torch.int32)

        sampled_per_request = torch.tensor(metadata.num_draft_tokens, dtype=torch.long) + 1  # host: vLLM's list
        first_logit_row = sampled_per_request.cumsum(0) - sampled_per_request
        node_logits = process_node_logits(logits, step, first_logit_row, sampling_metadata)
        accepted = torch.full((len(step), max(step.trees.max_depth, 1)), -1, dtype=torch.long)
        num_accepted = torch.zeros(len(step), dtype=torch.long)
        for mode in ChildDrawMode:
            group = step.trees_with_mode(mode, device=logits.device)
            if group is None:
                continue
            indices, trees = group
            rows = step.batch_rows[indices]  # host: bookkeeping and Python indices
            if len(indices) == 1:  # one request: its logit rows are one slice, [1, 1 + width, V] (padding follows
                first = int(first_logit_row[rows[0]])  # an empty tree of width 1)
                tree_logits = node_logits[first : first + trees.width + 1].unsqueeze(0)
            else:
                tree_logits = node_logits[torch.cat([
                    torch.arange(int(first_logit_row[r]), int(first_logit_row[r]) + int(n) + 1)
                    for r, n in zip(rows.tolist(), trees.node_counts, strict=True)
                ]).to(logits.device, non_blocking=True)]
            min_p = min_p_of_rows(sampling_metadata, rows)
            result = tree_rejection_sample(
                trees,
                tree_logits,
                temperature=_rows_of(sampling_metadata.temperature, rows),
                top_k=_rows_of(sampling_metadata.top_k, rows),
                top_p=_rows_of(sampling_metadata.top_p, rows),
                min_p=None if min_p is None else min_p.to(logits.device, non_blocking=True),
                generators={i: sampling_metadata.generators[r] for i, r in enumerate(rows.tolist())
                            if r in sampling_metadata.generators},
                output_width=width,
            )
            output[rows.to(output.device, non_blocking=True)] = result.output_token_ids.to(output.dtype)
            depth = result.accepted_nodes.shape[1]
            # the accepted nodes come to the host once, on purpose: the branch's commit and bookkeeping read them
            on_host = torch.cat([result.accepted_nodes, result.num_accepted[:, None]], dim=1).cpu()
            accepted[indices, :depth] = on_host[:, :depth]
            num_accepted[indices] = on_host[:, depth]

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None or sampling_metadata.logprob_token_ids:
            logprobs_tensors = self._emitted_logprobs(step, logits, first_logit_row, sampled_per_request, accepted,
                                                      num_accepted, output, sampling_metadata)
        return TreeVerdict(SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs_tensors),
                           step.accepted_moves(accepted, num_accepted), node_logits)

    def _emitted_logprobs(self, step: TreeVerifyStep, logits: torch.Tensor, first_logit_row: torch.Tensor,
                          sampled_per_request: torch.Tensor, accepted: torch.Tensor, num_accepted: torch.Tensor,
                          output: torch.Tensor, sampling_metadata) -> LogprobsTensors:
        """The logprobs of every emitted token as vLLM's ``Sampler`` returns them without speculation, in
        ``[batch * width]`` rows (as ``RejectionSampler`` returns them and ``parse_output`` filters them): each
        token's from the raw logits of the row that predicted it, which for a tree request is its root's row, then
        each accepted node's (``accepted``, ``num_accepted``: the step's accepted nodes, on the host). The top
        ``max_num_logprobs`` and the token's rank, or, when a request of the batch asks for
        ``logprob_token_ids``, those tokens' values for every request (``Sampler.forward`` prefers them too). A
        request in a processed ``logprobs_mode`` is served without speculation
        (:func:`~vllm_easyspec.integration.tree_step.tree_fallback_reason`), so raw values are the ones every
        tree request reads."""
        batch, width = output.shape
        columns = torch.arange(width)
        last = first_logit_row + sampled_per_request - 1
        rows = torch.minimum(first_logit_row[:, None] + columns[None, :], last[:, None])  # [batch, width], host
        path = torch.cat([torch.zeros(len(step), 1, dtype=torch.long), accepted + 1], dim=1)[:, :width]
        path = torch.where(columns[None, : path.shape[1]] <= num_accepted[:, None], path, 0)
        rows[step.batch_rows, : path.shape[1]] = first_logit_row[step.batch_rows][:, None] + path
        emitted = logits[rows.flatten().to(logits.device, non_blocking=True)].to(torch.float32)
        if not self.is_logits_logprobs_mode:
            emitted = self.sampler.compute_logprobs(emitted)
        tokens = output.flatten().long()
        tokens = torch.where(tokens == PLACEHOLDER_TOKEN_ID, 0, tokens)  # rejected columns, filtered later
        if sampling_metadata.logprob_token_ids:
            by_row = {row * width + column: token_ids for row, token_ids in sampling_metadata.logprob_token_ids.items()
                      for column in range(width)}
            return self.sampler.gather_specific_token_logprobs(emitted, by_row, tokens)
        return self.sampler.gather_logprobs(emitted, sampling_metadata.max_num_logprobs, tokens)


def _rows_of(values: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[rows.to(values.device, non_blocking=True)]
