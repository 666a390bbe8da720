"""The ``tree`` option of ``additional_config["easyspec"]``: which token tree the drafter builds.

Two shapes, exactly one per config:

* static: ``{"choices": [[0], [1], [0, 0], ...]}``, a Medusa / vLLM choice list (node order = list
  order, parents first); ``draw`` says how a sampled (temperature > 0) request's children are drawn:
  ``"top_k"`` (the r-th most likely draft token, verified by recursive rejection sampling) or
  ``"sample"`` (i.i.d. draws from the draft, verified by SpecInfer's multi-step speculative sampling).
  Greedy requests always take the top-k children.
* dynamic (EAGLE-2): ``{"top_k": k, "depth": d, "budget": n}``: expand the top-k children of the top-k
  nodes of each depth, then keep the ``budget`` nodes with the highest cumulative draft log-probability.
  Dynamic trees are deterministic functions of the context, so they always verify as top-k children.

Either shape may take ``sources``, ``retokenize``, ``budget_by_batch``, ``auto`` and ``uniform``; docs/options.md
says what each does.

Invariant: a ``TreeConfig`` that exists describes a tree of 1..:data:`MAX_TREE_NODES` nodes whose
parents come first; :attr:`TreeConfig.num_nodes` is what ``num_speculative_tokens`` must equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from .building import MAX_TREE_NODES, ChildDrawMode, StaticTreeTemplate


class PromptLookupSource(BaseModel):
    """``sources.prompt_lookup``: merge the tokens that followed the longest earlier match of the context's
    last ``min_match``..``max_match`` tokens (vLLM ``ngram``'s idea) into the tree, as up to ``nodes`` nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(ge=1)
    min_match: int = Field(default=2, ge=1)
    max_match: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _check_match(self) -> PromptLookupSource:
        if self.max_match < self.min_match:
            raise ValueError(f"max_match = {self.max_match} is below min_match = {self.min_match}; "
                             "raise max_match or lower min_match")
        return self


class TreeSources(BaseModel):
    """``sources``: candidates merged into the drafted tree (:mod:`vllm_easyspec.tree.merging`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_lookup: PromptLookupSource | None = None

    @property
    def extra_nodes(self) -> int:
        return 0 if self.prompt_lookup is None else self.prompt_lookup.nodes


class ChainLimit(BaseModel):
    """A ``budget_by_batch`` value ``{"chain": k}``: a chain of ``k`` tokens, drafted as the proposer drafts
    without a tree."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chain: int = Field(ge=1)


@dataclass(frozen=True)
class StepBudget:
    """What ``budget_by_batch`` gives each request of one drafting step."""

    nodes: int  # the most nodes a request keeps; 0: no speculation
    chain: bool  # a chain of ``nodes`` tokens, drafted as the proposer drafts without a tree


class AutoSpeculation(BaseModel):
    """``auto``: a controller chooses, every step, how deep to draft and which nodes of each request's candidate
    tree (the tree this config describes, sources merged in) to verify, from a cost model measured at start-up
    and an acceptance model calibrated while serving (:mod:`vllm_easyspec.control`). ``max_nodes`` caps the
    nodes one request verifies in a step (default: the whole candidate tree)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_nodes: int | None = Field(default=None, ge=1)


class TreeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    choices: tuple[tuple[int, ...], ...] | None = None
    top_k: int | None = None
    depth: int | None = None
    budget: int | None = None
    draw: Literal["top_k", "sample"] = "top_k"
    sources: TreeSources | None = None
    retokenize: bool | None = None  # None: bridge by text wherever it applies (bridges_by_text)
    # running requests -> from that batch size on, most nodes per request (0: no speculation) or a chain
    budget_by_batch: dict[int, int | ChainLimit] | None = None
    auto: AutoSpeculation | None = None
    uniform: StrictBool = False  # every request of a tree step verifies num_nodes nodes, padded (never accepted)

    @field_validator("auto", mode="before")
    @classmethod
    def _read_auto(cls, value: object) -> object:
        """``true`` is ``{}`` (the controller with its defaults), ``false`` is no controller."""
        if value is True:
            return {}
        return None if value is False else value

    @field_validator("budget_by_batch", mode="before")
    @classmethod
    def _read_budget_by_batch(cls, table: object) -> object:
        """One message per bad value, naming the batch size and both accepted forms."""
        if not isinstance(table, dict):
            return table
        read: dict[object, object] = {}
        for batch, value in table.items():
            if isinstance(value, dict) and set(value) == {"chain"} and _is_int(value["chain"]) and value["chain"] >= 1:
                read[batch] = ChainLimit(chain=value["chain"])
            elif _is_int(value) or isinstance(value, ChainLimit):
                read[batch] = value
            else:
                raise ValueError(f"budget_by_batch gives {value!r} at batch size {batch}; give a node count "
                                 '(0: no speculation) or {"chain": k} with k >= 1 (a top-1 chain of k '
                                 "tokens)")
        return read

    def _limit_at(self, running_requests: int) -> int | ChainLimit:
        limit: int | ChainLimit = self.num_nodes
        for batch, value in sorted((self.budget_by_batch or {}).items()):
            if batch <= running_requests:
                limit = value
        return limit

    def budget_at(self, running_requests: int) -> StepBudget:
        """What each request may draft when the drafter's batch has ``running_requests`` requests: the entry
        of ``budget_by_batch`` with the largest batch size not above it (a node count, or a chain's length),
        else every node. A tree cut to its first ``k`` nodes is a tree (parents come first)."""
        limit = self._limit_at(running_requests)
        if isinstance(limit, ChainLimit):
            return StepBudget(nodes=min(limit.chain, self.num_nodes), chain=True)
        return StepBudget(nodes=min(limit, self.num_nodes), chain=False)

    def drafted_within(self, node_limit: int) -> TreeConfig:
        """The tree to draft when each request may keep only ``node_limit`` (>= 1) nodes. A dynamic tree
        becomes the EAGLE-2 tree of budget ``node_limit`` and depth ``min(depth, node_limit)``: the
        ``node_limit`` best-scoring nodes of the full tree (a node never outscores its parent, so they lie
        within that depth), drafted with fewer level forwards. A static tree is drafted whole; its first
        ``node_limit`` nodes are kept after drafting. (A ``{"chain": k}`` limit is drafted by the proposer's
        own chain drafting, not as a tree.)"""
        if self.is_static or node_limit >= self.drafted_nodes:
            return self
        assert self.depth is not None
        return self.model_copy(update={"budget": node_limit, "depth": min(self.depth, node_limit)})

    def within_depth(self, depth: int) -> TreeConfig:
        """The tree drafted at most ``depth`` (>= 1) deep: a dynamic tree's EAGLE-2 expansion stopped there (its
        budget lowered to the candidates that depth has), a static tree's nodes of that depth or less (every
        ancestor of a kept node is kept)."""
        if depth >= self.max_depth:
            return self
        if self.is_static:
            return self.model_copy(update={"choices": tuple(c for c in self.choices if len(c) <= depth)})
        assert self.top_k is not None
        return self.model_copy(update={"depth": depth, "budget": min(self.budget,
                                                                    self.top_k + (depth - 1) * self.top_k ** 2)})

    def _check_budget_by_batch(self) -> TreeConfig:
        for batch, value in (self.budget_by_batch or {}).items():
            if batch < 1:
                raise ValueError(f"budget_by_batch has batch size {batch}; batch sizes (the keys) must be >= 1")
            if isinstance(value, ChainLimit):
                if value.chain > self.num_nodes:
                    raise ValueError(f"budget_by_batch gives a chain of {value.chain} at batch size "
                                     f"{batch}; a chain may be at most the tree's {self.num_nodes} nodes "
                                     "(num_speculative_tokens) long")
            elif not 0 <= value <= self.num_nodes:
                raise ValueError(
                    f"budget_by_batch gives {value} nodes at batch size {batch}; node counts (the values) must be "
                    f"between 0 (no speculation) and the tree's {self.num_nodes} nodes, or {{\"chain\": k}} "
                    "for a chain of k tokens"
                )
        return self

    def _check_auto(self) -> TreeConfig:
        if self.auto is None:
            return self
        if self.budget_by_batch:
            raise ValueError("auto chooses each request's nodes every step from measured costs, so it "
                             "replaces budget_by_batch; remove one of them")
        if self.auto.max_nodes is not None and self.auto.max_nodes > self.num_nodes:
            raise ValueError(f"auto.max_nodes = {self.auto.max_nodes} is more than the candidate tree's "
                             f"{self.num_nodes} nodes; lower it to at most {self.num_nodes} or leave it out")
        return self

    def _check_sources(self) -> TreeConfig:
        if self.retokenize is True and self.draw == "sample":
            raise ValueError("retokenize needs draw = 'top_k': re-encoded candidates are not draws from the "
                             "draft's distribution over target tokens, so they verify as top-k children; "
                             "remove draw or retokenize")
        if self.sources is None or not self.sources.extra_nodes:
            return self._check_budget_by_batch()._check_auto()
        if self.draw == "sample":
            raise ValueError("sources need draw = 'top_k': merged candidates are deterministic children, "
                             "which multi-step speculative sampling over i.i.d. draws cannot verify; remove "
                             "draw or remove sources")
        if self.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"the tree ({self.drafted_nodes} nodes) plus sources "
                             f"({self.sources.extra_nodes} nodes) has {self.num_nodes} nodes, more than "
                             f"vLLM's limit of {MAX_TREE_NODES} speculative tokens; lower "
                             "sources.prompt_lookup.nodes or the tree's size")
        return self._check_budget_by_batch()._check_auto()

    @model_validator(mode="after")
    def _check_shape(self) -> TreeConfig:
        dynamic = {name: getattr(self, name) for name in ("top_k", "depth", "budget")}
        given = [name for name, value in dynamic.items() if value is not None]
        if self.choices is not None:
            if given:
                raise ValueError("give either choices (a static tree) or top_k/depth/budget (a dynamic "
                                 f"tree), not both; remove {', '.join(given)} or choices")
            if len(self.choices) == 0:
                raise ValueError("choices is empty: the tree needs at least one node, e.g. [[0], [1], [0, 0]]")
            if len(self.choices) > MAX_TREE_NODES:
                raise ValueError(f"choices has {len(self.choices)} nodes, more than vLLM's limit of "
                                 f"{MAX_TREE_NODES} speculative tokens; use at most {MAX_TREE_NODES} choices")
            StaticTreeTemplate.from_choices(self.choices)  # parents first, no duplicates
            return self._check_sources()
        if len(given) != 3:
            missing = [name for name, value in dynamic.items() if value is None]
            raise ValueError(
                "a tree needs either choices (static), e.g. {\"choices\": [[0], [1], [0, 0]]}, or all of top_k, "
                f"depth and budget (dynamic, EAGLE-2), e.g. {{\"top_k\": 4, \"depth\": 3, \"budget\": 8}}; "
                f"missing: {', '.join(missing)}"
            )
        for name in ("top_k", "depth", "budget"):
            if dynamic[name] < 1:
                raise ValueError(f"{name} must be >= 1, got {dynamic[name]}")
        limit = self.candidate_count
        if self.budget > limit:
            raise ValueError(f"budget = {self.budget} is more than the {limit} candidates a dynamic tree "
                             f"with top_k = {self.top_k} and depth = {self.depth} can produce (top_k + "
                             f"(depth - 1) * top_k^2); lower budget to at most {limit} or raise top_k / "
                             "depth")
        if self.budget > MAX_TREE_NODES:
            raise ValueError(f"budget = {self.budget} is more than vLLM's limit of {MAX_TREE_NODES} "
                             f"speculative tokens; use a budget of at most {MAX_TREE_NODES}")
        if self.draw == "sample":
            raise ValueError("draw = 'sample' needs a static tree (choices); dynamic trees are "
                             "deterministic and always verify as top-k children, so remove draw or use "
                             "choices")
        return self._check_sources()

    @property
    def is_static(self) -> bool:
        return self.choices is not None

    @property
    def candidate_count(self) -> int:
        """Dynamic trees: how many candidates the expansion produces before reranking."""
        assert self.top_k is not None and self.depth is not None
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def drafted_nodes(self) -> int:
        """Nodes the drafter drafts (the static template's, or the dynamic budget)."""
        if self.choices is not None:
            return len(self.choices)
        assert self.budget is not None
        return self.budget

    @property
    def forwarded_nodes(self) -> int:
        """Most nodes one drafting step forwards through the drafter, level by level (those that get children:
        a static template's inner nodes, or a dynamic tree's ``top_k`` per depth but the last)."""
        if self.choices is not None:
            return sum(len(level) for level in self.template().expansion_levels()[1:])
        assert self.top_k is not None and self.depth is not None
        return self.top_k * (self.depth - 1)

    @property
    def widest_frontier(self) -> int:
        """Most nodes of one request one level forwards (a static template's depth with the most inner nodes, or
        a dynamic tree's ``top_k``)."""
        if self.choices is not None:
            return max((len(level) for level in self.template().expansion_levels()[1:]), default=0)
        assert self.top_k is not None
        return self.top_k

    @property
    def num_nodes(self) -> int:
        """Most nodes a request's tree can have: the drafted ones plus those the sources may add."""
        return self.drafted_nodes + (0 if self.sources is None else self.sources.extra_nodes)

    @property
    def max_depth(self) -> int:
        if self.choices is not None:
            return max(len(choice) for choice in self.choices)
        assert self.depth is not None
        return self.depth

    def template(self) -> StaticTreeTemplate:
        if self.choices is None:
            raise ValueError("a dynamic tree has no static template")
        return StaticTreeTemplate.from_choices(self.choices)

    def draw_mode(self, greedy: bool) -> ChildDrawMode:
        """How the children of a request's tree are drawn: greedy requests and ``draw = top_k`` take the
        most likely draft tokens; ``draw = sample`` draws sampled requests' children i.i.d. from the draft."""
        if greedy or self.draw == "top_k":
            return ChildDrawMode.WITHOUT_REPLACEMENT
        return ChildDrawMode.IID_FROM_DRAFT

    def bridges_by_text(self, across_vocabularies: bool) -> bool:
        """Whether the tree is re-encoded in the target's vocabulary: ``retokenize`` when given, else (the
        default) whenever the drafter's vocabulary differs from the target's (``across_vocabularies``: a draft
        model with ``use_heterogeneous_vocab``) and children are top-k (re-encoded candidates are no i.i.d.
        draws). The drafter may still fall back to shared ids when a tokenizer's token text is unknown."""
        if self.retokenize is not None:
            return self.retokenize
        return across_vocabularies and self.draw == "top_k"

    def describe(self) -> str:
        if self.choices is not None:
            text = f"static tree, {self.drafted_nodes} nodes, depth {self.max_depth}, draw {self.draw}"
        else:
            text = f"dynamic tree (EAGLE-2), top_k {self.top_k}, depth {self.depth}, budget {self.budget}"
        if self.sources is not None and self.sources.prompt_lookup is not None:
            text += f", plus up to {self.sources.prompt_lookup.nodes} prompt-lookup nodes"
        if self.retokenize is True:
            text += ", re-encoded in the target's vocabulary"
        if self.auto is not None:
            text += ", nodes chosen per request every step (auto)"
        return text


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
