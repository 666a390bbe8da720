"""Token trees for speculative decoding: the batched tree object, static tree templates and the EAGLE-2 builder.

Layout conventions (shared by every module in :mod:`vllm_easyspec.tree` and by the kernels)
---------------------------------------------------------------------------------------------
* A request's *root* is its last verified token (the previous step's bonus token). It is not a tree node. Its
  position is ``prefix_len`` = the number of tokens whose K/V is already cached.
* Draft nodes ``0 .. num_nodes-1`` are stored in a fixed topological order: ``parents[i] < i``.
  ``parents[i] == -1`` means "child of the root". ``depth[i] >= 1`` (root children have depth 1).
* The verify forward of the target feeds, per request, the root followed by the nodes in node order: *query
  index* ``j = 0`` is the root, ``j = i + 1`` is node ``i``. This is exactly vLLM's linear slot accounting:
  query ``j`` writes its K/V to logical slot ``prefix_len + j``.
* Positions (RoPE) follow the tree, not the slots: node ``i`` sits at ``prefix_len + depth[i]``.
* Target logits arrive in the same query order (row 0 = distribution after the root, row ``i + 1`` =
  distribution after node ``i``), which is how vLLM orders ``logits_indices``.
* After acceptance, the accepted nodes' K/V move from ``prefix_len + 1 + node`` to ``prefix_len + depth``
  (see :mod:`vllm_easyspec.tree.compaction`).

How children were drawn is recorded in :class:`ChildDrawMode`; the sampler picks its verification rule from it
and never guesses.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# vLLM v1 caps speculative tokens per request at this value (vllm/v1/sample/rejection_sampler.py).
MAX_TREE_NODES = 128

Choice = tuple[int, ...]


class ChildDrawMode(enum.StrEnum):
    """How the proposer obtained the children of every tree node. ``IID_FROM_DRAFT``: independent samples from the
    draft distribution ``q(. | path to node)`` (duplicates allowed), verified by SpecInfer multi-step speculative
    sampling, which needs ``q`` at every expanded node. ``WITHOUT_REPLACEMENT``: distinct tokens that are a
    deterministic function of the context (top-k, choice lists, EAGLE-2), verified by recursive rejection sampling
    with one-hot ``q``."""

    IID_FROM_DRAFT = "iid_from_draft"
    WITHOUT_REPLACEMENT = "without_replacement"


def _check_budget(num_nodes: int, what: str) -> None:
    if num_nodes <= 0:
        raise ValueError(f"{what}: the tree is empty (0 draft nodes); give at least one node.")
    if num_nodes > MAX_TREE_NODES:
        raise ValueError(f"{what}: {num_nodes} draft nodes exceed vLLM's speculative limit MAX_SPEC_LEN="
                         f"{MAX_TREE_NODES}; reduce the number of nodes (budget / choices) to at most "
                         f"{MAX_TREE_NODES}.")


@dataclass
class TokenTreeBatch:
    """Per-request token trees of a batch, padded to ``N = max nodes`` columns.

    Invariants (checked in ``__post_init__``):
      * ``tokens``, ``parents``: ``[B, N]`` int64; nodes ``i >= num_nodes[b]`` are padding (token -1, parent
        -1) and take part in nothing.
      * ``-1 <= parents[b, i] < i`` for every real node (parents come first).
      * ``draft_probs`` is ``[B, N + 1, V]`` in query order (row 0 after the root, row ``i + 1`` after node
        ``i``; leaves' rows unused) and is required iff ``draw_mode`` is ``IID_FROM_DRAFT``.

    Derived tensors (computed once): ``depth`` ``[B, N]`` (0 for padding), ``ancestors`` ``[B, N, D]``
    (root-to-node path of node indices, ``D = max depth``, -1 padded), and on the host ``max_depth``,
    ``node_counts`` (``num_nodes`` as ints) and ``max_children`` (the largest branching factor). Build a batch
    on the host and move it with :meth:`to`: then nothing waits for the device to learn its shape.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    draw_mode: ChildDrawMode
    draft_probs: torch.Tensor | None = None
    depth: torch.Tensor = field(init=False)
    ancestors: torch.Tensor = field(init=False)
    max_depth: int = field(init=False)
    node_counts: tuple[int, ...] = field(init=False)
    max_children: int = field(init=False)

    def __post_init__(self) -> None:
        self.draw_mode = ChildDrawMode(self.draw_mode)
        if self.tokens.ndim != 2 or self.parents.shape != self.tokens.shape:
            raise ValueError(f"tokens and parents must both be [batch, nodes]; got "
                             f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}.")
        batch, width = self.tokens.shape
        _check_budget(width, "TokenTreeBatch.tokens")
        self.tokens = self.tokens.long()
        self.parents = self.parents.long()
        self.num_nodes = torch.as_tensor(self.num_nodes, device=self.tokens.device).long().reshape(-1)
        if self.num_nodes.numel() != batch:
            raise ValueError(f"num_nodes must have one entry per request ({batch}); got {self.num_nodes.numel()}.")
        if bool(((self.num_nodes < 0) | (self.num_nodes > width)).any()):
            raise ValueError(f"num_nodes must lie in [0, {width}] (the padded width); got {self.num_nodes.tolist()}.")
        node_index = torch.arange(width, device=self.tokens.device)
        real = node_index[None, :] < self.num_nodes[:, None]
        bad = real & ((self.parents >= node_index[None, :]) | (self.parents < -1))
        if bool(bad.any()):
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"parents[{b}, {i}] = {int(self.parents[b, i])}: a node's parent must come "
                             f"before it (-1 <= parent < node index). Reorder the nodes topologically "
                             f"(parents first).")
        if bool((real & (self.tokens < 0)).any()):
            raise ValueError("tokens: real nodes need a token id >= 0 (-1 is reserved for padding).")
        self.tokens = torch.where(real, self.tokens, torch.full_like(self.tokens, -1))
        self.parents = torch.where(real, self.parents, torch.full_like(self.parents, -1))
        if self.draw_mode is ChildDrawMode.IID_FROM_DRAFT:
            if self.draft_probs is None:
                raise ValueError("draft_probs is required for draw_mode=iid_from_draft (SpecInfer "
                                 "verification needs q at every expanded node); pass [batch, nodes + 1, "
                                 "vocab] probabilities.")
            if self.draft_probs.ndim != 3 or tuple(self.draft_probs.shape[:2]) != (batch, width + 1):
                raise ValueError(f"draft_probs must be [batch, nodes + 1, vocab] = [{batch}, {width + 1}, "
                                 f"V]; got {tuple(self.draft_probs.shape)}.")
        self.depth, self.ancestors = _depth_and_paths(self.parents, real)
        self.max_depth = int(self.depth.max())
        self.node_counts = tuple(self.num_nodes.tolist())
        children = torch.zeros(batch, width + 1, dtype=torch.long, device=self.tokens.device)
        children.scatter_add_(1, self.parents + 1, real.long())
        self.max_children = int(children.max())

    def to(self, device: torch.device | str) -> TokenTreeBatch:
        """This batch on ``device``: its tensors copied without waiting for the device (a host batch's checks
        and derived values stay as they were computed)."""
        moved = object.__new__(TokenTreeBatch)
        for name, value in vars(self).items():
            moved.__dict__[name] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        return moved

    # ------------------------------------------------------------------ basic views
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """Padded number of node columns ``N``."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def valid(self) -> torch.Tensor:
        """``[B, N]`` bool: real (non-padding) nodes."""
        return torch.arange(self.width, device=self.device)[None, :] < self.num_nodes[:, None]

    def ancestor_mask(self) -> torch.Tensor:
        """``[B, N, N]`` bool: ``mask[b, i, j]`` iff node ``j`` is node ``i`` or one of its ancestors."""
        mask = torch.zeros(self.batch_size, self.width, self.width + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(2, self.ancestors + 1, True)  # -1 padding lands in column 0, dropped below
        return mask[:, :, 1:]

    def children_table(self) -> torch.Tensor:
        """``[B, N + 1, C]``: children of every query row (row 0 = root, row ``i + 1`` = node ``i``)
        as node indices in node order, -1 padded; ``C`` = the largest branching factor."""
        onehot = torch.zeros(self.batch_size, self.width, self.width + 1, dtype=torch.long, device=self.device)
        onehot.scatter_(2, (self.parents + 1)[:, :, None], self.valid[:, :, None].long())
        rank = (onehot.cumsum(1) * onehot).sum(2) - 1  # rank among siblings, -1 for padding
        table = torch.full((self.batch_size, self.width + 1, max(self.max_children, 1)), -1,
                           dtype=torch.long, device=self.device)
        b_idx, i_idx = self.valid.nonzero(as_tuple=True)
        table[b_idx, self.parents[b_idx, i_idx] + 1, rank[b_idx, i_idx]] = i_idx
        return table


def _depth_and_paths(parents: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth (1-based, 0 for padding) and root-to-node ancestor paths ``[B, N, D]`` by pointer chasing."""
    batch, width = parents.shape
    node = torch.arange(width, device=parents.device).expand(batch, width)
    chain = [torch.where(valid, node, torch.full_like(node, -1))]  # self, parent, grandparent, ...
    cur = chain[0]
    for _ in range(width):
        nxt = torch.gather(parents, 1, cur.clamp(min=0))
        nxt = torch.where(cur >= 0, nxt, torch.full_like(nxt, -1))
        if not bool((nxt >= 0).any()):
            break
        chain.append(nxt)
        cur = nxt
    up = torch.stack(chain, dim=2)  # [B, N, D] self first
    depth = (up >= 0).sum(2)
    max_depth = up.shape[2]
    k = torch.arange(max_depth, device=parents.device)
    src = (depth[:, :, None] - 1 - k[None, None, :]).clamp(min=0)
    down = torch.gather(up, 2, src)
    down = torch.where(k[None, None, :] < depth[:, :, None], down, torch.full_like(down, -1))
    return depth, down


# ====================================================================== static trees (choice lists)
@dataclass(frozen=True)
class StaticTreeTemplate:
    """Topology of a Medusa / vLLM style choice list such as ``[(0,), (1,), (0, 0), (0, 1)]``.

    Choice ``(r1, ..., rd)`` is the node reached by taking child rank ``r1`` of the root, then rank ``r2`` of
    that node, ... Node order = the order of the list (must be topological). ``ranks[i]`` is the last element
    of choice ``i``: the draft-rank of the token (``WITHOUT_REPLACEMENT``) or the index of the i.i.d. draw.
    """

    choices: tuple[Choice, ...]
    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depth: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> StaticTreeTemplate:
        choices = [tuple(int(r) for r in c) for c in choices]
        _check_budget(len(choices), "choices")
        index: dict[Choice, int] = {}
        parents, ranks = [], []
        for i, choice in enumerate(choices):
            if len(choice) == 0:
                raise ValueError(f"choices[{i}] is empty; the root is implicit, list only draft nodes.")
            if min(choice) < 0:
                raise ValueError(f"choices[{i}] = {choice} has a negative rank; ranks are >= 0.")
            if choice in index:
                raise ValueError(f"choices[{i}] = {choice} is listed twice; each node must appear once.")
            parent = choice[:-1]
            if parent and parent not in index:
                raise ValueError(f"choices[{i}] = {choice}: its parent {parent} does not come before it. "
                                 f"List parents before children (e.g. sorted(choices, key=lambda c: "
                                 f"(len(c), c))).")
            parents.append(index[parent] if parent else -1)
            ranks.append(choice[-1])
            index[choice] = i
        return cls(tuple(choices), tuple(parents), tuple(ranks), tuple(len(c) for c in choices))

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def expansion_levels(self) -> list[list[int]]:
        """For each level ``d = 0 .. max_depth - 1``: the nodes at depth ``d`` that have children
        (``-1`` stands for the root at level 0). The proposer runs its draft model on these."""
        levels: list[list[int]] = [[] for _ in range(self.max_depth)]
        seen: set[int] = set()
        for i, p in enumerate(self.parents):
            if p not in seen:
                seen.add(p)
                levels[self.depth[i] - 1].append(p)
        for level in levels:
            level.sort()
        return levels


# ====================================================================== EAGLE-2 dynamic trees
def _check_finite_or_neg_inf(top_logprobs: torch.Tensor, name: str) -> None:
    """Checks the ``topk`` of the log-probabilities only: ``topk`` ranks NaN and +inf above every number, so
    a row that holds one shows it in its top entry (no second pass over the vocabulary). On the host only: on a
    device the check would make the host wait every level, and bad draft values can lower acceptance but never
    change what verification emits."""
    if top_logprobs.device.type != "cpu":
        return
    if bool(torch.isnan(top_logprobs).any()) or bool((top_logprobs == float("inf")).any()):
        raise ValueError(f"{name} contains NaN or +inf; pass log-probabilities (log_softmax output).")


class DynamicTopKTreeBuilder:
    """EAGLE-2 dynamic draft tree (Li et al. 2024), batched, deterministic (``WITHOUT_REPLACEMENT``).

    * Depth 1: the ``top_k`` most likely root children; score = log q.
    * Each further depth: every node of the *frontier* (the ``top_k`` best-scoring nodes of the previous
      depth) gets its ``top_k`` most likely children as candidates, score = parent score + log q(child). The
      ``top_k`` best candidates of the new depth become the next frontier.
    * :meth:`build` reranks **all** candidates of all depths by score and keeps ``budget`` of them. Scores
      never increase along a path, and ties are broken towards shallower / earlier nodes, so the kept set is
      closed under taking parents (it is a tree).

    Protocol: call :meth:`expand` with the log-probs ``[B, top_k, V]`` of ``frontier_tokens`` ``max_depth - 1``
    times, then :meth:`build`; after it, ``kept_candidates`` ``[B, budget]`` maps every tree node to its candidate.
    """

    def __init__(self, root_logprobs: torch.Tensor, *, top_k: int, max_depth: int, budget: int) -> None:
        if root_logprobs.ndim != 2:
            raise ValueError(f"root_logprobs must be [batch, vocab]; got {tuple(root_logprobs.shape)}.")
        if top_k < 1 or top_k > root_logprobs.shape[1]:
            raise ValueError(f"top_k must be in [1, vocab={root_logprobs.shape[1]}]; got {top_k}.")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1; got {max_depth}.")
        _check_budget(budget, "budget")
        total = top_k + (max_depth - 1) * top_k * top_k
        if budget > total:
            raise ValueError(f"budget={budget} exceeds the {total} candidates that top_k={top_k}, "
                             f"max_depth={max_depth} produce; lower the budget or raise top_k / max_depth.")
        self.top_k, self.max_depth, self.budget = top_k, max_depth, budget
        self.device = root_logprobs.device
        batch = root_logprobs.shape[0]
        scores, tokens = torch.topk(root_logprobs.float(), top_k, dim=-1)
        _check_finite_or_neg_inf(scores, "root_logprobs")
        self._tokens = [tokens]
        self._scores = [scores]
        self._parents = [torch.full_like(tokens, -1)]
        self._num_candidates = top_k
        self.frontier = torch.arange(top_k, device=self.device).expand(batch, top_k).clone()
        self._depth_done = 1

    @property
    def done(self) -> bool:
        return self._depth_done >= self.max_depth

    @property
    def candidate_tokens(self) -> torch.Tensor:
        return torch.cat(self._tokens, dim=1)

    @property
    def candidate_scores(self) -> torch.Tensor:
        return torch.cat(self._scores, dim=1)

    @property
    def candidate_parents(self) -> torch.Tensor:
        return torch.cat(self._parents, dim=1)

    @property
    def frontier_tokens(self) -> torch.Tensor:
        return torch.gather(self.candidate_tokens, 1, self.frontier)

    def expand(self, frontier_logprobs: torch.Tensor) -> None:
        batch, k = self.frontier.shape
        if tuple(frontier_logprobs.shape[:2]) != (batch, k) or frontier_logprobs.ndim != 3:
            raise ValueError(f"frontier_logprobs must be [batch, top_k, vocab] = [{batch}, {k}, V]; "
                             f"got {tuple(frontier_logprobs.shape)}.")
        if self.done:
            raise RuntimeError(f"max_depth={self.max_depth} reached; call build().")
        parent_scores = torch.gather(self.candidate_scores, 1, self.frontier)
        child_lp, child_tok = torch.topk(frontier_logprobs.float(), self.top_k, dim=-1)  # [B, k, k]
        _check_finite_or_neg_inf(child_lp, "frontier_logprobs")
        cum = (parent_scores[:, :, None] + child_lp).reshape(batch, k * self.top_k)
        parents = self.frontier[:, :, None].expand(-1, -1, self.top_k).reshape(batch, k * self.top_k)
        self._tokens.append(child_tok.reshape(batch, k * self.top_k))
        self._scores.append(cum)
        self._parents.append(parents)
        # keep the top_k of this depth (stable: earlier candidates win ties)
        order = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, : self.top_k]
        self.frontier = order + self._num_candidates
        self._num_candidates += k * self.top_k
        self._depth_done += 1

    def build(self) -> TokenTreeBatch:
        """Rerank all candidates to ``budget`` nodes (topological order = candidate order), checked."""
        tokens, parents = self.select()
        if bool(((torch.gather(self.candidate_parents, 1, self.kept_candidates) >= 0) & (parents < 0)).any()):
            raise RuntimeError("internal error: a kept EAGLE-2 node lost its parent (NaN log-probs?).")
        return TokenTreeBatch(tokens=tokens, parents=parents,
                              num_nodes=torch.full((tokens.shape[0],), self.budget, device=self.device),
                              draw_mode=ChildDrawMode.WITHOUT_REPLACEMENT)

    def select(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``budget`` best-scoring candidates, in candidate (topological) order: ``[B, budget]`` tokens and
        parents (tree node indices, -1 for the root's children); :attr:`kept_candidates` maps the nodes back to
        the candidates. Nothing here reads the device."""
        if not self.done:
            raise RuntimeError(f"{self.max_depth - self._depth_done} expansion(s) still missing.")
        scores, tokens, parents = self.candidate_scores, self.candidate_tokens, self.candidate_parents
        batch = scores.shape[0]
        keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : self.budget]
        keep = torch.sort(keep, dim=1).values  # candidate order is topological
        new_index = torch.full_like(scores, -1, dtype=torch.long)
        new_index.scatter_(1, keep, torch.arange(self.budget, device=self.device).expand(batch, -1))
        kept_parents = torch.gather(parents, 1, keep)
        remapped = torch.where(kept_parents >= 0, torch.gather(new_index, 1, kept_parents.clamp(min=0)),
                               kept_parents)
        self.kept_candidates = keep  # maps tree nodes back to the draft forwards
        return torch.gather(tokens, 1, keep), remapped
