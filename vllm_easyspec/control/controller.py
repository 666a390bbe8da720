"""The speculation controller of ``easyspec.tree.auto``: every step, how deep to draft and which nodes of each
request's candidate tree to verify, from a measured cost model and a calibrated acceptance model
(docs/design.md, "Self-tuning speculation"): :meth:`SpeculationController.plan_depth` before drafting,
:meth:`SpeculationController.choose` after it, ``observe*`` with the outcomes and timings; an
:class:`OutcomeGuard` holds drafting back where it produced less than plain cycles, and steps explore
(:class:`Exploring`) from a budget of :data:`EXPLORE_SHARE` of the verify time. Trees of i.i.d. draws keep their
template order and are chosen without their draft probabilities.

Invariant: every choice is a function of the draft's output, of earlier verification outcomes and of random
draws independent of every verification, so speculation stays lossless whatever the controller chooses.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from vllm_easyspec.control.acceptance import AcceptanceModel, NodeFeatures
from vllm_easyspec.control.cost import StepCostModel
from vllm_easyspec.control.planning import (
    AveragedOffer,
    Candidates,
    DepthPlan,
    DepthRate,
    OfferedTree,
    at_least,
    best_first_order,
    best_nodes,
    choose_depth,
    choose_nodes,
    path_length,
    renumbered_parents,
    running_minimum,
    with_top_path_first,
)

OfferKey = tuple[int, bool]  # (drafted depth, whether the step had a prompt-lookup path)
FIRST_DEPTH_RATE = 0.6  # before any tree was offered: a chain whose node at depth j has chance FIRST_DEPTH_RATE ** j
OWN_OFFER_WEIGHT = 0.25  # weight of a request's newest offered tree in its average offer at each depth
SHARED_OFFER_WEIGHT = 0.05  # ... of any request's newest tree in the average offer a request starts from
EXPLORE_EVERY = 16  # one step in this many verifies a random number of the best nodes, or drafts the whole depth
EXPLORE_SHARE = 0.02  # share of decode verify time that exploring steps get
EXPLORE_MOST_STEPS = 4  # the exploration budget holds at most this many verify steps' time
RATIO_MEMORY = 0.98  # decay per step of a batch-size bucket of the sums behind its realised / predicted accepted
# nodes: per step, not per request, so a bucket's ratio rests on its last ~50 steps at any batch size
GUARD_MEMORY = 0.9  # decay per decode cycle of the sums behind a bucket's tokens per second
GUARD_MIN_CYCLES = 8  # cycles of a kind a bucket needs before its measured rate is trusted
GUARD_STANDARD_ERRORS = 1.0  # how far below plain cycles drafted ones must be for the guard to hold back
CURRENT_CYCLE = object()  # an observation's default cycle: the one open when it arrives


@dataclass
class RequestTree:
    """One request's candidate tree as the drafter hands it to :meth:`SpeculationController.choose`."""

    req_id: str
    tokens: list[int]
    parents: list[int]
    features: list[NodeFeatures]
    keeps_order: bool  # i.i.d. children: verify a prefix of the given order


@dataclass
class Choice:
    """A request's nodes best first, the chances of each, and how many it verifies."""

    tokens: list[int]
    parents: list[int]
    features: list[NodeFeatures]
    chances: list[float]
    count: int


class Exploring(Enum):
    """Why this step drafts what it drafts, which decides what :meth:`SpeculationController.choose` verifies."""

    NO = "no"  # the plan's depth: verify the nodes the choice takes
    ACCEPTANCE = "acceptance"  # one level where the plan drafts none: verify each request's best level_width nodes
    DEPTH = "depth"  # the whole depth where the plan drafts less: verify each request's top path first


_OrderedTree = tuple[list[int], list[int], list[NodeFeatures], list[float]]  # tokens, parents, features, chances


def _in_order(tree: _OrderedTree, order: list[int]) -> _OrderedTree:
    """A request's nodes (tokens, parents, features, chances) taken in ``order``, a topological order of them."""
    tokens, parents, features, chances = tree
    return ([tokens[i] for i in order], renumbered_parents(parents, order), [features[i] for i in order],
            [chances[i] for i in order])


@dataclass
class ControllerStats:
    """Per-worker counters of the controller (read through the worker extension)."""

    steps: int = 0
    requests: int = 0
    nodes_offered: int = 0
    nodes_chosen: int = 0
    requests_without_nodes: int = 0
    predicted_accepted: float = 0.0  # sum of P(accepted) over the chosen nodes that were verified
    realised_accepted: int = 0
    controller_seconds: float = 0.0
    exploring_steps: int = 0
    exploring_drafts: int = 0  # steps that drafted, or drafted deeper, only to explore (the exploration budget)
    steps_without_drafting: int = 0  # plan_depth expected no node to pay: no drafting, the first pass deferred
    steps_held_back: int = 0  # the models said drafting pays, the measured outcome said it does not
    lookup_only_steps: int = 0  # steps that drafted nothing and verified prompt-lookup nodes alone
    lookup_steps_held_back: int = 0  # ... the models said those paths pay, the measured outcome said they do not
    nodes_per_request: Counter = field(default_factory=Counter)  # chosen nodes -> requests
    depth_per_step: Counter = field(default_factory=Counter)  # drafted depth -> steps


@dataclass
class _Rate:
    """Decayed sums of tokens and seconds over decode cycles of one kind, and their standard error."""

    tokens: float = 0.0
    seconds: float = 0.0
    cycles: int = 0
    weight: float = 0.0  # decayed count of cycles: seconds / weight is a cycle's recent mean
    # decayed sums of squared weights times tokens^2, tokens * seconds, seconds^2 (weights decay by GUARD_MEMORY)
    tokens_squared: float = 0.0
    tokens_seconds: float = 0.0
    seconds_squared: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = GUARD_MEMORY * self.tokens + tokens
        self.seconds = GUARD_MEMORY * self.seconds + seconds
        self.weight = GUARD_MEMORY * self.weight + 1.0
        self.cycles += 1
        memory_squared = GUARD_MEMORY**2
        self.tokens_squared = memory_squared * self.tokens_squared + tokens * tokens
        self.tokens_seconds = memory_squared * self.tokens_seconds + tokens * seconds
        self.seconds_squared = memory_squared * self.seconds_squared + seconds * seconds

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def standard_error(self) -> float:
        """Of :attr:`per_second`, a ratio of weighted sums: ``sqrt(sum w^2 (t - R s)^2) / sum w s``, the
        linearised ratio estimator's, whose residuals are what one cycle's tokens differ from its seconds' worth
        at rate ``R``."""
        if self.seconds <= 0:
            return 0.0
        rate = self.per_second
        residual = self.tokens_squared - 2 * rate * self.tokens_seconds + rate * rate * self.seconds_squared
        return max(residual, 0.0) ** 0.5 / self.seconds


@dataclass
class DecodeCycle:
    """One decode cycle in progress: the drafting that ``plan_depth`` opened, then the verify that closes it."""

    drafted: bool
    requests: set[str] = field(default_factory=set)
    weighed: bool = True  # False: a step that drafted only to explore acceptance, not what the guard compares
    first_pass_share: float = 1.0  # of its first pass, the share this cycle pays (the rest: later cycles')
    horizon_steps: float = 1.0  # the steps over which plan_depth spread a catch-up first pass
    seconds: float = 0.0
    first_pass_seconds: float = 0.0
    level_seconds: float = 0.0
    nodes: int = 0  # the nodes its verify checks (a cycle that drafted nothing may verify prompt-lookup paths)
    accepted: int = 0

    @property
    def deferred_seconds(self) -> float:
        """The share of its catch-up first pass that the cycle leaves to the drafted cycles after it."""
        return (1.0 - self.first_pass_share) * self.first_pass_seconds

    def charged_seconds(self, verify_seconds: float) -> float:
        """What the cycle costs the guard before any earlier catch-up is repaid: its drafting and verify, less
        what it leaves to later cycles (as :meth:`SpeculationController.plan_depth` charges it)."""
        return self.seconds + verify_seconds - self.deferred_seconds


@dataclass
class OutcomeGuard:
    """Tokens per second of whole decode cycles (drafting + verify), by batch-size bucket (powers of two), kept
    apart for cycles that drafted, plain cycles (no node verified) and cycles that verified prompt-lookup paths
    alone (docs/design.md, "Outcome guard").

    Invariant: :meth:`holds_back` depends only on timings and earlier verification outcomes."""

    drafted: dict[int, _Rate] = field(default_factory=dict)
    plain: dict[int, _Rate] = field(default_factory=dict)
    lookup: dict[int, _Rate] = field(default_factory=dict)  # cycles that verified prompt-lookup paths alone
    standard_errors: float = GUARD_STANDARD_ERRORS  # how far below plain a kind of cycle must be to be held back

    @staticmethod
    def bucket(requests: int) -> int:
        return requests.bit_length()

    def add(self, drafted: bool, requests: int, tokens: int, seconds: float, lookup_only: bool = False) -> None:
        rates = self.lookup if lookup_only else self.drafted if drafted else self.plain
        rates.setdefault(self.bucket(requests), _Rate()).add(tokens, seconds)

    def forget_drafted(self) -> None:
        """Every request behind the drafted (and lookup-only) cycles has finished: their acceptance says nothing
        about the running ones. Plain cycles produce one token per request, whoever runs, and are kept."""
        self.drafted.clear()
        self.lookup.clear()

    def holds_back(self, requests: int, plain_seconds: float) -> bool:
        """Whether cycles that drafted, at this many requests, measurably produced fewer tokens per second than
        plain cycles (measured ones, else ``requests`` tokens in ``plain_seconds``, the verify model's
        cost of a cycle without drafts): by more than :data:`GUARD_STANDARD_ERRORS` standard errors of the
        difference."""
        return self._below_plain(self.drafted, requests, plain_seconds)

    def holds_back_lookup(self, requests: int, plain_seconds: float) -> bool:
        """:meth:`holds_back` for cycles that verified prompt-lookup paths alone."""
        return self._below_plain(self.lookup, requests, plain_seconds)

    def lookup_cycle_seconds(self, requests: int) -> float:
        """What a cycle that verified lookup paths alone has recently taken at this many requests (0 before any)."""
        rate = self.lookup.get(self.bucket(requests))
        return rate.seconds / rate.weight if rate is not None and rate.weight > 0 else 0.0

    def _below_plain(self, rates: dict[int, _Rate], requests: int, plain_seconds: float) -> bool:
        key = self.bucket(requests)
        measured = rates.get(key)
        if measured is None or measured.cycles < GUARD_MIN_CYCLES:
            return False
        plain = self.plain.get(key)
        if plain is not None and plain.cycles >= GUARD_MIN_CYCLES:
            baseline, baseline_error = plain.per_second, plain.standard_error
        else:
            baseline, baseline_error = (requests / plain_seconds if plain_seconds > 0 else 0.0), 0.0
        error = (measured.standard_error**2 + baseline_error**2) ** 0.5
        return measured.per_second + self.standard_errors * error < baseline

    def table(self) -> list[dict[str, float]]:
        """Per bucket: its requests range and each kind's tokens per second and cycles."""
        rows = []
        for key in sorted(set(self.drafted) | set(self.plain) | set(self.lookup)):
            row: dict[str, float] = {"requests_from": 1 << (key - 1), "requests_to": (1 << key) - 1}
            for kind, rates in (("drafted", self.drafted), ("plain", self.plain), ("lookup", self.lookup)):
                rate = rates.get(key)
                row[f"{kind}_tokens_per_second"] = rate.per_second if rate else 0.0
                row[f"{kind}_cycles"] = rate.cycles if rate else 0
            rows.append(row)
        return rows


class SpeculationController:
    def __init__(self, cost: StepCostModel, max_depth: int, max_nodes: int, level_width: int,
                 guard: OutcomeGuard | None = None, explore_draws: random.Random | None = None) -> None:
        """``max_depth``: the candidate tree's drafted depth; ``max_nodes``: the most nodes a request verifies;
        ``level_width``: draft rows per request in one level forward; ``guard``: the outcome guard (default:
        :class:`OutcomeGuard`); ``explore_draws``: the random source of exploring steps (default seeded, and
        independent of every verification, so choices stay lossless)."""
        self.cost = cost
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.level_width = level_width
        self.acceptance = AcceptanceModel()
        # per request, and over every request: (depth, with a prompt-lookup path) -> the average offer of
        # drafting that deep at steps with / without a lookup path
        self.offered: dict[str, dict[OfferKey, AveragedOffer]] = {}
        self.offered_by_anyone: dict[OfferKey, AveragedOffer] = {}
        self._with_lookup: dict[str, bool] = {}  # request -> whether this step's plan saw a lookup path
        self._offers_version = 0  # counts the offers remembered: each changes the shared averages
        # request -> ((offers version, ratio, with lookup), its offers by depth then): a request's offers change
        # only when some request remembers an offer or the ratio changes, not at steps that draft nothing
        self._offers_cache: dict[str, tuple[tuple[int, float, bool], list[Candidates]]] = {}
        self._drafted_levels = max_depth  # the depth plan_depth chose this step
        self.stats = ControllerStats()
        self._explore = random.Random(0) if explore_draws is None else explore_draws
        # request -> (chances of the nodes it verifies this step in their order, the ratio behind them, the step's
        # batch-size bucket); the scheduler may verify a prefix of them only
        self._predicted: dict[str, tuple[tuple[float, ...], float, int]] = {}
        self._ratio_sums: dict[int, list[float]] = {}  # bucket -> decayed [realised, predicted] accepted nodes
        self.guard = OutcomeGuard() if guard is None else guard
        self._guard_requests: set[str] = set()  # the running requests whose cycles the guard has weighed
        self._cycle: DecodeCycle | None = None
        self._first_pass_debt = 0.0  # catch-up first-pass seconds that drafted cycles have yet to repay to the guard
        self._explore_budget = 0.0  # seconds exploring steps may still spend
        self._exploring = Exploring.NO  # what this step's drafting explores
        self._lookup_held_back = False  # this step, if it drafts nothing, verifies no prompt-lookup path
        # receives one record per plan_depth call when set (instruments.plan_log: VLLM_EASYSPEC_PLAN_LOG)
        self.plan_log: Callable[[dict[str, Any]], None] | None = None

    @property
    def current_cycle(self) -> DecodeCycle | None:
        """The decode cycle the last :meth:`plan_depth` opened and no :meth:`observe_verify` has closed yet (a
        timing that reaches the controller late, as a GPU's spans do, names its cycle with this)."""
        return self._cycle

    @property
    def explore_budget(self) -> float:
        """Seconds exploring steps may still spend."""
        return self._explore_budget

    @property
    def realised_over_predicted(self) -> float:
        """Realised over predicted accepted nodes, over every batch size."""
        realised = sum(sums[0] for sums in self._ratio_sums.values())
        predicted = sum(sums[1] for sums in self._ratio_sums.values())
        return realised / predicted if predicted > 0 else 1.0

    def ratio_at(self, requests: int) -> float:
        """Realised over predicted accepted nodes at this many requests' batch-size bucket (1 before any)."""
        realised, predicted = self._ratio_sums.get(OutcomeGuard.bucket(requests), (1.0, 1.0))
        return realised / predicted

    # ------------------------------------------------------------------------------------------ before drafting
    def plan_depth(self, req_ids: list[str], first_pass_rows: int, horizon_steps: float = 1.0,
                   lookup_lengths: list[int] | None = None) -> int:
        """How deep to draft this step; 0 when no node is expected to repay drafting, so the step drafts
        nothing (its first pass, over ``first_pass_rows`` rows, is deferred) and verifies at most the
        requests' prompt-lookup paths (``lookup_lengths``: their nodes, known before drafting; :meth:`choose`
        picks which), or one level where the exploration budget covers it, so acceptance keeps being observed.
        First-pass rows beyond two per request are charged spread over ``horizon_steps`` (steps left)."""
        started = time.perf_counter()
        batch = len(req_ids)
        level_rows = batch * self.level_width
        steady = self.cost.first_pass_seconds(min(first_pass_rows, 2 * batch), batch)
        catch_up = self.cost.first_pass_seconds(first_pass_rows, batch) - steady
        first_pass = steady + catch_up / max(horizon_steps, 1.0)
        overhead = self.cost.overhead_seconds(batch)  # the drafting stage's host work

        def draft_seconds(depth: int) -> float:
            return first_pass + overhead + self.cost.draft_seconds(depth - 1, level_rows)

        ratio = self.ratio_at(batch)
        for index, req_id in enumerate(req_ids):
            self._with_lookup[req_id] = bool(lookup_lengths and lookup_lengths[index])
        by_request = [self._offers_by_depth(req_id, ratio) for req_id in req_ids]
        by_depth = [[offers[depth] for offers in by_request] for depth in range(self.max_depth)]
        without_drafting = self._lookup_paths(req_ids, lookup_lengths, ratio)
        options: list[DepthRate] | None = [] if self.plan_log is not None else None
        plan = (choose_depth(by_depth, self.cost.verify_seconds, draft_seconds, without_drafting, options,
                             self.cost.verify_floor)
                if req_ids else DepthPlan(0, 0))
        held_back = plan.depth > 0 and self.guard.holds_back(batch, self.cost.verify_seconds(batch))
        self._exploring = Exploring.NO
        if req_ids and (plan.depth == 0 or held_back):
            depth = self._explore_instead_of(plan, held_back, batch, steady + catch_up + overhead)
        elif req_ids and plan.depth < self.max_depth and self._explore.random() * EXPLORE_EVERY < 1:
            depth = self._explore_deeper_than(plan, batch)
        else:
            depth = plan.depth
        self.stats.depth_per_step[depth] += 1
        self.stats.lookup_steps_held_back += depth == 0 and self._lookup_held_back
        self._drafted_levels = depth
        if self.plan_log is not None:
            self.plan_log({"requests": batch, "with_lookup": sum(self._with_lookup[r] for r in req_ids),
                           "first_pass_rows": first_pass_rows, "planned": plan.depth, "drafted": depth,
                           "held_back": held_back, "lookup_held_back": self._lookup_held_back,
                           "exploring": self._exploring.value,
                           "options": [asdict(option) for option in options or []]})
        full_first_pass = steady + catch_up
        self._cycle = DecodeCycle(drafted=depth > 0, requests=set(req_ids), weighed=self._exploring is Exploring.NO,
                                  first_pass_share=first_pass / full_first_pass if full_first_pass > 0 else 1.0,
                                  horizon_steps=max(horizon_steps, 1.0))
        self.stats.controller_seconds += time.perf_counter() - started
        return depth

    def _lookup_paths(self, req_ids: list[str], lookup_lengths: list[int] | None, ratio: float
                      ) -> list[Candidates] | None:
        """The requests' prompt-lookup paths offered alone, or None when there are none or the guard holds them
        back (cycles that verified them alone measurably produced less than plain ones) and the exploration budget
        does not cover what such a cycle has recently taken; sets :attr:`_lookup_held_back`."""
        paths = None if lookup_lengths is None else [
            self._lookup_path(req_id, length, ratio) for req_id, length in zip(req_ids, lookup_lengths, strict=True)]
        batch = len(req_ids)
        self._lookup_held_back = bool(paths) and self.guard.holds_back_lookup(batch, self.cost.verify_seconds(batch))
        if not self._lookup_held_back:
            return paths
        path_nodes = sum(len(path.chances) for path in paths)
        # what such a cycle has taken, where the models priced it too low (they said it pays)
        exploring = max(self.cost.verify_seconds(batch + path_nodes, requests=batch),
                        self.guard.lookup_cycle_seconds(batch)) - self.cost.verify_seconds(batch)
        if self._explore_budget < exploring:
            return None
        self._explore_budget -= exploring
        self._lookup_held_back = False
        return paths

    def _explore_instead_of(self, plan: DepthPlan, held_back: bool, batch: int, drafting_overhead: float) -> int:
        """The depth drafted where the plan drafts nothing or the guard holds its drafting back: where the
        exploration budget covers it, the plan's depth and nodes (``held_back``: seen by the guard) or one level
        with each request's best ``level_width`` nodes (acceptance, not weighed by the guard); else 0.
        ``drafting_overhead``: the whole first pass and the drafting stage's host work."""
        level_rows = batch * self.level_width
        explore_depth, explore_rows = (plan.depth, plan.nodes) if held_back else (1, level_rows)
        exploring = (drafting_overhead + self.cost.draft_seconds(explore_depth - 1, level_rows)
                     + max(self.cost.verify_seconds(batch + explore_rows, requests=batch)
                           - self.cost.verify_seconds(batch), 0.0))
        if self._explore_budget >= exploring:
            self._explore_budget -= exploring
            self._exploring = Exploring.NO if held_back else Exploring.ACCEPTANCE
            self.stats.exploring_drafts += 1
            return explore_depth
        self.stats.steps_without_drafting += 1
        self.stats.steps_held_back += held_back
        return 0

    def _explore_deeper_than(self, plan: DepthPlan, batch: int) -> int:
        """The whole depth where the exploration budget covers its extra levels and each request's top path
        besides the plan's nodes (what is accepted deeper is seen only where it is drafted and verified); else
        the plan's depth."""
        rows = batch + plan.nodes
        deeper = (self.cost.draft_seconds(self.max_depth - plan.depth, batch * self.level_width)
                  + max(self.cost.verify_seconds(rows + batch * min(self.max_depth, self.max_nodes), requests=batch)
                        - self.cost.verify_seconds(rows, requests=batch), 0.0))
        if self._explore_budget < deeper:
            return plan.depth
        self._explore_budget -= deeper
        self._exploring = Exploring.DEPTH
        self.stats.exploring_drafts += 1
        return self.max_depth

    def _offers_by_depth(self, req_id: str, ratio: float) -> list[Candidates]:
        """The nodes ``req_id`` would offer when drafting 1, 2, ..., ``max_depth`` levels this step: at each depth
        its average offer at steps like this one (with or without a prompt-lookup path), else every request's,
        else a chain of :data:`FIRST_DEPTH_RATE` powers; each at least as good, node by node, as every shallower
        depth's (drafting deeper offers those nodes too: a stale deeper average must not look worse)."""
        with_lookup = self._with_lookup.get(req_id, False)
        key = (self._offers_version, ratio, with_lookup)
        cached = self._offers_cache.get(req_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        own = self.offered.get(req_id, {})
        offers: list[Candidates] = []
        for depth in range(1, self.max_depth + 1):
            average = own.get((depth, with_lookup)) or self.offered_by_anyone.get((depth, with_lookup))
            offer = self._first_offer(depth) if average is None else average.candidates(ratio, self.max_nodes)
            if offers:
                offer = at_least(offer, offers[-1])
            offers.append(offer)
        self._offers_cache[req_id] = (key, offers)
        return offers

    def _lookup_path(self, req_id: str, length: int, ratio: float) -> Candidates:
        """A prompt-lookup path of ``length`` nodes offered alone, priced by the acceptance model."""
        chances = self.acceptance.lookup_path_chances(req_id, length)
        return Candidates([min(ratio * chance, 1.0) for chance in chances[: self.max_nodes]], self.max_nodes)

    def _first_offer(self, depth: int) -> Candidates:
        return Candidates([FIRST_DEPTH_RATE ** (j + 1) for j in range(min(depth, self.max_nodes))], self.max_nodes)

    def remember_offer(self, req_id: str, tree: OfferedTree, with_lookup: bool | None = None) -> None:
        """Moves ``req_id``'s average offer at every depth ``tree`` drafted toward what it offered there, and
        every request's average by a smaller weight; kept apart by ``with_lookup`` (None: whether ``tree`` has
        lookup nodes), since a lookup path, when there is one, is offered at every depth."""
        if with_lookup is None:
            with_lookup = any(tree.from_lookup)
        own = self.offered.setdefault(req_id, {})
        for depth, offer in enumerate(tree.by_depth(self.max_nodes), start=1):
            key = (depth, with_lookup)
            shared = self.offered_by_anyone.setdefault(key, AveragedOffer.of(self._first_offer(depth)))
            if key not in own:
                own[key] = AveragedOffer(list(shared.chances), shared.path_length)
            own[key].add(offer, OWN_OFFER_WEIGHT)
            shared.add(offer, SHARED_OFFER_WEIGHT)
            self._offers_version += 1

    # ------------------------------------------------------------------------------------------ after drafting
    def choose(self, trees: list[RequestTree], batch_size: int | None = None) -> list[Choice]:
        """Each tree's nodes best first and how many of them it verifies, in a batch of ``batch_size`` requests
        (None: the trees' requests alone; the others offer nothing but verify a row each)."""
        started = time.perf_counter()
        batch = len(trees) if batch_size is None else max(batch_size, len(trees))
        ordered: list[_OrderedTree] = []
        bucket = OutcomeGuard.bucket(batch)
        ratio = self.ratio_at(batch)
        sums = self._ratio_sums.setdefault(bucket, [1.0, 1.0])  # this step's observations join decayed ones
        sums[0], sums[1] = RATIO_MEMORY * sums[0], RATIO_MEMORY * sums[1]
        levels = self._drafted_levels
        for tree in trees:
            model_chances = self.acceptance.path_chances(tree.req_id, tree.features, tree.parents)
            self.remember_offer(tree.req_id, OfferedTree(
                levels, tuple(model_chances), tuple(tree.parents),
                tuple(feature.from_lookup for feature in tree.features), tree.keeps_order),
                self._with_lookup.get(tree.req_id))
            chances = [min(ratio * chance, 1.0) for chance in model_chances]
            if tree.keeps_order:
                ordered.append((tree.tokens, tree.parents, tree.features, running_minimum(chances)))
                continue
            ordered.append(_in_order((tree.tokens, tree.parents, tree.features, chances),
                                     best_first_order(chances, tree.parents)))
        candidates = [Candidates(chances, self.max_nodes, path_length(parents)) for _, parents, _, chances in ordered]
        batch_candidates = candidates + [Candidates([], self.max_nodes)] * (batch - len(trees))  # rows, no node
        counts = choose_nodes(batch_candidates, self.cost.verify_seconds, 0.0, self.cost.verify_floor)[: len(trees)]
        if levels == 0 and self._lookup_held_back:  # the guard holds the lookup paths alone back (plan_depth)
            counts = [0] * len(trees)
        if self._exploring is Exploring.ACCEPTANCE:  # each request's best level_width nodes are verified
            counts = [max(count, min(self.level_width, len(candidate.chances), self.max_nodes))
                      for count, candidate in zip(counts, candidates, strict=True)]
        elif self._exploring is Exploring.DEPTH:  # each request's top path is verified too
            for index, (tree, count) in enumerate(zip(trees, counts, strict=True)):
                if not tree.keeps_order:
                    _, parents, _, chances = ordered[index]
                    order, counts[index] = with_top_path_first(chances, parents, count, self.max_nodes)
                    ordered[index] = _in_order(ordered[index], order)
        elif self._explore.random() * EXPLORE_EVERY < 1:
            counts = best_nodes(candidates, self._explore.randint(0, 2 * sum(counts) + 1))
            self.stats.exploring_steps += 1
        choices = [Choice(tokens, parents, features, chances, count)
                   for (tokens, parents, features, chances), count in zip(ordered, counts, strict=True)]
        for tree, choice in zip(trees, choices, strict=True):
            self._predicted[tree.req_id] = (tuple(choice.chances[: choice.count]), ratio, bucket)
        stats = self.stats
        stats.steps += 1
        stats.lookup_only_steps += levels == 0 and sum(counts) > 0
        if self._cycle is not None:
            self._cycle.nodes = sum(counts)
        stats.requests += batch
        stats.requests_without_nodes += batch - len(choices)  # the batch's requests that offered nothing
        stats.nodes_per_request[0] += batch - len(choices)
        for choice in choices:
            stats.nodes_offered += len(choice.tokens)
            stats.nodes_chosen += choice.count
            stats.requests_without_nodes += choice.count == 0
            stats.nodes_per_request[choice.count] += 1
        stats.controller_seconds += time.perf_counter() - started
        return choices

    # ------------------------------------------------------------------------------------------ after verifying
    def observe(self, req_id: str, features: list[NodeFeatures], parents: list[int], accepted: set[int]) -> None:
        """A verified tree of ``req_id`` (as scheduled): ``accepted`` are the indices of its accepted nodes."""
        started = time.perf_counter()
        self.acceptance.observe(req_id, features, parents, accepted)
        predicted = self._predicted.pop(req_id, None)
        if predicted is not None:
            chances, ratio, bucket = predicted
            scheduled = sum(chances[: len(features)])
            self.stats.predicted_accepted += scheduled
            sums = self._ratio_sums.setdefault(bucket, [1.0, 1.0])
            sums[0] += len(accepted)
            sums[1] += scheduled / ratio
        self.stats.realised_accepted += len(accepted)
        if self._cycle is not None:
            self._cycle.accepted += len(accepted)
        self.stats.controller_seconds += time.perf_counter() - started

    def forget(self, live: set[str]) -> None:
        """Drop the state of requests that are no longer running."""
        self.acceptance.forget(live)
        if self._guard_requests and not self._guard_requests & live:  # all of them finished
            self.guard.forget_drafted()
            self._first_pass_debt = 0.0
        self._guard_requests &= live
        for state in (self.offered, self._predicted, self._with_lookup, self._offers_cache):
            for req_id in [r for r in state if r not in live]:
                del state[req_id]

    def observe_drafting(self, seconds: float, cycle: DecodeCycle | None | object = CURRENT_CYCLE) -> None:
        """The whole drafting stage of the step that :meth:`plan_depth` planned took ``seconds`` (deferring the
        first pass, when nothing was drafted): what it took beyond its forwards keeps the cost model's
        overhead current. ``cycle``: the one it belongs to (:attr:`current_cycle` when it was drafted)."""
        cycle = self._cycle if cycle is CURRENT_CYCLE else cycle
        if cycle is not None:
            cycle.seconds += seconds
            if cycle.drafted and cycle.first_pass_seconds > 0:
                self.cost.observe_overhead(len(cycle.requests),
                                           seconds - cycle.first_pass_seconds - cycle.level_seconds)

    def observe_verify(self, rows: int, seconds: float, masked_rows: int = 0, requests: int | None = None,
                       masked_requests: int = 0, cycle: DecodeCycle | None | object = CURRENT_CYCLE) -> None:
        """A decode-only verify step of ``requests`` requests over ``rows`` rows (``masked_rows`` of them in the
        branching trees of ``masked_requests`` requests) took ``seconds``: it keeps the cost model current and
        closes its decode cycle (``cycle``, default the one the last :meth:`plan_depth` opened)."""
        started = time.perf_counter()
        self.cost.observe_verify(rows, seconds, masked_rows, masked_requests, requests)
        cycle = self._cycle if cycle is CURRENT_CYCLE else cycle
        if cycle is self._cycle:
            self._cycle = None
        self._explore_budget = min(self._explore_budget + EXPLORE_SHARE * seconds, EXPLORE_MOST_STEPS * seconds)
        # the guard weighs cycles that drafted, and apart from them cycles that verified prompt-lookup paths alone
        # (their tokens depend on their requests), against cycles that verified no node
        if cycle is not None and cycle.weighed and requests:
            self._guard_requests |= cycle.requests
            charged = cycle.charged_seconds(seconds)
            if cycle.drafted:  # it repays a share of earlier catch-ups and leaves part of its own to later cycles
                repaid = self._first_pass_debt / cycle.horizon_steps
                self._first_pass_debt += cycle.deferred_seconds - repaid
                charged += repaid
            self.guard.add(cycle.drafted, requests, requests + cycle.accepted, charged,
                           lookup_only=not cycle.drafted and cycle.nodes > 0)
        self.stats.controller_seconds += time.perf_counter() - started

    def observe_draft(self, levels: int, rows_per_level: int, seconds: float,
                      cycle: DecodeCycle | None | object = CURRENT_CYCLE) -> None:
        """The drafter's ``levels`` level forwards of ``rows_per_level`` rows each took ``seconds``."""
        self.cost.observe_draft(levels, rows_per_level, seconds)
        cycle = self._cycle if cycle is CURRENT_CYCLE else cycle
        if cycle is not None:
            cycle.level_seconds += seconds

    def observe_first_pass(self, rows: int, seconds: float, requests: int = 0,
                           cycle: DecodeCycle | None | object = CURRENT_CYCLE) -> None:
        """The drafter's first pass over ``rows`` rows, with the logits of ``requests`` roots, took ``seconds``."""
        self.cost.observe_first_pass(rows, seconds, requests)
        cycle = self._cycle if cycle is CURRENT_CYCLE else cycle
        if cycle is not None:
            cycle.first_pass_seconds += seconds
