"""The tree step's hub: what passes between the drafter, the verify step and the runner (docs/design.md, "One step
through the seams"): :class:`PendingTree` from the drafter, :class:`TreeVerifyForward` while the target runs, the
accepted branch back for the next drafting step.

Invariant: a request with a pending tree gets exactly that tree's nodes as its speculative tokens
(:meth:`TreeVerifier.trim_drafts`); a request the tree cannot serve exactly gets none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from vllm_easyspec.control.acceptance import NodeFeatures
from vllm_easyspec.integration.compat import plugin_logger
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.sampling import SAMPLING_EPS
from vllm_easyspec.tree.verify_step import AcceptedBranch, TreeVerifyStep

if TYPE_CHECKING:
    from vllm_easyspec.integration.node_policy import NodePolicy

logger = plugin_logger(__name__)
# vLLM's DraftTokenIds carries this attribute to the scheduler: {request id: node parents} of the structured-output
# requests' drafts, whose grammar masks follow each node's path (:mod:`~vllm_easyspec.integration.tree_grammar`)
DRAFT_PARENTS = "easyspec_draft_parents"


def tree_fallback_reason(params, processed_logprobs: bool = False) -> str | None:
    """Why a request with these ``SamplingParams`` cannot be verified as a tree exactly, or None (docs/design.md,
    "Requests a tree cannot serve exactly")."""
    checks = ((params.logprobs is not None and processed_logprobs, "logprobs in a processed logprobs_mode"),
              (bool(params.watermarking), "watermarking"),
              (params.thinking_token_budget is not None, "thinking_token_budget"))
    reasons = [name for present, name in checks if present]
    return ", ".join(reasons) if reasons else None


def chain_sampler_serves(params) -> bool:
    """Whether vLLM's own rejection sampler verifies this request's chain exactly: it applies neither ``logit_bias``
    nor ``min_p`` and ignores ``logprob_token_ids`` (docs/design.md, "Requests a tree cannot serve exactly")."""
    return params is None or not (params.logit_bias or params.logprob_token_ids
                                  or (params.min_p > 0.0 and params.temperature > SAMPLING_EPS))


@dataclass
class PendingTree:
    """A request's drafts for its next verify step (target vocabulary). Invariant: at most ``node_limit`` real
    nodes, parents first; ``is_chain`` exactly when the nodes are a path of deterministic drafts and no padding (vLLM
    verifies it as a chain). Built by :meth:`within`, :meth:`chain` and :meth:`padded`, which keep it."""

    tokens: list[int]
    parents: list[int]
    draw_mode: ChildDrawMode
    node_limit: int  # the most nodes the step's budget (or the controller) allowed
    is_chain: bool
    draft_probs: torch.Tensor | None = None  # [n + 1, V], i.i.d.-drawn trees only
    from_lookup: tuple[bool, ...] = ()  # per node: merged from a source (prompt lookup); empty: all drafted
    features: list[NodeFeatures] | None = None  # per node, with easyspec.tree.auto: what the controller knew
    padding: int = 0  # tree.uniform: the last ``padding`` nodes are padding, never accepted (:meth:`padded`)

    @classmethod
    def within(cls, node_limit: int, tokens: list[int], parents: list[int], draw_mode: ChildDrawMode,
               draft_probs: torch.Tensor | None = None, from_lookup: tuple[bool, ...] = (),
               features: list[NodeFeatures] | None = None) -> PendingTree:
        """The first ``node_limit`` nodes of a tree (still a tree: parents come first)."""
        tokens, parents = tokens[:node_limit], parents[:node_limit]
        is_chain = (draw_mode is ChildDrawMode.WITHOUT_REPLACEMENT and draft_probs is None
                    and parents == list(range(-1, len(parents) - 1)))
        return cls(tokens, parents, draw_mode, node_limit, is_chain, draft_probs, tuple(from_lookup[:node_limit]),
                   None if features is None else features[:node_limit])

    @classmethod
    def chain(cls, tokens: list[int]) -> PendingTree:
        """A chain of deterministic drafts, as a proposer drafts without a tree."""
        return cls.within(len(tokens), tokens, list(range(-1, len(tokens) - 1)), ChildDrawMode.WITHOUT_REPLACEMENT)

    @property
    def real_nodes(self) -> int:
        return len(self.tokens) - self.padding

    def keeping(self, kept: list[int]) -> PendingTree:
        """The tree of nodes ``kept`` (:func:`keeping_nodes`), draft probabilities the root's and the kept nodes'."""
        probs = None if self.draft_probs is None else self.draft_probs[
            torch.tensor([0, *(node + 1 for node in kept)]).to(self.draft_probs.device, non_blocking=True)]
        return keeping_nodes(self, kept, draft_probs=probs,
                             features=None if self.features is None else [self.features[n] for n in kept])

    def padded(self, nodes: int) -> PendingTree:
        """This tree with padding nodes up to ``nodes``: a chain below its last node (a path stays a path, served
        by vLLM's kernel), each a copy of that node's token. Never a chain: vLLM's sampler would accept them."""
        count = nodes - len(self.tokens)
        if count <= 0:
            return self
        last = len(self.tokens) - 1
        return replace(self, tokens=self.tokens + [self.tokens[-1] if self.tokens else 0] * count,
                       parents=self.parents + list(range(last, last + count)), is_chain=False, padding=count)


def keeping_nodes(tree, kept: list[int], **changes):
    """``tree`` (a dataclass with ``tokens``, ``parents`` and ``from_lookup``) cut to the nodes ``kept`` (each
    with its parent, in order), parents renumbered; ``changes``: other fields replaced as well."""
    new = {old: index for index, old in enumerate(kept)}
    return replace(tree, tokens=[tree.tokens[n] for n in kept], parents=[new.get(tree.parents[n], -1) for n in kept],
                   from_lookup=tuple(tree.from_lookup[n] for n in kept) if tree.from_lookup else (), **changes)


@dataclass
class TreeStats:
    """Per-worker counters of tree verification (read through the worker extension)."""

    steps: int = 0
    tree_requests: int = 0
    nodes_verified: int = 0
    accepted: int = 0
    chain_fallbacks: int = 0  # scheduled drafts that matched no proposed tree, verified as a chain
    truncated_trees: int = 0  # trees the scheduler cut short (token budget, model length)
    requests_without_speculation: int = 0
    source_nodes: int = 0  # nodes merged in from sources (prompt lookup), scheduled or not
    source_nodes_accepted: int = 0
    off_top_path_branches: int = 0  # accepted branches with a node that is not its parent's first child
    padding_nodes: int = 0  # tree.uniform: nodes verified only to make the step uniform (not in nodes_verified)
    last_node_limit: int = 0  # nodes per tree that budget_by_batch allowed at the last drafting step
    last_limit_is_chain: bool = False  # ... and whether that was a chain ({"chain": k})
    chain_steps: int = 0  # verify steps whose drafts were all top-1 chains, verified by vLLM's own path
    chain_requests: int = 0  # requests verified in those steps (nodes_verified and accepted count theirs)
    path_requests: int = 0  # requests of tree steps whose nodes are one path: vLLM's kernel, branch in place
    steps_without_speculation: int = 0  # drafting steps at a batch size budget_by_batch gives no nodes
    steps_without_drafts: int = 0  # verify steps in which no request had drafts: vLLM's plain sampler
    accepted_outside_shared_vocab: int = 0  # tree.retokenize: accepted tokens the draft's vocabulary lacks


@dataclass
class VerifyKV:
    """One target layer's K/V of the tree rows, kept by its attention backend for the runner's commit."""

    key: torch.Tensor  # [R, Hkv, W, D]
    value: torch.Tensor
    block_size: int
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (keys, values [A, Hkv, D], slots [A])
    block_table: torch.Tensor  # [R, max_blocks]: the rows' requests in the layer's KV cache group
    # R: the step's requests by batch row (a uniform build, every row through the tree kernel), else by their index
    # among the masked trees; one forward may hold both (Llama 4's chunked layers are never built uniform)
    by_batch_row: bool = False


@dataclass
class TreeVerifyForward:
    """The verify forward in progress. Invariant: :attr:`masked` holds the step's requests whose nodes are not a
    path; they alone get tree attention and kept K/V (a path's rows sit at their linear positions: vLLM's kernel)."""

    step: TreeVerifyStep
    kept_kv: dict[str, VerifyKV] = field(default_factory=dict)  # by layer name (VerifyKV.by_batch_row: whose rows)
    # M-RoPE targets: (forward rows, depth - column) by which each row's streams moved from vLLM's linear positions
    mrope_shift: tuple[torch.Tensor, torch.Tensor] | None = None
    masked: TreeVerifyStep | None = field(init=False)  # None: every tree is a path
    masked_index: torch.Tensor | None = field(init=False)  # [R] each request's index in ``masked``, -1: a path

    def __post_init__(self) -> None:
        part = self.step.masked_part()
        self.masked, self.masked_index = part if part is not None else (None, None)


@dataclass
class TreeVerifier:
    """Carries trees from the drafter to the verify step of the same requests, and branches back."""

    requests: Mapping[str, Any]  # the runner's request states (vLLM's CachedRequestState), by request id
    policy: NodePolicy  # the step's budget: learns what verification accepted, forgets finished requests
    unshared_target_tokens: torch.Tensor | None = None  # tree.retokenize: bool [target vocab] the draft lacks
    processed_logprobs: bool = False  # the engine's logprobs_mode is a processed one
    uniform_nodes: int = 0  # tree.uniform: every request of a tree step verifies this many nodes (0: off)
    # pipeline parallelism: every tree's parents go to the scheduler (not only grammars'), and each step's accepted
    # nodes out of place, {request id: [(source column, depth)]}, to the earlier stages (integration/pipeline_trees.py)
    serves_earlier_stages: bool = False
    stage_moves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    pending: dict[str, PendingTree] = field(default_factory=dict)
    no_drafts: set[str] = field(default_factory=set)
    drafted_this_step: bool = False
    forward: TreeVerifyForward | None = None  # the tree verify forward of the step in progress
    chain_step: dict[int, str] = field(default_factory=dict)  # batch row -> request id, in a chain step
    last_branch: dict[str, list[int]] = field(default_factory=dict)  # tokens each request accepted this step
    # (source rows, destination rows) of this step's accepted nodes in the verify forward, or None
    branch_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    stats: TreeStats = field(default_factory=TreeStats)
    # each request's scheduled nodes as the policy saw them (features, parents), this step (tree.auto)
    scheduled: dict[str, tuple[list[NodeFeatures], list[int]]] = field(default_factory=dict)
    _explained: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------------------------------ drafting
    def fallback_reason(self, req_id: str) -> str | None:
        """Why this request is served without speculation (logged once per request), or None."""
        params = getattr(self.requests.get(req_id), "sampling_params", None)
        reason = None if params is None else tree_fallback_reason(params, self.processed_logprobs)
        if reason is not None and req_id not in self._explained:
            self._explained.add(req_id)
            self.stats.requests_without_speculation += 1
            logger.info("easyspec.tree: request %s is served without speculation (%s)", req_id, reason)
        return reason

    def propose(self, trees: dict[str, PendingTree], no_drafts: set[str], node_limit: int, chain: bool) -> None:
        """The drafter's output of one step at budget ``node_limit`` (a chain of that length if ``chain``):
        trees for ``trees``' requests, no drafts for ``no_drafts``."""
        live = set(self.requests)
        if self.uniform_nodes and not chain and any(tree.tokens for tree in trees.values()):
            empty = PendingTree([], [], ChildDrawMode.WITHOUT_REPLACEMENT, 0, False)
            trees = trees | {req_id: empty for req_id in no_drafts if self.fallback_reason(req_id) is None}
            trees = {req_id: tree.padded(self.uniform_nodes) for req_id, tree in trees.items()}
            no_drafts = no_drafts - set(trees)
        self.pending = {req_id: tree for req_id, tree in self.pending.items() if req_id in live} | trees
        self._explained &= live
        self.policy.forget(live)
        self.no_drafts = no_drafts
        self.drafted_this_step = True
        self.stats.last_node_limit = node_limit
        self.stats.last_limit_is_chain = chain
        self.stats.steps_without_speculation += node_limit == 0

    def drop_drafts(self) -> None:
        """The drafting stage failed: no tree of it is pending, and no request gets drafts this step."""
        self.pending = {}
        self.no_drafts = set()
        self.drafted_this_step = False

    def trim_drafts(self, drafts) -> None:
        """``take_draft_token_ids``: requests without speculation (or a step without drafting) get none, a tree
        its own nodes, padding included; structured-output requests' node parents go with their drafts to the
        scheduler (:data:`DRAFT_PARENTS`), every tree's under pipeline parallelism (a chain's go nowhere: every stage
        verifies a request without parents as a chain)."""
        parents: dict[str, list[int]] = {}
        for index, req_id in enumerate(drafts.req_ids):
            if not self.drafted_this_step or req_id in self.no_drafts:
                drafts.draft_token_ids[index] = []
            elif req_id in self.pending:
                pending = self.pending[req_id]
                real = pending.real_nodes
                drafts.draft_token_ids[index] = list(drafts.draft_token_ids[index][:real]) + pending.tokens[real:]
                params = getattr(self.requests.get(req_id), "sampling_params", None)
                if (params is not None and params.structured_outputs is not None
                        or self.serves_earlier_stages and not pending.is_chain):
                    parents[req_id] = pending.parents
        if parents:
            setattr(drafts, DRAFT_PARENTS, parents)
        self.drafted_this_step = False

    # ------------------------------------------------------------------------------------------ verifying
    def start_step(self) -> None:
        """A new verify step: nothing of the last one is in progress."""
        self.forward = None
        self.chain_step = {}
        self.last_branch = {}
        self.branch_rows = None
        self.scheduled = {}
        self.stage_moves = {}

    def record_chain_step(self, output_token_ids: torch.Tensor) -> None:
        """After vLLM's sampler verified a chain step: each request's accepted drafts (its output row up to the
        bonus token), for the next step's prompt lookup."""
        rows = output_token_ids.tolist()
        for batch_row, req_id in self.chain_step.items():
            tokens = [token for token in rows[batch_row] if token >= 0][:-1]
            self.last_branch[req_id] = tokens
            self.stats.accepted += len(tokens)
            self._observe(req_id, set(range(len(tokens))))
        self.chain_step = {}

    def record_branch(self, step: TreeVerifyStep, branch: AcceptedBranch) -> None:
        """The accepted branch of a tree step, committed by the runner: counters, each request's accepted
        tokens, and the forward rows its nodes moved from and to."""
        self.stats.accepted += len(branch)
        if self.scheduled:
            accepted: dict[str, set[int]] = {request.req_id: set() for request in step.requests}
            for index, column in zip(branch.request_index.tolist(), branch.source_column.tolist(), strict=True):
                accepted[step.requests[index].req_id].add(column - 1)
            for req_id, nodes in accepted.items():
                self._observe(req_id, nodes)
        if not len(branch):
            return
        if self.unshared_target_tokens is not None:
            unshared = self.unshared_target_tokens[branch.tokens]  # both on the host
            self.stats.accepted_outside_shared_vocab += int(unshared.sum())
        from_sources = step.from_lookup[branch.request_index, branch.source_column - 1]
        self.stats.source_nodes_accepted += int(from_sources.sum())
        self.stats.off_top_path_branches += len(step.left_the_top_path(branch))
        for index, token in zip(branch.request_index.tolist(), branch.tokens.tolist(), strict=True):
            self.last_branch.setdefault(step.requests[index].req_id, []).append(token)
        self.branch_rows = step.branch_rows(branch)
        if self.serves_earlier_stages:
            moves = branch.out_of_place(step.prefix_lens)
            depths = moves.destination - step.prefix_lens[moves.request_index]
            for index, column, depth in zip(moves.request_index.tolist(), moves.source_column.tolist(),
                                            depths.tolist(), strict=True):
                self.stage_moves.setdefault(step.requests[index].req_id, []).append((column, depth))

    def _observe(self, req_id: str, accepted: set[int]) -> None:
        """The policy learns what verification accepted of a request's scheduled nodes."""
        scheduled = self.scheduled.get(req_id)
        if scheduled is not None:
            self.policy.observe(req_id, *scheduled, accepted)

    def branch_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The verify forward's per-row hidden states with each accepted node's state moved to its branch row
        ``P + 1 .. P + a`` (where the runner moved its token); rows of other steps are unchanged."""
        if self.branch_rows is None:
            return hidden_states
        source, destination = (rows.to(hidden_states.device, non_blocking=True) for rows in self.branch_rows)
        return hidden_states.index_copy(0, destination, hidden_states[source])
