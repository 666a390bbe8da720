"""Drafting a batch of token trees level by level, independent of the model that scores them: one forward per level
over the *frontier* (the nodes of one depth that get children). Static trees take the template's nodes of each
depth that have children, their children the ``r``-th most likely tokens (``WITHOUT_REPLACEMENT``) or i.i.d. draws
from ``q = softmax(logits / temperature)`` (``IID_FROM_DRAFT``, each expanded node's ``q`` kept); dynamic trees
(EAGLE-2) take the ``top_k`` best candidates of the last depth (:class:`~.building.DynamicTopKTreeBuilder`).

The *stash* is every node forwarded so far, in forward order; the model keeps their K/V. Invariant: every
ancestor of a frontier node is in the stash (children are only drawn from forwarded nodes), so
:meth:`LevelwiseTreeDraft.frontier_mask` is the frontier's complete tree-attention mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .building import ChildDrawMode, DynamicTopKTreeBuilder, StaticTreeTemplate
from .config import TreeConfig


@dataclass
class DraftedTrees:
    """The result: node tokens and parents ``[B, N]`` (draft vocabulary), each node's draft log-probability
    given its parent ``[B, N]`` (at temperature 1), per-row draw modes, and for rows drawn ``IID_FROM_DRAFT``
    their ``q`` rows ``[N + 1, V]`` (row 0 after the root, row ``i + 1`` after node ``i``; rows of leaves are
    zero)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    logprobs: torch.Tensor
    draw_modes: list[ChildDrawMode]
    draft_probs: dict[int, torch.Tensor]


class LevelwiseTreeDraft:
    """Level-by-level tree drafting for a batch (see the module docstring).

    Protocol: construct with the root logits ``[B, V]``; while not :attr:`done`, forward
    :meth:`frontier_tokens` (at depth :attr:`frontier_depth`, masked by :meth:`frontier_mask` over the
    stash plus the frontier itself) and pass the logits ``[B, F, V]`` to :meth:`expand`; then :meth:`build`.
    """

    def __init__(self, config: TreeConfig, root_logits: torch.Tensor, greedy_rows: Sequence[bool],
                 temperatures: torch.Tensor | None = None, generators: Mapping[int, torch.Generator] | None = None
                 ) -> None:
        self.config = config
        self.batch = root_logits.shape[0]
        self.device = root_logits.device
        self.draw_modes = [config.draw_mode(bool(greedy)) for greedy in greedy_rows]
        if len(self.draw_modes) != self.batch:
            raise ValueError(f"{len(self.draw_modes)} greedy flags for {self.batch} rows")
        self.temperatures = temperatures
        self.generators = dict(generators or {})
        self.stash = torch.zeros(self.batch, 0, dtype=torch.long, device=self.device)  # node / candidate ids
        self.frontier_depth = 1
        if config.is_static:
            self.template: StaticTreeTemplate = config.template()
            self._levels = self.template.expansion_levels()
            self._children = {p: [i for i, q in enumerate(self.template.parents) if q == p]
                              for level in self._levels for p in level}
            self._parents = torch.tensor(self.template.parents, dtype=torch.long, device=self.device)
            self.tokens = torch.full((self.batch, self.template.num_nodes), -1, dtype=torch.long, device=self.device)
            self.logprobs = torch.zeros(self.batch, self.template.num_nodes, device=self.device)
            self.draft_probs: dict[int, torch.Tensor] = {}
            self._level = 0
            self._expand_static([-1], root_logits[:, None])
        else:
            self.dynamic = DynamicTopKTreeBuilder(
                torch.log_softmax(root_logits.float(), dim=-1),
                top_k=config.top_k, max_depth=config.depth, budget=config.budget,
            )

    # ------------------------------------------------------------------------------------------ frontier
    @property
    def done(self) -> bool:
        if self.config.is_static:
            return self._level >= len(self._levels)
        return self.dynamic.done

    def _frontier_ids(self) -> torch.Tensor:
        """``[B, F]`` node (static) or candidate (dynamic) ids of the frontier."""
        if self.config.is_static:
            nodes = torch.tensor(self._levels[self._level], dtype=torch.long, device=self.device)
            return nodes[None, :].expand(self.batch, -1)
        return self.dynamic.frontier

    def _parent_table(self) -> torch.Tensor:
        if self.config.is_static:
            return self._parents[None, :].expand(self.batch, -1)
        return self.dynamic.candidate_parents

    def frontier_tokens(self) -> torch.Tensor:
        """``[B, F]`` draft-vocabulary tokens to forward at depth :attr:`frontier_depth`."""
        if self.config.is_static:
            return self.tokens.gather(1, self._frontier_ids())
        return self.dynamic.frontier_tokens

    def frontier_mask(self) -> torch.Tensor:
        """``[B, F, S + F]`` bool: frontier row ``f`` sees stash column ``s`` iff that node is its ancestor,
        and frontier column ``S + f`` (itself)."""
        frontier = self._frontier_ids()
        parents = self._parent_table()
        width = frontier.shape[1]
        ancestors = torch.zeros(self.batch, width, self.stash.shape[1], dtype=torch.bool, device=self.device)
        current = frontier
        for _ in range(self.frontier_depth):
            current = torch.where(current >= 0, parents.gather(1, current.clamp(min=0)), current)
            ancestors |= (self.stash[:, None, :] == current[:, :, None]) & (current[:, :, None] >= 0)
        itself = torch.eye(width, dtype=torch.bool, device=self.device).expand(self.batch, -1, -1)
        return torch.cat([ancestors, itself], dim=2)

    def frontier_parent_columns(self) -> torch.Tensor:
        """``[B, F]`` stash column of each frontier node's parent, -1 for children of the root. A drafter that
        feeds each node its parent's output (an EAGLE head's hidden state) reads the stash with these."""
        frontier = self._frontier_ids()
        parents = torch.where(frontier >= 0, self._parent_table().gather(1, frontier.clamp(min=0)), -1)
        if self.stash.shape[1] == 0:
            return torch.full_like(parents, -1)
        column = (self.stash[:, None, :] == parents[:, :, None]).int().argmax(dim=2)
        return torch.where(parents >= 0, column, -1)

    def frontier_paths(self, rows: list[int]) -> list[list[list[int]]]:
        """For each of ``rows``, each frontier node's tokens from the root's child down to the node; one read of
        those rows to the host (a grammar walks the paths there)."""
        tokens = self.tokens if self.config.is_static else self.dynamic.candidate_tokens
        frontier = self._frontier_ids()
        index = torch.tensor(rows, device=self.device)
        table = torch.cat([tokens, self._parent_table(), frontier], dim=1)[index].tolist()
        count = tokens.shape[1]
        paths = []
        for row in table:
            row_paths = []
            for node in row[2 * count:]:
                path = []
                while node >= 0:
                    path.append(row[node])
                    node = row[count + node]
                row_paths.append(path[::-1])
            paths.append(row_paths)
        return paths

    # ------------------------------------------------------------------------------------------ expansion
    def expand(self, logits: torch.Tensor) -> None:
        """Children of the frontier from its draft logits ``[B, F, V]``; the frontier joins the stash."""
        if self.done:
            raise RuntimeError("every level is drafted; call build()")
        frontier = self._frontier_ids()
        if tuple(logits.shape[:2]) != tuple(frontier.shape):
            raise ValueError(f"logits must be [batch, frontier, vocab] = {tuple(frontier.shape)} + (V,); "
                             f"got {tuple(logits.shape)}")
        self.stash = torch.cat([self.stash, frontier], dim=1)
        if self.config.is_static:
            self._expand_static(self._levels[self._level], logits)
        else:
            self.dynamic.expand(torch.log_softmax(logits.float(), dim=-1))
        self.frontier_depth += 1

    def _expand_static(self, nodes: list[int], logits: torch.Tensor) -> None:
        logits = logits.float()
        vocab = logits.shape[-1]
        for column, parent in enumerate(nodes):
            children = self._children[parent]
            ranks = [self.template.ranks[c] for c in children]
            top = torch.topk(logits[:, column], max(ranks) + 1, dim=-1).indices[:, ranks]  # [B, children]
            for row, mode in enumerate(self.draw_modes):
                if mode is ChildDrawMode.WITHOUT_REPLACEMENT:
                    self.tokens[row, children] = top[row]
                    continue
                temperature = 1.0 if self.temperatures is None else float(self.temperatures[row])
                q = torch.softmax(logits[row, column] / temperature, dim=-1)
                probs = self.draft_probs.setdefault(
                    row, torch.zeros(self.template.num_nodes + 1, vocab, device=self.device))
                probs[parent + 1] = q
                self.tokens[row, children] = torch.multinomial(
                    q, len(children), replacement=True, generator=self.generators.get(row))
            self.logprobs[:, children] = torch.log_softmax(logits[:, column], dim=-1).gather(1, self.tokens[:, children])
        self._level += 1

    def build(self) -> DraftedTrees:
        if not self.done:
            raise RuntimeError("levels are still missing")
        if self.config.is_static:
            parents = self._parents[None, :].expand(self.batch, -1).clone()
            return DraftedTrees(self.tokens.clone(), parents, self.logprobs.clone(), self.draw_modes, self.draft_probs)
        dynamic = self.dynamic
        tokens, parents = dynamic.select()  # checked by the verify step's host trees, not here on the device
        scores = dynamic.candidate_scores
        kept = dynamic.kept_candidates
        parent_candidates = dynamic.candidate_parents.gather(1, kept)
        parent_scores = torch.where(parent_candidates >= 0, scores.gather(1, parent_candidates.clamp(min=0)), 0.0)
        return DraftedTrees(tokens, parents, scores.gather(1, kept) - parent_scores, self.draw_modes, {})
