"""Rejection sampling of a tree verify step: the target's logits in, a :class:`TreeVerdict` out.

:class:`TreeRejectionSampler` is vLLM's ``RejectionSampler`` (whose sampler, logprobs mode and logprobs
helpers it reuses) with one more entry point, :meth:`TreeRejectionSampler.verify`, which the runner calls for
steps with token trees (chain steps go to vLLM's own ``forward``). In a tree step every request either has a
tree (its drafts are the tree's nodes) or no drafts at all (prefills, and requests served without
speculation):

* requests without drafts are sampled by vLLM's own sampler on their one row, so penalties, bad words,
  logits processors and logprobs apply exactly as in vLLM;
* tree requests go through :func:`vllm_easyspec.tree.sampling.tree_rejection_sample`: greedy rows take the
  longest argmax path, sampled rows use the rule their tree's draw mode names (multi-step speculative
  sampling for i.i.d. children, recursive rejection sampling for top-k children), with the request's
  temperature, top-k, top-p and seed; under ``min_tokens`` the stop tokens are masked in the rows whose
  token would be one of the first ``min_tokens`` outputs (a row's output index depends only on its depth).

The verdict's output is vLLM's chain shape (accepted tokens, then the bonus token, then -1), on the logits'
device, so the scheduler's rollback and bookkeeping see a chain; its accepted branch (on the host) is what the
runner commits. The sampler writes nothing outside its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.sampling import tree_rejection_sample
from vllm_easyspec.tree.verify_step import AcceptedBranch, TreeVerifyStep


@dataclass
class TreeVerdict:
    """What a tree verify step decided: vLLM's sampler output for the whole batch, and the accepted branch
    of every tree request (:meth:`~vllm_easyspec.tree.verify_step.TreeVerifyStep.accepted_moves`)."""

    sampler_output: SamplerOutput
    branch: AcceptedBranch


class TreeRejectionSampler(RejectionSampler):
    def verify(self, step: TreeVerifyStep, metadata, logits: torch.Tensor, sampling_metadata) -> TreeVerdict:
        """Sample a step whose tree requests are ``step``: ``metadata`` is vLLM's ``SpecDecodeMetadata`` of
        the step, ``logits`` the target's rows in its order (module docstring)."""
        batch = len(metadata.num_draft_tokens)
        width = metadata.max_spec_len + 1
        output = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
        bonus = None
        if len(step) < batch or sampling_metadata.max_num_logprobs is not None:  # some rows have no tree
            bonus = self.sampler(
                logits=logits[metadata.bonus_logits_indices],
                sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
                predict_bonus_token=True,
                logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits",
            )
            output[:, 0] = bonus.sampled_token_ids[:, 0].to(torch.int32)

        sampled_per_request = torch.tensor(metadata.num_draft_tokens, dtype=torch.long) + 1  # host: vLLM's list
        first_logit_row = sampled_per_request.cumsum(0) - sampled_per_request
        (banned_requests, banned_columns), banned_tokens = step.banned_stop_tokens()
        if banned_tokens.numel():  # min_tokens: stop tokens are masked in the first rows, by depth
            logits = logits.clone()
            banned_rows = first_logit_row[step.batch_rows[banned_requests]] + banned_columns
            logits[banned_rows.to(logits.device, non_blocking=True),
                   banned_tokens.to(logits.device, non_blocking=True)] = float("-inf")
        accepted = torch.full((len(step), max(step.trees.max_depth, 1)), -1, dtype=torch.long)
        num_accepted = torch.zeros(len(step), dtype=torch.long)
        for mode in ChildDrawMode:
            group = step.trees_with_mode(mode, device=logits.device)
            if group is None:
                continue
            indices, trees = group
            rows = step.batch_rows[indices]  # host: bookkeeping and Python indices
            if len(indices) == 1:  # one request: its logit rows are one slice, [1, 1 + n, V]
                first = int(first_logit_row[rows[0]])
                tree_logits = logits[first : first + trees.node_counts[0] + 1].unsqueeze(0)
            else:
                tree_logits = logits[torch.cat([
                    torch.arange(int(first_logit_row[r]), int(first_logit_row[r]) + int(n) + 1)
                    for r, n in zip(rows.tolist(), trees.node_counts, strict=True)
                ]).to(logits.device, non_blocking=True)]
            result = tree_rejection_sample(
                trees,
                tree_logits,
                temperature=_rows_of(sampling_metadata.temperature, rows),
                top_k=_rows_of(sampling_metadata.top_k, rows),
                top_p=_rows_of(sampling_metadata.top_p, rows),
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
        if sampling_metadata.max_num_logprobs is not None:
            # Only requests without drafts may ask for logprobs (the others fall back), so vLLM's own
            # computation over the bonus rows is the right one for every request that reads them.
            raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits, raw_target_logits,
                bonus.logprobs_tensors.logprobs, output,
            )
        return TreeVerdict(SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs_tensors),
                           step.accepted_moves(accepted, num_accepted))


def _rows_of(values: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[rows.to(values.device, non_blocking=True)]
