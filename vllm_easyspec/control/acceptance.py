"""How likely a drafted node is to be accepted, predicted before verification and calibrated by what verification
then accepts (docs/design.md, "Self-tuning speculation"). A node is *tested* when its parent was accepted; the
model predicts ``P(accepted | tested)`` from its source (drafted or prompt lookup), depth, binned draft
log-probability given its parent (a bin of its own when unknown) and the request's recent acceptance, each bin
Beta-smoothed around its pooled bin's rate, itself smoothed around a prior. A node's chance of being accepted is
the product of the conditional chances along its path: it never exceeds its parent's.

Invariant: predictions depend only on the node's features and on earlier verification outcomes, never on the
verification they are used for, so choosing nodes by them keeps speculation lossless.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# upper edges of the draft log-probability bins (natural log)
LOGPROB_EDGES = (-6.0, -4.0, -3.0, -2.0, -1.0, -0.5, -0.2, -0.05)
RECENT_EDGES = (0.25, 0.5, 0.75)  # recent-acceptance bins; one more bin for "no history yet"
MAX_DEPTH_BIN = 3
LOOKUP_PRIOR = 0.3  # a prompt-lookup path's first node's acceptance before any observation
# ... and a deeper lookup node's, given its parent was accepted: a copy that has started right mostly goes on
# (measured: 0.58-0.88 over chat, held-out and edit prompts with the EAGLE head, most near 0.8)
LOOKUP_CONTINUATION_PRIOR = 0.75
UNKNOWN_PRIOR = 0.3  # a drafted node's acceptance before any observation, its draft probability unknown
PRIOR_WEIGHT = 4.0  # pseudo-observations behind every prior
RECENT_SMOOTHING = 0.2  # weight of a step's outcomes in a request's recent acceptance
CALIBRATION_BINS = 10


@dataclass(frozen=True)
class NodeFeatures:
    """What the drafter knows of a node before verification."""

    from_lookup: bool
    depth: int  # 1 for children of the root
    draft_logprob: float | None  # log q(token | parent) under the draft; None for lookup and unknown

    def key(self, recent_bin: int) -> tuple[bool, int, int, int]:
        return *self.pooled_key(), recent_bin

    def pooled_key(self) -> tuple[bool, int, int]:
        """The bin of :meth:`key` pooled over recent acceptance."""
        return self.from_lookup, min(self.depth, MAX_DEPTH_BIN), self.logprob_bin()

    def logprob_bin(self) -> int:
        if self.from_lookup or self.draft_logprob is None:
            return len(LOGPROB_EDGES) + 1
        return bisect.bisect_left(LOGPROB_EDGES, self.draft_logprob)

    def prior(self) -> float:
        if self.from_lookup:
            return LOOKUP_PRIOR if self.depth == 1 else LOOKUP_CONTINUATION_PRIOR
        if self.draft_logprob is None:
            return UNKNOWN_PRIOR
        return min(max(math.exp(self.draft_logprob), 0.01), 0.99)


@dataclass
class _Bin:
    accepted: float = 0.0
    tested: float = 0.0


@dataclass
class Calibration:
    """Predicted against observed acceptance of nodes, by bins of the prediction."""

    predicted_sum: list[float] = field(default_factory=lambda: [0.0] * CALIBRATION_BINS)
    accepted: list[int] = field(default_factory=lambda: [0] * CALIBRATION_BINS)
    count: list[int] = field(default_factory=lambda: [0] * CALIBRATION_BINS)

    def add(self, predicted: float, accepted: bool) -> None:
        index = min(int(predicted * CALIBRATION_BINS), CALIBRATION_BINS - 1)
        self.predicted_sum[index] += predicted
        self.accepted[index] += accepted
        self.count[index] += 1

    def table(self) -> list[dict[str, float]]:
        """One row per non-empty bin: its range, nodes, mean predicted and observed acceptance."""
        return [
            {"low": i / CALIBRATION_BINS, "high": (i + 1) / CALIBRATION_BINS, "nodes": n,
             "predicted": self.predicted_sum[i] / n, "observed": self.accepted[i] / n}
            for i, n in enumerate(self.count) if n
        ]


@dataclass
class AcceptanceModel:
    """Conditional acceptance by feature bin, with each request's recent acceptance (module docstring)."""

    bins: dict[tuple, _Bin] = field(default_factory=dict)
    pooled: dict[tuple, _Bin] = field(default_factory=dict)  # the same counts by NodeFeatures.pooled_key
    recent: dict[str, float] = field(default_factory=dict)  # request id -> moving acceptance of tested nodes
    conditional: Calibration = field(default_factory=Calibration)  # P(accepted | tested) predictions
    path: Calibration = field(default_factory=Calibration)  # P(accepted) predictions of every offered node
    _lookup_paths: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (recent bin, length) -> chances
    # (features, recent bin) -> conditional chance, until the next observation changes the counts
    _conditional: dict[tuple[NodeFeatures, int], float] = field(default_factory=dict)

    def recent_bin(self, req_id: str) -> int:
        rate = self.recent.get(req_id)
        return len(RECENT_EDGES) + 1 if rate is None else bisect.bisect_right(RECENT_EDGES, rate)

    def conditional_chance(self, features: NodeFeatures, recent_bin: int) -> float:
        key = (features, recent_bin)
        chance = self._conditional.get(key)
        if chance is None:
            chance = features.prior()
            pooled_key = features.pooled_key()
            for counts in (self.pooled.get(pooled_key), self.bins.get((*pooled_key, recent_bin))):
                if counts is not None:
                    chance = (PRIOR_WEIGHT * chance + counts.accepted) / (PRIOR_WEIGHT + counts.tested)
            self._conditional[key] = chance
        return chance

    def path_chances(self, req_id: str, nodes: list[NodeFeatures], parents: list[int]) -> list[float]:
        """``P(accepted)`` of each node of one request's tree (parents come first)."""
        recent_bin = self.recent_bin(req_id)
        chances: list[float] = []
        for features, parent in zip(nodes, parents, strict=True):
            own = self.conditional_chance(features, recent_bin)
            chances.append(own * (chances[parent] if parent >= 0 else 1.0))
        return chances

    def lookup_path_chances(self, req_id: str, length: int) -> list[float]:
        """``P(accepted)`` of each node of a prompt-lookup path of ``length`` nodes offered by ``req_id`` (which
        depends on the request through its recent-acceptance bin only: kept per bin until the next
        observation)."""
        key = (self.recent_bin(req_id), length)
        chances = self._lookup_paths.get(key)
        if chances is None:
            nodes = [NodeFeatures(True, depth, None) for depth in range(1, length + 1)]
            chances = self._lookup_paths[key] = self.path_chances(req_id, nodes, list(range(-1, length - 1)))
        return chances

    def observe(self, req_id: str, nodes: list[NodeFeatures], parents: list[int], accepted: set[int]) -> None:
        """Verification of one request's scheduled tree: ``accepted`` holds the indices of its accepted nodes."""
        recent_bin = self.recent_bin(req_id)
        path_before = self.path_chances(req_id, nodes, parents)
        conditional_before = [self.conditional_chance(features, recent_bin) for features in nodes]
        self._lookup_paths.clear()
        self._conditional.clear()
        tested = accepted_here = 0
        for index, (features, parent) in enumerate(zip(nodes, parents, strict=True)):
            was_accepted = index in accepted
            self.path.add(path_before[index], was_accepted)
            if parent >= 0 and parent not in accepted:
                continue  # never tested: its parent was rejected
            self.conditional.add(conditional_before[index], was_accepted)
            for counts in (self.bins.setdefault(features.key(recent_bin), _Bin()),
                           self.pooled.setdefault(features.pooled_key(), _Bin())):
                counts.tested += 1
                counts.accepted += was_accepted
            tested += 1
            accepted_here += was_accepted
        if tested:
            rate = accepted_here / tested
            previous = self.recent.get(req_id)
            self.recent[req_id] = rate if previous is None else (
                (1 - RECENT_SMOOTHING) * previous + RECENT_SMOOTHING * rate)

    def forget(self, live: set[str]) -> None:
        """Drop the recent acceptance of requests that are no longer running."""
        for req_id in [r for r in self.recent if r not in live]:
            del self.recent[req_id]
