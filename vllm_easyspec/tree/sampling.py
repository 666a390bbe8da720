"""Lossless tree rejection sampling in batched torch, with vLLM's chain-shaped output.

Verification walks down the tree from the root, testing the current node's children in node order against the
(filtered) target distribution ``p``: an ``IID_FROM_DRAFT`` child ``x`` drawn from ``q`` is accepted with
``min(1, p(x)/q(x))``, else ``p <- norm(max(0, p - q))`` (SpecInfer, Miao et al. 2024, Thm. 4.2); a
``WITHOUT_REPLACEMENT`` child with probability ``p(x)``, else ``p(x) = 0`` renormalised (recursive rejection
sampling, Jeon et al. 2024). On acceptance the walk moves into the child; when every child is rejected (or at a
leaf) the bonus token is drawn from the current ``p``. Each emitted token is exactly ``p``-distributed given the
tokens before it (``tests/tree/test_tree_sampling_lossless.py``). Greedy requests (temperature <= 1e-5 or none)
take the longest path of raw-argmax tokens, ties to the smaller node index, then the argmax at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .building import ChildDrawMode, TokenTreeBatch

PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for unused output slots
SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures at or below this are greedy


def greedy_rows(temperatures, batch_size: int) -> tuple[list[bool], torch.Tensor | None]:
    """Which of the first ``batch_size`` rows are greedy, and their temperatures on the host (None when every row is
    greedy), from per-row temperatures on the host (vLLM's ``InputBatch.temperature_cpu``, 0 for greedy rows)."""
    temperature = torch.as_tensor(temperatures[:batch_size], dtype=torch.float32)
    greedy = (temperature <= SAMPLING_EPS).tolist()
    return greedy, None if all(greedy) else temperature


@dataclass
class TreeSamplerOutput:
    """Result of :func:`tree_rejection_sample`.

    * ``output_token_ids`` ``[B, W]`` int32: accepted path tokens, then the bonus token, then
      ``-1`` (vLLM's ``sampled_token_ids`` contract; ``W >= max_depth + 1``).
    * ``accepted_nodes`` ``[B, max_depth]`` int64: node indices of the accepted path, root side
      first (depth ``k + 1`` in column ``k``), -1 padded. Feed to KV compaction.
    * ``num_accepted`` ``[B]`` int64: length of the accepted path (draft tokens kept).
    """

    output_token_ids: torch.Tensor
    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def bonus_token_ids(self) -> torch.Tensor:
        return self.output_token_ids.long().gather(1, self.num_accepted[:, None])[:, 0]


def apply_sampling_constraints(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature, then min-p, then top-k, then top-p on ``logits`` ``[R, V]`` (per-row parameters ``[R]``).

    Mirrors vLLM 0.32's sampler (``Sampler.sample``: temperature, the argmax-invariant ``MinPLogitsProcessor``,
    then ``apply_top_k_top_p_pytorch``): greedy rows (temperature <= eps) are scaled by 1; min-p removes the
    tokens whose probability is below ``min_p`` times the row's largest (0 disables it); top-k keeps
    every logit >= the k-th largest (ties kept; ``k >= V`` or ``k <= 0`` disables it); top-p
    removes the smallest-probability tokens whose cumulative mass is <= 1 - p, always keeping the
    most likely one. Returns a new float32 tensor; the input is not modified.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temp = torch.where(temperature <= SAMPLING_EPS, torch.ones_like(temperature), temperature).float()
    logits = logits / temp[:, None]
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.float()[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        threshold = logits_sort.gather(1, (vocab - k)[:, None])
        logits_sort = logits_sort.masked_fill(logits_sort < threshold, float("-inf"))
    if top_p is not None:
        cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - top_p.float()[:, None]
        remove[:, -1] = False
        logits_sort = logits_sort.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, logits_idx, logits_sort)


def _padded_rows(tree: TokenTreeBatch, rows: torch.Tensor, name: str) -> torch.Tensor:
    """Accept ``[B, N + 1, V]`` or vLLM's flat ``[sum(num_nodes + 1), V]``; return ``[B, N + 1, V]``."""
    width = tree.width + 1
    if rows.ndim == 3:
        if tuple(rows.shape[:2]) != (tree.batch_size, width):
            raise ValueError(f"{name} must be [batch, nodes + 1, vocab] = [{tree.batch_size}, {width}, V]; "
                             f"got {tuple(rows.shape)}.")
        return rows
    per_request = tree.num_nodes + 1
    flat_rows = sum(tree.node_counts) + tree.batch_size
    if rows.ndim != 2 or rows.shape[0] != flat_rows:
        raise ValueError(f"{name} must be [B, nodes + 1, V] or flat [sum(num_nodes + 1) = "
                         f"{flat_rows}, V]; got {tuple(rows.shape)}.")
    out = rows.new_zeros(tree.batch_size, width, rows.shape[1])
    valid = torch.arange(width, device=rows.device)[None, :] < per_request[:, None]
    out[valid] = rows
    return out


def _draw_randomness(
    batch: int,
    num_nodes: int,
    vocab: int,
    device: torch.device,
    generator: torch.Generator | None,
    generators: Mapping[int, torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One uniform per node (its acceptance test) and one ``Exp(1)`` row per request (its single
    categorical draw, done as ``argmax(p / E)``). Requests in ``generators`` draw from their own."""
    uniforms = torch.rand(batch, num_nodes, dtype=torch.float64, device=device, generator=generator)
    exponentials = torch.empty(batch, vocab, device=device).exponential_(generator=generator)
    for b, gen in (generators or {}).items():
        uniforms[b] = torch.rand(num_nodes, dtype=torch.float64, device=device, generator=gen)
        exponentials[b].exponential_(generator=gen)
    return uniforms, exponentials.clamp_min_(torch.finfo(torch.float32).tiny)


def _may_hold_any(mask: torch.Tensor) -> bool:
    """Whether ``mask`` may hold a True: read on the host, where that is free; on a device assumed (the work it
    would skip is exact either way, and reading it would make the host wait)."""
    return bool(mask.any()) if mask.device.type == "cpu" else True


def _greedy(tree: TokenTreeBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deepest node whose whole path matches the target argmax; returns (node or -1, bonus)."""
    # float32 first: same first-maximum tie rule as vLLM's greedy sampler, and torch's CPU argmax is about
    # 4x slower on bfloat16 than the conversion plus a float32 argmax
    argmax_rows = logits.float().argmax(-1)  # [B, N + 1]
    match = tree.valid & (tree.tokens == argmax_rows.gather(1, tree.parents + 1))
    ok = match
    for _ in range(tree.max_depth):
        parent_ok = torch.where(tree.parents >= 0, ok.gather(1, tree.parents.clamp(min=0)), True)
        ok = match & parent_ok
    width = tree.width
    index = torch.arange(width, device=tree.device)
    score = torch.where(ok, tree.depth * (width + 1) + (width - index), torch.zeros_like(tree.depth))
    best_score, best = score.max(dim=1)
    best = torch.where(best_score > 0, best, torch.full_like(best, -1))
    bonus = argmax_rows.gather(1, (best + 1)[:, None])[:, 0]
    return best, bonus


def _stochastic(
    tree: TokenTreeBatch,
    target_probs: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk the trees of ``rows`` (bool ``[B]``); returns (accepted_nodes, num_accepted, bonus)."""
    batch = tree.batch_size
    arange = torch.arange(batch, device=tree.device)
    children = tree.children_table()
    iid = tree.draw_mode is ChildDrawMode.IID_FROM_DRAFT
    draft = tree.draft_probs.float() if iid else None
    accepted = torch.full((batch, max(tree.max_depth, 1)), -1, dtype=torch.long, device=tree.device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=tree.device)
    bonus = torch.zeros(batch, dtype=torch.long, device=tree.device)
    cur = torch.zeros(batch, dtype=torch.long, device=tree.device)  # query row; 0 = root
    alive = rows.clone()
    for depth in range(tree.max_depth + 1):
        if not _may_hold_any(alive):
            break
        p = target_probs(cur)
        q = draft[arange, cur] if iid else None
        moved = torch.zeros_like(alive)
        nxt = cur.clone()
        for rank in range(children.shape[2]):
            child = children[arange, cur, rank]
            test = alive & ~moved & (child >= 0)
            if not _may_hold_any(test):
                break
            safe_child = child.clamp(min=0)
            x = tree.tokens[arange, safe_child].clamp(min=0)
            px = p.gather(1, x[:, None])[:, 0]
            if iid:
                qx = q.gather(1, x[:, None])[:, 0]
                ratio = px / qx.clamp_min(torch.finfo(torch.float32).tiny)
                residual = (p - q).clamp_min(0.0)
            else:
                ratio = px
                residual = p.scatter(1, x[:, None], 0.0)
            accept = test & (uniforms[arange, safe_child] < ratio.double())
            reject = test & ~accept
            mass = residual.sum(-1, keepdim=True)
            # mass == 0 only if p == q up to rounding, where rejection has probability ~0: keep p.
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
            p = torch.where(reject[:, None], residual, p)
            moved |= accept
            nxt = torch.where(accept, child + 1, nxt)
        finishing = alive & ~moved
        drawn = (p / exponentials).argmax(-1)
        bonus = torch.where(finishing, drawn, bonus)
        if depth < accepted.shape[1]:
            accepted[:, depth] = torch.where(moved, nxt - 1, accepted[:, depth])
        num_accepted += moved.long()
        alive &= moved
        cur = nxt
    return accepted, num_accepted, bonus


def tree_rejection_sample(
    tree: TokenTreeBatch,
    target_logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    generators: Mapping[int, torch.Generator] | None = None,
    output_width: int | None = None,
) -> TreeSamplerOutput:
    """Verify a batch of token trees against the target and emit vLLM chain-shaped output.

    Args:
        tree: the draft trees; ``tree.draw_mode`` selects the verification rule and
            ``tree.draft_probs`` supplies ``q`` for ``IID_FROM_DRAFT``.
        target_logits: raw target logits in query order, ``[B, N + 1, V]`` or vLLM's flat
            ``[sum(num_nodes + 1), V]`` (row 0 of a request = after its root).
        temperature, top_k, top_p, min_p: per-request ``[B]`` sampling parameters (vLLM semantics, see
            :func:`apply_sampling_constraints`). ``temperature=None`` means all greedy; min-p, like top-k and
            top-p, shapes only sampled rows (it never changes an argmax).
        generator: default random source; ``generators`` maps batch rows to their own generator
            (vLLM's per-request seeds). Randomness is drawn up front: one uniform per node and one
            exponential row per request, so results do not depend on batch composition for seeded
            requests.
        output_width: width ``W`` of ``output_token_ids`` (vLLM uses ``max_spec_len + 1``);
            default ``tree.max_depth + 1``.
    """
    if tree.device != target_logits.device:
        raise ValueError(f"the trees are on {tree.device} but the target logits on {target_logits.device}; build "
                         "the TokenTreeBatch on the logits' device")
    logits = _padded_rows(tree, target_logits, "target_logits")
    batch, width, vocab = logits.shape
    if tree.draw_mode is ChildDrawMode.IID_FROM_DRAFT and tree.draft_probs.shape[2] != vocab:
        raise ValueError(f"draft_probs vocab ({tree.draft_probs.shape[2]}) != target vocab ({vocab}).")
    out_width = tree.max_depth + 1 if output_width is None else output_width
    if out_width < tree.max_depth + 1:
        raise ValueError(f"output_width={out_width} < max_depth + 1 = {tree.max_depth + 1}.")

    greedy_node, greedy_bonus = _greedy(tree, logits)
    accepted = torch.where(greedy_node[:, None] >= 0,
                           tree.ancestors.gather(1, greedy_node.clamp(min=0)[:, None, None]
                                                 .expand(-1, 1, tree.ancestors.shape[2]))[:, 0],
                           torch.full_like(tree.ancestors[:, 0], -1))
    num_accepted = torch.where(greedy_node >= 0, tree.depth.gather(1, greedy_node.clamp(min=0)[:, None])[:, 0],
                               torch.zeros_like(greedy_node))
    bonus = greedy_bonus

    if temperature is not None:
        temperature = temperature.to(logits.device).float().reshape(-1)
        stochastic_rows = temperature > SAMPLING_EPS
        if _may_hold_any(stochastic_rows):
            def target_probs(rows: torch.Tensor) -> torch.Tensor:
                """Filtered target probabilities after query row ``rows[b]`` of every request ``b``: only
                the rows the walk visits (one per depth) are filtered and normalised."""
                return apply_sampling_constraints(
                    logits[torch.arange(batch, device=logits.device), rows], temperature,
                    None if top_k is None else top_k.to(logits.device).reshape(-1),
                    None if top_p is None else top_p.to(logits.device).reshape(-1),
                    None if min_p is None else min_p.to(logits.device).reshape(-1),
                ).softmax(-1)

            uniforms, exponentials = _draw_randomness(batch, tree.width, vocab, logits.device, generator,
                                                      generators)
            s_acc, s_num, s_bonus = _stochastic(tree, target_probs, stochastic_rows, uniforms, exponentials)
            depth_cols = accepted.shape[1]
            accepted = torch.where(stochastic_rows[:, None], s_acc[:, :depth_cols], accepted)
            num_accepted = torch.where(stochastic_rows, s_num, num_accepted)
            bonus = torch.where(stochastic_rows, s_bonus, bonus)

    path_tokens = tree.tokens.gather(1, accepted.clamp(min=0))
    cols = torch.arange(out_width, device=logits.device)
    out = torch.full((batch, out_width), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=logits.device)
    out[:, : accepted.shape[1]] = torch.where(accepted >= 0, path_tokens, out[:, : accepted.shape[1]])
    out = torch.where(cols[None, :] == num_accepted[:, None], bonus[:, None], out)
    return TreeSamplerOutput(output_token_ids=out.int(), accepted_nodes=accepted, num_accepted=num_accepted)
