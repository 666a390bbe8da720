"""How many nodes each request verifies this step: the one seam between a tree step and its budget (docs/design.md,
"How many nodes each request verifies").

The drafter and the runner call a :class:`NodePolicy` at the same points of every tree step: ``budget`` and
``plan_depth`` before drafting, ``choose`` after it (each :class:`CandidateTree` becomes a ``PendingTree``), spans
from a ``start`` mark around the step's work, and ``observe``, ``forget`` and ``publish`` after verifying.
:class:`TreeBudget` serves a fixed tree and ``budget_by_batch`` untimed; :class:`AutoBudget` serves ``tree.auto``
with the controller, its spans timed by a ``DeviceClock`` that never makes the step wait.

Invariant: a policy's choices depend on the drafts and on earlier verification outcomes only (never on the
target's output of the step being verified), so any policy keeps speculation lossless.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_easyspec.control.acceptance import NodeFeatures
from vllm_easyspec.control.controller import RequestTree, SpeculationController
from vllm_easyspec.control.planning import node_depths
from vllm_easyspec.instruments.device_clock import DeviceClock
from vllm_easyspec.integration.tree_step import PendingTree
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.config import StepBudget, TreeConfig

HORIZON_STEPS = 64  # the most steps over which tree.auto spreads a catch-up first pass


@dataclass(frozen=True)
class CandidateTree:
    """One request's drafted tree (target vocabulary, sources merged in) before the policy cuts it.

    ``row``: the request's row in the drafting step's ``[B, ...]`` tensors (its draft log-probabilities);
    ``value_blind``: the tree's children are i.i.d. draws or re-encoded text, so how many of them to verify
    must not depend on their draft values (that would bias the draws)."""

    req_id: str
    tokens: list[int]
    parents: list[int]
    draw_mode: ChildDrawMode
    draft_probs: torch.Tensor | None = None  # [n + 1, V], i.i.d.-drawn trees only
    from_lookup: tuple[bool, ...] = ()  # per node: merged from prompt lookup
    row: int | None = None  # None: no drafted node has a log-probability (a lookup path alone)
    value_blind: bool = False


@dataclass(frozen=True)
class VerifyShape:
    """A decode-only verify step as the controller prices it: ``rows`` in all, ``masked_rows`` of them in the
    branching trees of ``masked_requests`` of its ``requests``."""

    rows: int
    masked_rows: int
    requests: int
    masked_requests: int


class NodePolicy(Protocol):
    """The tree step's budget (module docstring). ``controller`` is the auto controller, None otherwise (for
    instruments)."""

    controller: SpeculationController | None
    keeps_drafted_order: bool  # each request's nodes stay in drafted order (a prefix is kept)

    def budget(self, batch_size: int) -> StepBudget: ...
    def plan_depth(self, req_ids: Sequence[str], first_pass_rows: int, requests: Mapping[str, Any],
                   path_lengths: list[int] | None) -> int: ...
    def choose(self, candidates: list[CandidateTree], node_limit: int, batch_size: int,
               logprobs: torch.Tensor | None) -> dict[str, PendingTree]: ...
    def start(self) -> Any: ...
    def first_pass_done(self, mark: Any, rows: int, requests: int) -> None: ...
    def levels_done(self, mark: Any, levels: int, rows_per_level: int) -> None: ...
    def drafting_done(self, mark: Any) -> None: ...
    def verify_started(self, mark: Any, shape: VerifyShape | None) -> None: ...
    def verify_done(self) -> None: ...
    def observe(self, req_id: str, features: list[NodeFeatures], parents: list[int], accepted: set[int]) -> None: ...
    def forget(self, live: set[str]) -> None: ...
    def publish(self) -> None: ...


class TreeBudget:
    """A fixed tree, or ``budget_by_batch``: every request verifies its tree's first ``budget(batch).nodes``
    nodes (parents first, so a tree); the tree is drafted to its full depth; nothing is timed or learnt."""

    controller = None
    keeps_drafted_order = True

    def __init__(self, tree: TreeConfig | None = None) -> None:
        self.tree = tree

    def budget(self, batch_size: int) -> StepBudget:
        assert self.tree is not None, "a TreeBudget without a tree config has no budget"
        return self.tree.budget_at(batch_size)

    def plan_depth(self, req_ids: Sequence[str], first_pass_rows: int, requests: Mapping[str, Any],
                   path_lengths: list[int] | None) -> int:
        assert self.tree is not None
        return self.tree.max_depth

    def choose(self, candidates: list[CandidateTree], node_limit: int, batch_size: int,
               logprobs: torch.Tensor | None) -> dict[str, PendingTree]:
        return {tree.req_id: PendingTree.within(node_limit, tree.tokens, tree.parents, tree.draw_mode,
                                                tree.draft_probs, tree.from_lookup)
                for tree in candidates}

    def start(self) -> None:
        return None

    # nothing is timed or learnt
    def first_pass_done(self, mark: Any, rows: int, requests: int) -> None: pass
    def levels_done(self, mark: Any, levels: int, rows_per_level: int) -> None: pass
    def drafting_done(self, mark: Any) -> None: pass
    def verify_started(self, mark: Any, shape: VerifyShape | None) -> None: pass
    def verify_done(self) -> None: pass
    def observe(self, req_id: str, features: list[NodeFeatures], parents: list[int],
                accepted: set[int]) -> None: pass
    def forget(self, live: set[str]) -> None: pass
    def publish(self) -> None: pass


def alone(decision: Any) -> Any:
    """A decision one process takes for itself (one rank): as it is."""
    return decision


class AutoBudget:
    """``tree.auto``: the controller plans each step's depth and cuts each request's tree to the nodes that
    pay; the step's spans keep its cost model current (module docstring). ``agree`` turns each rank's decision
    into the one every rank takes: tensor-parallel ranks draft the same trees with collectives in every level,
    and each rank's own timings would plan differently (a rank drafting one level more hangs the others)."""

    keeps_drafted_order = False  # the controller hands nodes over best first

    def __init__(self, tree: TreeConfig, controller: SpeculationController, clock: DeviceClock,
                 publish: Callable[[], None] | None = None, agree: Callable[[Any], Any] = alone) -> None:
        self.tree = tree
        self.controller = controller
        self.clock = clock
        self._publish = publish
        self._agree = agree
        self._verify: tuple[Any, VerifyShape, Any] | None = None  # (mark, shape, the controller's cycle)

    def budget(self, batch_size: int) -> StepBudget:
        return self.tree.budget_at(batch_size)

    def plan_depth(self, req_ids: Sequence[str], first_pass_rows: int, requests: Mapping[str, Any],
                   path_lengths: list[int] | None) -> int:
        self.clock.poll()  # spans the device has finished reach the controller before it plans
        return self._agree(self.controller.plan_depth(list(req_ids), first_pass_rows,
                                                      horizon_steps(req_ids, requests), path_lengths))

    def choose(self, candidates: list[CandidateTree], node_limit: int, batch_size: int,
               logprobs: torch.Tensor | None) -> dict[str, PendingTree]:
        if not candidates:
            return {}
        rows = None if logprobs is None or all(tree.row is None or tree.value_blind for tree in candidates) \
            else logprobs.tolist()  # one read for the batch: the controller prices nodes by their draft values
        offered = []
        for tree in candidates:
            values = None if rows is None or tree.row is None or tree.value_blind else rows[tree.row]
            features = node_features(tree.parents, tree.from_lookup, values)
            offered.append(RequestTree(tree.req_id, tree.tokens, tree.parents, features,
                                       keeps_order=tree.draw_mode is ChildDrawMode.IID_FROM_DRAFT))
        choices = self._agree(self.controller.choose(offered, batch_size))
        return {tree.req_id: PendingTree.within(choice.count, choice.tokens, choice.parents, tree.draw_mode,
                                                tree.draft_probs, tuple(f.from_lookup for f in choice.features),
                                                choice.features)
                for tree, choice in zip(candidates, choices, strict=True)}

    def start(self) -> Any:
        return self.clock.start()

    def first_pass_done(self, mark: Any, rows: int, requests: int) -> None:
        cycle = self.controller.current_cycle
        self.clock.stop(mark, lambda seconds: self.controller.observe_first_pass(rows, seconds, requests,
                                                                                 cycle=cycle))

    def levels_done(self, mark: Any, levels: int, rows_per_level: int) -> None:
        cycle = self.controller.current_cycle
        self.clock.stop(mark, lambda seconds: self.controller.observe_draft(levels, rows_per_level, seconds,
                                                                            cycle=cycle))

    def drafting_done(self, mark: Any) -> None:
        cycle = self.controller.current_cycle
        self.clock.stop(mark, lambda seconds: self.controller.observe_drafting(seconds, cycle=cycle))

    def verify_started(self, mark: Any, shape: VerifyShape | None) -> None:
        """A verify span opened at ``mark``; ``shape``: a decode-only step's (the cost model learns from those
        only), else None."""
        self.clock.poll()
        self._verify = None if shape is None else (mark, shape, self.controller.current_cycle)

    def verify_done(self) -> None:
        if self._verify is None:
            return
        mark, shape, cycle = self._verify
        self._verify = None
        self.clock.stop(mark, lambda seconds: self.controller.observe_verify(
            shape.rows, seconds, shape.masked_rows, shape.requests, shape.masked_requests, cycle=cycle))

    def observe(self, req_id: str, features: list[NodeFeatures], parents: list[int], accepted: set[int]) -> None:
        self.controller.observe(req_id, features, parents, accepted)

    def forget(self, live: set[str]) -> None:
        self.controller.forget(live)

    def publish(self) -> None:
        if self._publish is not None:
            self._publish()


def node_features(parents: list[int], from_lookup: tuple[bool, ...],
                  logprobs: list[float] | None) -> list[NodeFeatures]:
    """What the controller knows of each node before verification: source, depth, and for drafted nodes their
    draft log-probability given the parent (``logprobs``, None where unknown or not to be used)."""
    from_lookup = tuple(from_lookup) or (False,) * len(parents)
    return [NodeFeatures(lookup, depth, logprobs[index] if not lookup and logprobs is not None else None)
            for index, (lookup, depth) in enumerate(zip(from_lookup, node_depths(parents), strict=True))]


def horizon_steps(req_ids: Sequence[str], requests: Mapping[str, Any]) -> float:
    """Decode steps the batch's requests can still run, for spreading a catch-up first pass: the median of
    their remaining tokens (``max_tokens`` less what they produced), two tokens a step, at most
    :data:`HORIZON_STEPS`."""
    remaining = []
    for req_id in req_ids:
        state = requests.get(req_id)
        params = None if state is None else state.sampling_params
        if params is None or params.max_tokens is None:
            remaining.append(2 * HORIZON_STEPS)
        else:
            remaining.append(max(params.max_tokens - len(state.output_token_ids), 0))
    return min(statistics.median(remaining) / 2, HORIZON_STEPS) if remaining else 1.0
