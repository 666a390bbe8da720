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

Invariant: a ``TreeConfig`` that exists describes a tree of 1..:data:`MAX_TREE_NODES` nodes whose
parents come first; :attr:`TreeConfig.num_nodes` is what ``num_speculative_tokens`` must equal.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from .building import MAX_TREE_NODES, ChildDrawMode, StaticTreeTemplate


class TreeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    choices: tuple[tuple[int, ...], ...] | None = None
    top_k: int | None = None
    depth: int | None = None
    budget: int | None = None
    draw: Literal["top_k", "sample"] = "top_k"

    @model_validator(mode="after")
    def _check_shape(self) -> TreeConfig:
        dynamic = {name: getattr(self, name) for name in ("top_k", "depth", "budget")}
        given = [name for name, value in dynamic.items() if value is not None]
        if self.choices is not None:
            if given:
                raise ValueError(
                    f"give either choices (a static tree) or top_k/depth/budget (a dynamic tree), not both; "
                    f"remove {', '.join(given)} or choices"
                )
            if len(self.choices) == 0:
                raise ValueError("choices is empty: the tree needs at least one node, e.g. [[0], [1], [0, 0]]")
            if len(self.choices) > MAX_TREE_NODES:
                raise ValueError(
                    f"choices has {len(self.choices)} nodes, more than vLLM's limit of {MAX_TREE_NODES} "
                    f"speculative tokens; use at most {MAX_TREE_NODES} choices"
                )
            StaticTreeTemplate.from_choices(self.choices)  # parents first, no duplicates
            return self
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
            raise ValueError(
                f"budget = {self.budget} is more than the {limit} candidates a dynamic tree with top_k = "
                f"{self.top_k} and depth = {self.depth} can produce (top_k + (depth - 1) * top_k^2); lower "
                f"budget to at most {limit} or raise top_k / depth"
            )
        if self.budget > MAX_TREE_NODES:
            raise ValueError(
                f"budget = {self.budget} is more than vLLM's limit of {MAX_TREE_NODES} speculative tokens; "
                f"use a budget of at most {MAX_TREE_NODES}"
            )
        if self.draw == "sample":
            raise ValueError(
                "draw = 'sample' needs a static tree (choices); dynamic trees are deterministic and always "
                "verify as top-k children, so remove draw or use choices"
            )
        return self

    @property
    def is_static(self) -> bool:
        return self.choices is not None

    @property
    def candidate_count(self) -> int:
        """Dynamic trees: how many candidates the expansion produces before reranking."""
        assert self.top_k is not None and self.depth is not None
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def num_nodes(self) -> int:
        if self.choices is not None:
            return len(self.choices)
        assert self.budget is not None
        return self.budget

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

    def describe(self) -> str:
        if self.choices is not None:
            return f"static tree, {self.num_nodes} nodes, depth {self.max_depth}, draw {self.draw}"
        return f"dynamic tree (EAGLE-2), top_k {self.top_k}, depth {self.depth}, budget {self.budget}"
