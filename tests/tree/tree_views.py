"""Views of a :class:`TokenTreeBatch` and a static-tree builder that only the tests use: the kernels' ancestor
mask from query parents, the verify-forward layout in query order (the engine builds its own in
``vllm_easyspec.tree.verify_step``), node positions, leaves and root-to-leaf paths, and :class:`StaticTreeBuilder`,
which fills a choice list from draft log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_easyspec.tree.building import ChildDrawMode, StaticTreeTemplate, TokenTreeBatch


def ancestor_mask_from_parents(parents: torch.Tensor, cu_query_lens: torch.Tensor, width: int | None = None
                               ) -> torch.Tensor:
    """The kernels' ``tree_mask`` ``[T, W]`` from request-local parents ``[T]`` (-1: none; parents first): row ``t``
    attends to query ``j`` iff ``j`` is ``t`` or one of its ancestors."""
    cu = cu_query_lens.tolist()
    lens = [end - start for start, end in zip(cu, cu[1:], strict=False)]
    table = torch.full((len(lens), max(lens, default=1)), -1, dtype=torch.long)
    for request, n in enumerate(lens):
        table[request, :n] = parents[cu[request]: cu[request] + n].cpu()
    trees = TokenTreeBatch(torch.zeros_like(table), table, torch.tensor(lens), ChildDrawMode.WITHOUT_REPLACEMENT)
    mask = trees.ancestor_mask()[trees.valid]  # [T, max(lens)]
    width = max(lens, default=0) if width is None else width
    return torch.nn.functional.pad(mask, (0, max(width - mask.shape[1], 0)))[:, :width].to(parents.device)


def node_positions(tree: TokenTreeBatch, prefix_lens: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` RoPE positions of the nodes: ``prefix_len + depth`` (-1 for padding)."""
    pos = prefix_lens.to(tree.device).long()[:, None] + tree.depth
    return torch.where(tree.valid, pos, torch.full_like(pos, -1))


def is_leaf(tree: TokenTreeBatch) -> torch.Tensor:
    """``[B, N]`` bool: real nodes without real children."""
    has_child = torch.zeros(tree.batch_size, tree.width + 1, dtype=torch.bool, device=tree.device)
    has_child.scatter_(1, (tree.parents + 1).masked_fill(~tree.valid, 0), tree.valid)
    return tree.valid & ~has_child[:, 1:]


def root_to_leaf_paths(tree: TokenTreeBatch) -> torch.Tensor:
    """``[B, L, D]`` node indices of every root-to-leaf path (leaves in node order), -1 padded."""
    leaf = is_leaf(tree)
    num_leaves = int(leaf.sum(1).max()) if leaf.any() else 0
    paths = torch.full((tree.batch_size, max(num_leaves, 1), max(tree.max_depth, 1)), -1,
                       dtype=torch.long, device=tree.device)
    order = torch.argsort((~leaf).to(torch.int8), dim=1, stable=True)[:, :num_leaves]
    picked = torch.gather(tree.ancestors, 1, order[:, :, None].expand(-1, -1, tree.ancestors.shape[2]))
    keep = torch.gather(leaf, 1, order)
    paths[:, :num_leaves, : tree.ancestors.shape[2]] = torch.where(keep[:, :, None], picked, -1)
    return paths


@dataclass
class VerifyLayout:
    """Flattened query rows of one verify forward; ``T = sum(num_nodes + 1)``.

    * ``cu_query_lens`` ``[B + 1]``: rows of request ``b`` are ``cu[b]:cu[b + 1]``; the first is the root.
    * ``parents`` ``[T]``: request-local query index of the parent, -1 for the root.
    * ``positions`` ``[T]``: ``prefix_len + depth`` (root depth 0).
    * ``ancestor_mask`` ``[T, N + 1]`` bool: ``mask[t, j]`` iff request-local query ``j`` is an
      ancestor of (or equal to) row ``t``; this is the mask the attention kernels take.
    * slots are linear: row ``t`` of request ``b`` owns logical slot ``prefix_lens[b] + (t - cu[b])``.
    """

    cu_query_lens: torch.Tensor
    prefix_lens: torch.Tensor
    parents: torch.Tensor
    positions: torch.Tensor
    ancestor_mask: torch.Tensor
    query_tokens_without_root: torch.Tensor


def verify_layout(tree: TokenTreeBatch, prefix_lens: torch.Tensor) -> VerifyLayout:
    """Flattened per-query layout of the target's verify forward (root + nodes per request)."""
    prefix_lens = prefix_lens.to(tree.device).long().reshape(-1)
    queries_per_request = tree.num_nodes + 1
    cu = torch.zeros(tree.batch_size + 1, dtype=torch.long, device=tree.device)
    cu[1:] = queries_per_request.cumsum(0)
    width = tree.width + 1
    valid_q = torch.arange(width, device=tree.device)[None, :] < queries_per_request[:, None]
    parent_q = torch.cat([torch.full_like(tree.parents[:, :1], -1), tree.parents + 1], dim=1)
    depth_q = torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], dim=1)
    token_q_mask = torch.zeros(tree.batch_size, width, width, dtype=torch.bool, device=tree.device)
    token_q_mask[:, :, 0] = True
    token_q_mask[:, 1:, 1:] = tree.ancestor_mask()
    return VerifyLayout(
        cu_query_lens=cu,
        prefix_lens=prefix_lens,
        parents=parent_q[valid_q],
        positions=(prefix_lens[:, None] + depth_q)[valid_q],
        ancestor_mask=token_q_mask[valid_q],
        query_tokens_without_root=tree.tokens[tree.valid],
    )


class StaticTreeBuilder:
    """Fills a :class:`StaticTreeTemplate` with tokens, one depth level at a time.

    Protocol (per step ``d``): read ``nodes_to_expand()`` (node indices, -1 = root) and
    ``partial_tokens`` (tokens known so far, -1 where not yet drawn), run the draft model on those
    nodes, and pass their log-probabilities ``[B, len(nodes_to_expand()), V]`` to :meth:`expand`.
    After ``template.max_depth`` steps call :meth:`build`.

    ``WITHOUT_REPLACEMENT``: child of rank ``r`` = the ``r``-th most likely draft token (ties broken
    by ``torch.topk``'s order); deterministic, no generator used.
    ``IID_FROM_DRAFT``: child of rank ``r`` = an independent sample from ``softmax(logprobs)``; the
    probabilities of every expanded node are kept for the sampler.
    """

    def __init__(
        self,
        template: StaticTreeTemplate | Sequence[Sequence[int]],
        batch_size: int,
        draw_mode: ChildDrawMode | str,
        *,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        self.template = (
            template if isinstance(template, StaticTreeTemplate) else StaticTreeTemplate.from_choices(template)
        )
        self.draw_mode = ChildDrawMode(draw_mode)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.generator = generator
        self._levels = self.template.expansion_levels()
        self._step = 0
        self.partial_tokens = torch.full((batch_size, self.template.num_nodes), -1, dtype=torch.long,
                                         device=self.device)
        self._draft_probs: torch.Tensor | None = None
        self._children_of = {p: [i for i, q in enumerate(self.template.parents) if q == p]
                             for level in self._levels for p in level}

    @property
    def done(self) -> bool:
        return self._step >= len(self._levels)

    def nodes_to_expand(self) -> list[int]:
        if self.done:
            raise RuntimeError("all levels are expanded; call build().")
        return list(self._levels[self._step])

    def expand(self, logprobs: torch.Tensor) -> None:
        """Draw the children of ``nodes_to_expand()`` from their draft log-probs ``[B, F, V]``."""
        nodes = self.nodes_to_expand()
        if logprobs.ndim != 3 or tuple(logprobs.shape[:2]) != (self.batch_size, len(nodes)):
            raise ValueError(
                f"logprobs must be [batch, len(nodes_to_expand()), vocab] = [{self.batch_size}, {len(nodes)}, V];"
                f" got {tuple(logprobs.shape)}."
            )
        vocab = logprobs.shape[2]
        logprobs = logprobs.float()
        if self.draw_mode is ChildDrawMode.IID_FROM_DRAFT and self._draft_probs is None:
            self._draft_probs = torch.zeros(self.batch_size, self.template.num_nodes + 1, vocab,
                                            device=self.device)
        for f, parent in enumerate(nodes):
            children = self._children_of[parent]
            ranks = [self.template.ranks[c] for c in children]
            if self.draw_mode is ChildDrawMode.WITHOUT_REPLACEMENT:
                if max(ranks) >= vocab:
                    raise ValueError(f"choice rank {max(ranks)} needs at least {max(ranks) + 1} vocab entries.")
                top = torch.topk(logprobs[:, f], max(ranks) + 1, dim=-1).indices
                self.partial_tokens[:, children] = top[:, ranks]
            else:
                probs = logprobs[:, f].softmax(-1)
                self._draft_probs[:, parent + 1] = probs
                draws = torch.multinomial(probs, len(children), replacement=True, generator=self.generator)
                self.partial_tokens[:, children] = draws
        self._step += 1

    def build(self) -> TokenTreeBatch:
        if not self.done:
            raise RuntimeError(f"{len(self._levels) - self._step} expansion level(s) still missing.")
        parents = torch.tensor(self.template.parents, dtype=torch.long, device=self.device)
        return TokenTreeBatch(
            tokens=self.partial_tokens.clone(),
            parents=parents.expand(self.batch_size, -1).clone(),
            num_nodes=torch.full((self.batch_size,), self.template.num_nodes, device=self.device),
            draw_mode=self.draw_mode,
            draft_probs=self._draft_probs,
        )
