"""Choosing how much each request speculates in one step, to maximise the batch's expected tokens per second:
for chosen nodes ``S`` the step's rate is ``(B + sum of P(v accepted) over S) / (verify(B + |S|, masked rows, B)
+ draft)``. :func:`choose_depth` runs before drafting (how deep to draft, if at all, against drafting nothing and
verifying the prompt-lookup paths alone), :func:`choose_nodes` after it (the batch's most likely nodes, one at a
time, at the count with the best rate); :func:`best_first_order` puts a request's likeliest nodes first.

Invariant: the chosen nodes of a request are closed under taking parents (chances never increase along a path).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidates:
    """One request's candidate nodes, best first (parents before children), with their ``P(accepted)``,
    which never increases along the order."""

    chances: list[float]
    cap: int  # the most nodes this request may verify
    path_length: int | None = None  # how many first nodes are one path from the root (None: all of them)

    def masked_rows(self, count: int) -> int:
        """Rows needing masked tree attention when this request verifies its first ``count`` nodes: none for a
        path, else all ``1 + count``."""
        return 0 if self.path_length is None or count <= self.path_length else 1 + count


def path_length(parents: Sequence[int]) -> int:
    """How many first nodes of a tree (parents first) are one path from the root (``parents[j] == j - 1``)."""
    for index, parent in enumerate(parents):
        if parent != index - 1:
            return index
    return len(parents)


def node_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1 for children of the root) in a tree whose parents come first."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def best_first_order(chances: Sequence[float], parents: Sequence[int]) -> list[int]:
    """Node indices by decreasing chance, ties by depth, then by index: a topological order (a child's chance
    never exceeds its parent's, and at a tie the parent is shallower)."""
    depth = node_depths(parents)
    return sorted(range(len(chances)), key=lambda i: (-chances[i], depth[i], i))


def renumbered_parents(parents: Sequence[int], order: Sequence[int]) -> list[int]:
    """The parents of the nodes ``order`` picks (each node's parent picked before it), as positions in
    ``order``; -1 for a root child."""
    position = {node: rank for rank, node in enumerate(order)}
    return [position[parents[i]] if parents[i] >= 0 else -1 for i in order]


def with_top_path_first(chances: Sequence[float], parents: Sequence[int], count: int,
                        cap: int) -> tuple[list[int], int]:
    """A best-first tree (parents first, its first ``count`` nodes chosen) reordered to start with its most likely
    path from the root (the likeliest child at each depth, down to a leaf), then the chosen nodes off that path,
    then the rest; and how many first nodes the path and the chosen nodes make, at most ``cap``. The order stays
    topological, so any first nodes of it are closed under parents."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path: list[int] = []
    node = -1
    while node in children:
        node = max(children[node], key=lambda child: chances[child])  # ties: the earlier node
        path.append(node)
    on_path = set(path)
    chosen = [node for node in range(count) if node not in on_path]
    rest = [node for node in range(count, len(parents)) if node not in on_path]
    return path + chosen + rest, min(len(path) + len(chosen), cap)


def running_minimum(values: Sequence[float]) -> list[float]:
    """Each value lowered to the smallest before it: a fixed order's chances made non-increasing."""
    out: list[float] = []
    for value in values:
        out.append(min(value, out[-1]) if out else value)
    return out


def _offered(candidates: Sequence[Candidates]) -> Iterator[tuple[float, int, int]]:
    """(-chance, request, rank) of every node the requests may verify, most likely first (ties: by request),
    each found when asked for: a heap holds each request's next node (its own nodes are already best first),
    so a caller that stops after a few nodes of a large batch does not order the rest."""
    heap = [(-c.chances[0], request, 0) for request, c in enumerate(candidates) if c.chances and c.cap > 0]
    heapq.heapify(heap)
    while heap:
        node = heap[0]
        yield node
        _, request, rank = node
        c = candidates[request]
        if rank + 1 < min(len(c.chances), c.cap):
            heapq.heapreplace(heap, (-c.chances[rank + 1], request, rank + 1))
        else:
            heapq.heappop(heap)


def best_nodes(candidates: Sequence[Candidates], total: int) -> list[int]:
    """How many of its candidates each request verifies when the batch verifies its ``total`` most likely."""
    chosen = [0] * len(candidates)
    for _, request, _ in itertools.islice(_offered(candidates), max(total, 0)):
        chosen[request] += 1
    return chosen


# (rows, rows needing masked tree attention, requests whose trees need it, requests) -> seconds (a step of more
# rows than requests verifies nodes); its floor, where one is given, is non-decreasing in each of the first three
VerifySeconds = Callable[[int, int, int, int], float]
TIE = 1e-12  # relative: rates closer than this are taken as equal when deciding that no later count can win


def _best_total(candidates: Sequence[Candidates], verify_seconds: VerifySeconds, other_seconds: float,
                to_beat: float = 0.0, verify_floor: VerifySeconds | None = None) -> tuple[int, float, float]:
    """(count, rate, gain): the number of the batch's most likely nodes, at least one, with the best predicted
    rate ``(B + gain) / (verify(B + count, masked rows, masked requests, B) + other_seconds)`` (the first such
    count), and the expected accepted nodes among them; (0, 0.0, 0.0) when no node is offered. Counts only
    grow as nodes are added, so once every node's gain over this count's ``verify_floor`` cannot beat the best
    rate, or ``to_beat``, the walk stops: where the best rate is below ``to_beat``, the count returned is not
    necessarily the best."""
    batch = len(candidates)
    most_gain = sum(sum(c.chances[: c.cap]) for c in candidates)
    chosen = [0] * batch
    best_count, best_rate, best_gain, gain, masked, masked_requests = 0, 0.0, 0.0, 0.0, 0, 0
    for count, (negative_chance, request, _) in enumerate(_offered(candidates), start=1):
        gain -= negative_chance
        c = candidates[request]
        before, after = c.masked_rows(chosen[request]), c.masked_rows(chosen[request] + 1)
        masked += after - before
        masked_requests += (after > 0) - (before > 0)
        chosen[request] += 1
        seconds = verify_seconds(batch + count, masked, masked_requests, batch) + other_seconds
        rate = (batch + gain) / seconds
        if rate > best_rate:
            best_count, best_rate, best_gain = count, rate, gain
        floor = seconds if verify_floor is None else (
            verify_floor(batch + count, masked, masked_requests, batch) + other_seconds)
        if (batch + most_gain) * (1 + TIE) < max(best_rate, to_beat) * floor:
            break
    return best_count, best_rate, best_gain


def choose_nodes(candidates: Sequence[Candidates], verify_seconds: VerifySeconds,
                 other_seconds: float, verify_floor: VerifySeconds | None = None) -> list[int]:
    """How many of its candidates each request verifies (module docstring). ``verify_seconds``: see
    :data:`VerifySeconds` (``verify_floor``: a bound on it at those counts or more; None: it never falls as
    they grow); ``other_seconds``: the rest of the step, whatever is chosen (drafting already spent)."""
    batch = len(candidates)
    count, rate, _ = _best_total(candidates, verify_seconds, other_seconds, verify_floor=verify_floor)
    if rate <= batch / (verify_seconds(batch, 0, 0, batch) + other_seconds):
        count = 0
    return best_nodes(candidates, count)


@dataclass(frozen=True)
class DepthPlan:
    """How deep to draft (0: not at all), and how many nodes the batch is then expected to verify (without
    drafting: prompt-lookup nodes only)."""

    depth: int
    nodes: int


@dataclass(frozen=True)
class OfferedTree:
    """The candidate nodes one request offered in a step that drafted ``levels`` levels (parents first): each
    node's chance of being accepted as the acceptance model predicted it, and whether it came from prompt lookup
    (which needs no level forward)."""

    levels: int
    chances: tuple[float, ...]
    parents: tuple[int, ...]
    from_lookup: tuple[bool, ...]
    keeps_order: bool = False  # i.i.d. children: verified as a prefix of their order

    def by_depth(self, cap: int) -> list[Candidates]:
        """What drafting 1, 2, ..., :attr:`levels` levels would have offered: every lookup node and the drafted
        nodes no deeper (closed under parents), best first as the choice after drafting orders them (i.i.d.
        children: in their order, chances made non-increasing), at most ``cap``."""
        depths = node_depths(self.parents)
        order = range(len(self.parents)) if self.keeps_order else best_first_order(self.chances, self.parents)
        offers: list[Candidates] = []
        for levels in range(1, self.levels + 1):
            is_kept = [False] * len(self.parents)
            for i, parent in enumerate(self.parents):
                is_kept[i] = (self.from_lookup[i] or depths[i] <= levels) and (parent < 0 or is_kept[parent])
            picked = [i for i in order if is_kept[i]][:cap]  # a topological order keeps one on its subtree
            chances = [self.chances[i] for i in picked]
            if self.keeps_order:
                chances = running_minimum(chances)
            offers.append(Candidates(chances, cap, path_length(renumbered_parents(self.parents, picked))))
        return offers


@dataclass
class AveragedOffer:
    """A moving average of what drafting one depth offered, over the trees offered at least that deep: the chance
    of the k-th best node (0 where a tree offered fewer), as the acceptance model predicted it then. The plan
    prices drafting that deep again by it: one tree offered at an unsure moment moves it by its weight only.

    Invariant: the chances never increase along the order (an average of non-increasing sequences)."""

    chances: list[float]
    path_length: int | None  # of the newest tree's offer: how many first nodes are one path

    @classmethod
    def of(cls, offer: Candidates) -> AveragedOffer:
        return cls(list(offer.chances), offer.path_length)

    def add(self, offer: Candidates, weight: float) -> None:
        """Moves the average ``weight`` of the way to ``offer``; nodes below :data:`NEGLIGIBLE_CHANCE` drop."""
        size = max(len(self.chances), len(offer.chances))
        old = self.chances + [0.0] * (size - len(self.chances))
        new = list(offer.chances) + [0.0] * (size - len(offer.chances))
        averaged = [(1 - weight) * a + weight * b for a, b in zip(old, new, strict=True)]
        while averaged and averaged[-1] < NEGLIGIBLE_CHANCE:
            averaged.pop()
        self.chances, self.path_length = averaged, offer.path_length

    def candidates(self, ratio: float, cap: int) -> Candidates:
        """The average as a request's candidates: chances times ``ratio`` (at most 1), at most ``cap``."""
        return Candidates([min(ratio * chance, 1.0) for chance in self.chances[:cap]], cap, self.path_length)


def at_least(offer: Candidates, shallower: Candidates) -> Candidates:
    """``offer`` with each k-th best chance raised to ``shallower``'s k-th where that is higher (and its nodes
    extended to as many): what drafting deeper offers, which holds every node drafting less deep offers."""
    longer = max(len(offer.chances), len(shallower.chances))
    own = list(offer.chances) + [0.0] * (longer - len(offer.chances))
    floor = list(shallower.chances) + [0.0] * (longer - len(shallower.chances))
    chances = [max(a, b) for a, b in zip(own, floor, strict=True)]
    if chances == list(offer.chances):
        return offer
    return Candidates(chances, offer.cap, offer.path_length)


NEGLIGIBLE_CHANCE = 1e-3  # an averaged node less likely than this is not worth keeping


@dataclass(frozen=True)
class DepthRate:
    """What :func:`choose_depth` predicted for one option: ``depth`` levels (0: no drafting, the prompt-lookup
    paths alone), the batch's best ``nodes`` at that depth, their expected accepted ``gain`` and the step's
    ``rate`` (tokens per second)."""

    depth: int
    nodes: int
    gain: float
    rate: float


def choose_depth(candidates_by_depth: Sequence[Sequence[Candidates]], verify_seconds: VerifySeconds,
                 draft_seconds: Callable[[int], float], without_drafting: Sequence[Candidates] | None = None,
                 record: list[DepthRate] | None = None,
                 verify_floor: VerifySeconds | None = None) -> DepthPlan:
    """The drafting depth with the best predicted rate, or depth 0 when no depth beats drafting nothing.
    ``candidates_by_depth[d - 1][i]``: the nodes request ``i`` would offer when the step drafts ``d`` levels
    (its prompt-lookup nodes at every depth); ``verify_seconds`` / ``verify_floor`` as in :func:`choose_nodes`;
    ``draft_seconds(depth)``: drafting that deep (first pass included); ``without_drafting[i]``: the nodes
    request ``i`` offers with no drafting at all (its prompt-lookup path; None: none).

    A depth is judged by the nodes :func:`choose_nodes`'s rule would then verify. A depth that offers the same
    nodes as the one before it is not priced unless ``record`` is given, which receives every option's
    :class:`DepthRate` (drafting nothing first; the prompt-lookup paths alone next, both as depth 0)."""
    batch = len(candidates_by_depth[0]) if candidates_by_depth else 0
    if batch == 0:
        return DepthPlan(0, 0)
    verify_seconds = functools.cache(verify_seconds)  # every depth prices the same row counts
    if verify_floor is not None:
        verify_floor = functools.cache(verify_floor)
    best, best_rate = DepthPlan(0, 0), batch / verify_seconds(batch, 0, 0, batch)
    if record is not None:
        record.append(DepthRate(0, 0, 0.0, best_rate))
    if without_drafting is not None:
        count, rate, gain = _best_total(without_drafting, verify_seconds, 0.0, verify_floor=verify_floor)
        if record is not None:
            record.append(DepthRate(0, count, gain, rate))
        if count and rate > best_rate:
            best, best_rate = DepthPlan(0, count), rate
    shallower: Sequence[Candidates] | None = None
    for depth, candidates in enumerate(candidates_by_depth, start=1):
        if record is None and candidates == shallower:  # the same nodes, dearer to draft: a lower rate
            continue
        shallower = candidates
        # only a rate above the best so far matters, unless every option's own best is recorded
        count, rate, gain = _best_total(candidates, verify_seconds, draft_seconds(depth),
                                        0.0 if record is not None else best_rate, verify_floor)
        if record is not None:
            record.append(DepthRate(depth, count, gain, rate))
        if count and rate > best_rate * (1 + 1e-9):
            best, best_rate = DepthPlan(depth, count), rate
    return best
