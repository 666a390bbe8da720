"""One target forward that verifies the token trees of a batch: the pure bookkeeping around it.

Request ``b``'s ``1 + n`` query rows are its root (position ``P``) then its nodes in topological order; row ``j``
writes its K/V to the linear slot ``P + j`` and sits at RoPE position ``P + depth``
(:meth:`TreeVerifyStep.row_positions`); :attr:`TreeVerifyStep.attention_mask` is the ancestor-or-self mask over
the rows (every row also sees the prefix); :meth:`TreeVerifyStep.accepted_moves` says which row's K/V goes where
so that the accepted branch sits at ``P + 1 .. P + a``.

Invariant: a truncated tree (the first ``n`` nodes of a longer one) is still a tree: parents come first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .building import ChildDrawMode, TokenTreeBatch


@dataclass
class TreeRequest:
    """One request's tree as scheduled in this step."""

    batch_row: int  # row of the request in the runner's batch
    query_start: int  # flattened row of its root in the forward
    prefix_len: int  # P: position of the root = tokens whose K/V is cached before the step
    tokens: list[int]  # the scheduled node tokens (target vocabulary), parents first
    parents: list[int]  # parent node index per node, -1 for children of the root
    draw_mode: ChildDrawMode = ChildDrawMode.WITHOUT_REPLACEMENT
    draft_probs: torch.Tensor | None = None  # [n + 1, V] (q after the root and after every node), IID only
    # min_tokens: rows at depth < this may not produce these tokens (the target's stop tokens are masked
    # there, as vLLM's MinTokensLogitsProcessor does for the first min_tokens outputs)
    stop_tokens_banned_below_depth: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # structured output: a row whose every token is banned keeps its stop tokens (vLLM's MinTokensLogitsProcessor
    # restores them there, so that the grammar's end can still be sampled)
    stop_tokens_restored_when_all_banned: bool = False
    req_id: str = ""  # the engine's request id (bookkeeping only)
    from_lookup: tuple[bool, ...] = ()  # per node: merged from a source (prompt lookup); empty: all drafted
    padding: int = 0  # the last ``padding`` nodes pad the tree to a uniform size: verified rows, never accepted

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for index, parent in enumerate(self.parents):
            if not -1 <= parent < index:
                raise ValueError(f"node {index} has parent {parent}; parents must come first")
        if self.draw_mode is ChildDrawMode.IID_FROM_DRAFT:
            if self.draft_probs is None or self.draft_probs.shape[0] != self.real_nodes + 1:
                raise ValueError("an i.i.d.-drawn tree needs draft_probs with one row per real node plus the root")

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def real_nodes(self) -> int:
        return len(self.tokens) - self.padding

    @property
    def is_path(self) -> bool:
        """The nodes are one path from the root (node ``j``'s parent is node ``j - 1``): row ``j`` sits at its
        linear position ``P + j``, so causal attention over the cache is its tree attention and any accepted
        branch is already in place."""
        return self.parents == list(range(-1, self.num_nodes - 1))

    def row_paths(self) -> list[list[int]]:
        """What stands between the root and each query row's prediction: ``[]`` for the root's row, then for each
        node the tokens of its path from the root (its ancestors', then its own). A row's logits predict what
        follows the request's tokens plus its path."""
        paths: list[list[int]] = [[]]
        for token, parent in zip(self.tokens, self.parents, strict=True):
            paths.append([*paths[parent + 1], token])
        return paths


@dataclass
class TreeVerifyStep:
    """The tree requests of one verify forward (requests without drafts are not in it)."""

    requests: list[TreeRequest]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a verify step needs at least one tree request")
        self.width = 1 + max(r.num_nodes for r in self.requests)
        self.trees = _tree_batch(self.requests, ChildDrawMode.WITHOUT_REPLACEMENT, self.device)
        self.prefix_lens = torch.tensor([r.prefix_len for r in self.requests], dtype=torch.int64)
        self.batch_rows = torch.tensor([r.batch_row for r in self.requests], dtype=torch.int64)
        self.query_starts = torch.tensor([r.query_start for r in self.requests], dtype=torch.int64)
        self.from_lookup = torch.zeros(len(self.requests), self.width - 1, dtype=torch.bool)  # [R, W - 1] by node
        for index, request in enumerate(self.requests):
            self.from_lookup[index, : len(request.from_lookup)] = torch.tensor(request.from_lookup, dtype=torch.bool)
        self.num_queries = self.trees.num_nodes + 1
        columns = torch.arange(self.width)
        self.valid_rows = columns[None, :] < self.num_queries[:, None]  # [R, W]
        mask = torch.zeros(len(self.requests), self.width, self.width, dtype=torch.bool)
        mask[:, :, 0] = True
        mask[:, 1:, 1:] = self.trees.ancestor_mask()
        self.attention_mask = mask & self.valid_rows[:, None, :]  # [R, W, W]; padding rows see the root only

    def __len__(self) -> int:
        return len(self.requests)

    def masked_part(self) -> tuple[TreeVerifyStep, torch.Tensor] | None:
        """The requests that need masked tree attention (those whose nodes are not a path,
        :attr:`TreeRequest.is_path`) as their own step, and each request's index in it (-1 for paths); None
        when every request is a path."""
        masked = [request for request in self.requests if not request.is_path]
        if not masked:
            return None
        is_masked = torch.tensor([not request.is_path for request in self.requests])
        index = torch.where(is_masked, is_masked.long().cumsum(0) - 1, -1)
        return (self if len(masked) == len(self.requests) else TreeVerifyStep(masked, self.device)), index

    def attention_rows(self) -> torch.Tensor:
        """``[R, W]`` flattened forward row of every query of every tree request (padding repeats the root)."""
        rows = self.query_starts[:, None] + torch.arange(self.width)[None, :]
        return torch.where(self.valid_rows, rows, self.query_starts[:, None])

    def column_positions(self) -> torch.Tensor:
        """``[R, W]`` logical position ``P + depth`` of every query column (padding columns: the root's, ``P``)."""
        depth = torch.cat([torch.zeros_like(self.trees.depth[:, :1]), self.trees.depth], dim=1)
        return self.prefix_lens[:, None] + torch.where(self.valid_rows, depth, 0)

    def row_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flattened rows, positions ``P + depth``) of every root and node."""
        return self.attention_rows()[self.valid_rows], self.column_positions()[self.valid_rows]

    def row_shifts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flattened rows, ``depth - column``) of every root and node: how far each row's position moves from its
        linear ``P + column`` to ``P + depth``."""
        columns = torch.arange(self.width)[None, :].expand(len(self.requests), -1)
        return self.attention_rows()[self.valid_rows], (self.column_positions() - self.prefix_lens[:, None]
                                                        - columns)[self.valid_rows]

    def banned_stop_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(step-local query ``[request, column]`` pairs, token) where a stop token must be masked: the
        rows of depth ``< stop_tokens_banned_below_depth`` (root depth 0) of requests under min_tokens."""
        requests, columns, tokens = [], [], []
        depth = torch.cat([torch.zeros_like(self.trees.depth[:, :1]), self.trees.depth], dim=1)
        for index, request in enumerate(self.requests):
            if request.stop_tokens_banned_below_depth <= 0 or not request.stop_token_ids:
                continue
            rows = (depth[index, : request.num_nodes + 1] < request.stop_tokens_banned_below_depth).nonzero()
            for column in rows.flatten().tolist():
                for token in request.stop_token_ids:
                    requests.append(index)
                    columns.append(column)
                    tokens.append(token)
        pairs = torch.tensor([requests, columns], dtype=torch.int64).reshape(2, -1)
        return pairs, torch.tensor(tokens, dtype=torch.int64)

    def trees_with_mode(self, mode: ChildDrawMode, device: torch.device | None = None
                        ) -> tuple[list[int], TokenTreeBatch] | None:
        """The requests drawn in ``mode`` (their indices in this step) as one batch on ``device`` (default: the
        step's), or None. Their real nodes only: the sampler never sees a padding node, so never accepts one."""
        picked = [i for i, r in enumerate(self.requests) if r.draw_mode is mode]
        if not picked:
            return None
        return picked, _tree_batch([self.requests[i] for i in picked], mode, device or self.device, real=True)

    def accepted_moves(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> AcceptedBranch:
        """Where the accepted branch's K/V must go: ``accepted_nodes`` ``[R, D]`` (node indices, root side
        first, -1 padded) and ``num_accepted`` ``[R]`` from the sampler."""
        depth = accepted_nodes.shape[1]
        keep = torch.arange(depth)[None, :] < num_accepted[:, None]
        request_index = torch.arange(len(self.requests))[:, None].expand(-1, depth)[keep]
        source_column = (accepted_nodes + 1)[keep]  # query column of the accepted node
        destination = (self.prefix_lens[:, None] + torch.arange(1, depth + 1)[None, :])[keep]
        tokens = self.trees.tokens.gather(1, accepted_nodes.clamp(min=0))[keep]
        return AcceptedBranch(request_index, source_column, destination, tokens)

    def branch_rows(self, branch: AcceptedBranch) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, destination) flattened forward rows of the accepted nodes: the row where each node was
        verified, and the row of its linear position ``P + depth``, where the next first pass reads it."""
        starts = self.query_starts[branch.request_index]
        return starts + branch.source_column, starts + branch.destination - self.prefix_lens[branch.request_index]

    def left_the_top_path(self, branch: AcceptedBranch) -> set[int]:
        """The requests whose accepted branch holds a node that is not its parent's first child. Siblings come
        best first in dynamic trees and in static trees listed in rank order (as ``sorted(choices)`` lists
        them), so there the top-1 path is first children all the way down."""
        left = set()
        for index, column in zip(branch.request_index.tolist(), branch.source_column.tolist(), strict=True):
            parents = self.requests[index].parents
            node = column - 1
            if parents.index(parents[node]) != node:
                left.add(index)
        return left


@dataclass
class AcceptedBranch:
    """The accepted nodes of a step, one entry per accepted node, request-major, root side first."""

    request_index: torch.Tensor  # which tree request of the step
    source_column: torch.Tensor  # its query column (1 + node index) in the verify forward
    destination: torch.Tensor  # the position it must occupy: P + depth
    tokens: torch.Tensor  # its token

    def __len__(self) -> int:
        return int(self.request_index.numel())

    def out_of_place(self, prefix_lens: torch.Tensor) -> AcceptedBranch:
        """The nodes whose query row is not already their destination (``source_column != destination - P``,
        ``prefix_lens`` per request of the step): only their K/V must move; the others' linear slots hold it."""
        keep = self.source_column != self.destination - prefix_lens[self.request_index]
        return AcceptedBranch(*(x[keep] for x in (self.request_index, self.source_column, self.destination,
                                                  self.tokens)))

    def to(self, device: torch.device) -> AcceptedBranch:
        """The branch on ``device``, copied without waiting for the device."""
        return AcceptedBranch(*(x.to(device, non_blocking=True)
                                for x in (self.request_index, self.source_column, self.destination, self.tokens)))


def _tree_batch(requests: list[TreeRequest], mode: ChildDrawMode, device: torch.device,
                real: bool = False) -> TokenTreeBatch:
    """The requests' trees, padding nodes included unless ``real`` (they come last, so a tree either way)."""
    counts = [r.real_nodes if real else r.num_nodes for r in requests]
    tokens = torch.full((len(requests), max(*counts, 1)), -1, dtype=torch.int64)
    parents = torch.full_like(tokens, -1)
    for row, (request, count) in enumerate(zip(requests, counts, strict=True)):
        tokens[row, :count] = torch.tensor(request.tokens[:count], dtype=torch.int64)
        parents[row, :count] = torch.tensor(request.parents[:count], dtype=torch.int64)
    draft_probs = None
    if mode is ChildDrawMode.IID_FROM_DRAFT:
        draft_probs = torch.zeros(len(requests), tokens.shape[1] + 1, requests[0].draft_probs.shape[1])
        for row, request in enumerate(requests):
            draft_probs[row, : request.real_nodes + 1] = request.draft_probs
    trees = TokenTreeBatch(tokens=tokens, parents=parents, num_nodes=torch.tensor(counts),
                           draw_mode=mode, draft_probs=draft_probs)  # checked on the host
    return trees.to(device)
