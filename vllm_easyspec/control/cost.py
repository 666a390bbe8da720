"""What a step costs: measured curves of the target's verify forward and of one draft level against the rows
they run, kept current by the engine's own step timings (docs/design.md, "Cost model": the scale, the four
extras and the drafting scales fitted there).

Invariants: a :class:`CostCurve` goes through its measured points and extrapolates linearly past its last
point, and its floor (the lower envelope) is non-decreasing and never above it; the fitted scale is positive
and no extra cost is negative (an extra the fit would make negative is left out of it); each drafting
prediction (first pass, level) is the draft curve times a scale, an exponential moving average of observed
over predicted seconds.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PARTS = ("verify", "draft", "first_pass", "overhead")  # the parts of a step the model predicts and observes
VERIFY_HISTORY = 64  # decode steps the verify fit reads
PRIOR_WEIGHT = 0.05  # how strongly the fit is pulled towards scale 1 and no extra cost per row
CALIBRATION_REPEATS = 3  # start-up: timed forwards per row count, the fastest kept
CALIBRATION_SECONDS_PER_POINT = 0.5  # ... which stop once they took this long; row counts stop at the first
# whose forward took this long
RECHECK_ROWS = 8  # row counts re-timed in a second, descending pass: where small GEMM shapes are irregular and a
# forward is cheap (larger ones cost linearly more, and a second pass over them would double the start-up)


@dataclass(frozen=True)
class CostCurve:
    """Seconds as a piecewise-linear function of rows through measured points (rows ascending), and its
    floor: the same through the lower envelope of the points (each the least time at its rows or more), which
    is non-decreasing and never above the curve, so ``floor(rows)`` bounds the curve at every larger row count.

    The curve keeps what was measured, not the envelope: some GEMM shapes are slower than larger ones, and a
    choice priced by the envelope would take exactly such a row count. One slow row count raises only its own
    price."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    floor_seconds: tuple[float, ...] = ()  # the lower envelope at ``rows`` (empty: computed from ``seconds``)

    def __post_init__(self) -> None:
        if not self.floor_seconds:
            envelope: list[float] = []
            for value in reversed(self.seconds):
                envelope.append(min(value, envelope[-1]) if envelope else value)
            object.__setattr__(self, "floor_seconds", tuple(reversed(envelope)))

    @classmethod
    def from_measurements(cls, rows: Sequence[int], seconds: Sequence[float]) -> CostCurve:
        """The curve through ``(rows, seconds)``, sorted by rows."""
        if not rows or len(rows) != len(seconds):
            raise ValueError(f"need one time per row count; got {len(rows)} row counts and {len(seconds)} times")
        ordered = sorted(zip(rows, seconds, strict=True))
        return cls(tuple(r for r, _ in ordered), tuple(value for _, value in ordered))

    def __call__(self, rows: float) -> float:
        """Past the last point, the floor's last segment (a dip before it must not be extended downwards)."""
        return _interpolate(self.rows, self.seconds if rows <= self.rows[-1] else self.floor_seconds, rows)

    def floor(self, rows: float) -> float:
        """The least the curve costs at ``rows`` rows or more."""
        return _interpolate(self.rows, self.floor_seconds, rows)

    def per_extra_row(self, rows: int) -> float:
        """Seconds that one more row adds at ``rows`` rows."""
        return self(rows + 1) - self(rows)

    def describe(self, unit: float = 1e3) -> str:
        return ", ".join(f"{r}: {s * unit:.1f}" for r, s in zip(self.rows, self.seconds, strict=True))


@dataclass(frozen=True)
class ForwardTimings:
    """Start-up timings of one model's forward by rows (ascending): with the logits of every row, and without."""

    rows: list[int]
    with_logits: list[float]
    without_logits: list[float]


def time_forwards(rows: Sequence[int], forward: Callable[[int], tuple[float, float]]) -> ForwardTimings:
    """Times ``forward(count)`` (one forward over ``count`` rows; returns its seconds with and without the
    logits) at each row count of ``rows`` (ascending), the fastest of :data:`CALIBRATION_REPEATS` after an
    untimed one; the counts up to :data:`RECHECK_ROWS` are re-timed descending (a machine still settling after
    start-up slows the first counts of an ascending pass)."""
    fastest: dict[int, tuple[float, float]] = {}
    for count in rows:
        forward(count)  # the first forward at a row count is not timed
        best, timed = (float("inf"), float("inf")), 0.0
        for _ in range(CALIBRATION_REPEATS):
            seconds = forward(count)
            best, timed = min(best, seconds), timed + seconds[0]
            if timed >= CALIBRATION_SECONDS_PER_POINT:
                break
        fastest[count] = best
        if best[0] >= CALIBRATION_SECONDS_PER_POINT:
            break
    for count in reversed([count for count in fastest if count <= RECHECK_ROWS]):
        fastest[count] = min(fastest[count], forward(count))
    measured = list(fastest)
    return ForwardTimings(measured, [fastest[count][0] for count in measured],
                          [fastest[count][1] for count in measured])


def _speculating_rows(rows: int, requests: int | None) -> int:
    """The rows of a step that verifies any node (more rows than requests), else 0 (None: a plain step)."""
    return rows if requests is not None and rows > requests else 0


@dataclass
class StepCostModel:
    """A decode step's cost: the target's verify forward over all rows of the batch, plus, when the step drafts,
    the drafter's first pass and its level forwards (each over ``rows`` rows)."""

    verify: CostCurve
    draft_level: CostCurve  # one draft forward with the logits of every row
    draft_forward: CostCurve | None = None  # ... without logits (None: with them, as draft_level)
    smoothing: float = 0.1  # weight of the newest observation in the draft scale
    verify_scale: float = 1.0
    extra_per_row: float = 0.0  # verify seconds per row that the bare forwards do not show
    extra_per_masked_row: float = 0.0  # ... and per row of a tree that needs masked attention (not a path)
    extra_per_masked_request: float = 0.0  # ... and per request whose tree needs it
    extra_per_speculating_row: float = 0.0  # ... and per row of a step that verifies any node
    draft_scale: float = 1.0
    first_pass_scale: float = 1.0
    overhead_per_request: float = 0.0  # a drafting stage's seconds beyond its forwards, per request
    observations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    # Per part, the seconds the model predicted for each observed step (before learning from it) and the
    # seconds the step took: their ratio is the model's one-step-ahead error.
    predicted_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    observed_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    # (the verify curve at its rows, rows, masked rows, masked requests, rows if speculating else 0, seconds)
    _verify_steps: deque = field(default_factory=lambda: deque(maxlen=VERIFY_HISTORY))
    # over those steps, with x the first five: sum of x x^T, of x * seconds, of seconds^2 (the fit's normal
    # equations, kept as steps come and go, and summed afresh every VERIFY_HISTORY steps against rounding drift)
    _verify_sums: tuple[list[list[float]], list[float], float] = field(
        default_factory=lambda: ([[0.0] * 5 for _ in range(5)], [0.0] * 5, 0.0))
    _verify_steps_seen: int = 0
    _verify_extras: tuple[int, ...] = (1, 2, 3, 4)  # the extras free in the last fit (indices into the five)

    def verify_seconds(self, rows: int, masked_rows: int = 0, masked_requests: int = 0,
                       requests: int | None = None) -> float:
        """The verify of ``rows`` rows of ``requests`` requests (None: one row each, no node), ``masked_rows``
        of them in the trees of ``masked_requests`` requests that need masked attention."""
        return (self.verify_scale * self.verify(rows) + self.extra_per_row * rows
                + self.extra_per_masked_row * masked_rows + self.extra_per_masked_request * masked_requests
                + self.extra_per_speculating_row * _speculating_rows(rows, requests))

    def verify_floor(self, rows: int, masked_rows: int = 0, masked_requests: int = 0,
                     requests: int | None = None) -> float:
        """A bound on :meth:`verify_seconds` at these counts or more of each (the extras grow with them)."""
        return (self.verify_scale * self.verify.floor(rows) + self.extra_per_row * rows
                + self.extra_per_masked_row * masked_rows + self.extra_per_masked_request * masked_requests
                + self.extra_per_speculating_row * _speculating_rows(rows, requests))

    def draft_seconds(self, levels: int, rows_per_level: int) -> float:
        return self.draft_scale * levels * self.draft_level(rows_per_level) if levels > 0 else 0.0

    def first_pass_seconds(self, rows: int, requests: int = 0) -> float:
        """The drafter's first pass over ``rows`` rows (the verified tokens and any deferred ones) and the logits
        of ``requests`` roots."""
        return self.first_pass_scale * self._first_pass_curve(rows, requests) if rows > 0 else 0.0

    def overhead_seconds(self, requests: int) -> float:
        """A drafting stage's host work beyond its forwards for ``requests`` requests."""
        return self.overhead_per_request * requests

    def _first_pass_curve(self, rows: int, requests: int) -> float:
        if self.draft_forward is None:
            return self.draft_level(rows)
        logits = max(self.draft_level(requests) - self.draft_forward(requests), 0.0) if requests > 0 else 0.0
        return self.draft_forward(rows) + logits

    def observe_verify(self, rows: int, seconds: float, masked_rows: int = 0, masked_requests: int = 0,
                       requests: int | None = None) -> None:
        """An engine step's verify (target forward and sampling), counted as :meth:`verify_seconds`, took
        ``seconds``."""
        if rows > 0 and seconds > 0:
            self._count("verify", self.verify_seconds(rows, masked_rows, masked_requests, requests), seconds)
            self._add_verify_step((self.verify(rows), rows, masked_rows, masked_requests,
                                   _speculating_rows(rows, requests), seconds))
            self._fit_verify()

    def _add_verify_step(self, step: tuple[float, ...]) -> None:
        """``step`` joins the recent steps (the oldest leaves once there are :data:`VERIFY_HISTORY`), and their
        sums; every :data:`VERIFY_HISTORY` steps the sums are taken afresh, so rounding never accumulates."""
        gram, moment, seconds_squared = self._verify_sums
        if len(self._verify_steps) == self._verify_steps.maxlen:
            seconds_squared = _add_products(gram, moment, seconds_squared, self._verify_steps[0], -1.0)
        self._verify_steps.append(step)
        self._verify_steps_seen += 1
        if self._verify_steps_seen % VERIFY_HISTORY == 0:
            gram, moment, seconds_squared = [[0.0] * 5 for _ in range(5)], [0.0] * 5, 0.0
            for kept in self._verify_steps:
                seconds_squared = _add_products(gram, moment, seconds_squared, kept, 1.0)
        else:
            seconds_squared = _add_products(gram, moment, seconds_squared, step, 1.0)
        self._verify_sums = (gram, moment, seconds_squared)

    def _fit_verify(self) -> None:
        """``scale`` and the four extras by least squares over the recent steps, each weakly pulled towards
        (1, 0, 0, 0, 0), which keeps them determined when every step had the same rows; of the fits whose
        extras are not negative (some extras left out), the one closest to the steps. Each fit solves its
        block of the regularised normal equations (at most 5 x 5, plain Python: cheaper than numpy here)."""
        products, moment, seconds_squared = self._verify_sums
        squares = [products[i][i] for i in range(5)]
        if squares[0] <= 0:  # a curve of zeros has no scale to fit
            return
        gram = [[products[i][j] + (PRIOR_WEIGHT * squares[i] if i == j else 0.0) for j in range(5)]
                for i in range(5)]
        target = [moment[0] + PRIOR_WEIGHT * squares[0], *moment[1:]]  # the pull towards scale 1
        constant = seconds_squared + PRIOR_WEIGHT * squares[0]
        present = [extra for extra in (1, 2, 3, 4) if squares[extra] > 0]

        def fit(extras: tuple[int, ...]) -> tuple[float, list[float], tuple[int, ...]] | None:
            """(loss, coefficients, extras) of the fit with only ``extras`` free, or None if one is negative."""
            free = [0, *extras]
            solved = _solve_positive_definite([[gram[i][j] for j in free] for i in free], [target[i] for i in free])
            if any(value < 0 for value in solved[1:]):
                return None
            coefficients = [0.0] * 5
            for value, i in zip(solved, free, strict=True):
                coefficients[i] = value
            # the loss is |design c - seconds|^2 plus the pull: c' G c - 2 c' t + constant, and G c = t here
            return constant - sum(value * target[i] for value, i in zip(solved, free, strict=True)), coefficients, extras

        # the last step's extras first: if that fit is feasible and letting any other extra in would not lower the
        # loss (its gradient, 2 (G c - t), is not negative), it is the optimum of this convex problem
        best = fit(tuple(extra for extra in self._verify_extras if extra in present))
        if best is None or any(sum(gram[j][k] * best[1][k] for k in range(5)) < target[j]
                               for j in present if j not in best[2]):
            best = None
            for extras in itertools.chain.from_iterable(itertools.combinations(present, k)
                                                        for k in range(len(present), -1, -1)):
                fitted = fit(extras)
                if fitted is not None and (best is None or fitted[0] < best[0]):
                    best = fitted
                if fitted is not None and len(extras) == len(present):  # no restriction of it fits closer
                    break
        self._verify_extras = best[2]
        scale, per_row, per_masked_row, per_masked_request, per_speculating_row = best[1]  # scale-only qualifies
        self.verify_scale = max(scale, 0.05)
        self.extra_per_row, self.extra_per_masked_row = per_row, per_masked_row
        self.extra_per_masked_request, self.extra_per_speculating_row = per_masked_request, per_speculating_row

    def observe_draft(self, levels: int, rows_per_level: int, seconds: float) -> None:
        """A drafting step's ``levels`` level forwards over ``rows_per_level`` rows took ``seconds``."""
        predicted = levels * self.draft_level(rows_per_level)
        if levels > 0 and predicted > 0 and seconds > 0:
            self._count("draft", self.draft_scale * predicted, seconds)
            self.draft_scale = self._blend(self.draft_scale, seconds / predicted)

    def observe_first_pass(self, rows: int, seconds: float, requests: int = 0) -> None:
        """A first pass over ``rows`` rows, with the logits of ``requests`` roots, took ``seconds``."""
        predicted = self._first_pass_curve(rows, requests)
        if rows > 0 and predicted > 0 and seconds > 0:
            self._count("first_pass", self.first_pass_scale * predicted, seconds)
            self.first_pass_scale = self._blend(self.first_pass_scale, seconds / predicted)

    def observe_overhead(self, requests: int, seconds: float) -> None:
        """A drafting stage for ``requests`` requests took ``seconds`` beyond its first pass and levels."""
        if requests > 0:
            self._count("overhead", self.overhead_seconds(requests), max(seconds, 0.0))
            self.overhead_per_request = self._blend(self.overhead_per_request, max(seconds, 0.0) / requests)

    def _count(self, part: str, predicted: float, observed: float) -> None:
        self.observations[part] += 1
        self.predicted_seconds[part] += predicted
        self.observed_seconds[part] += observed

    def _blend(self, scale: float, ratio: float) -> float:
        return (1 - self.smoothing) * scale + self.smoothing * ratio

    def describe(self) -> str:
        """One log line: the current verify and draft-level curves in ms by rows."""
        return (f"verify ms by rows {{{self.verify.describe()}}} x{self.verify_scale:.2f} "
                f"+ {self.extra_per_row * 1e3:.2f} ms per row + {self.extra_per_masked_row * 1e3:.2f} ms per "
                f"masked tree row + {self.extra_per_masked_request * 1e3:.2f} ms per masked tree + "
                f"{self.extra_per_speculating_row * 1e3:.2f} ms per row of a step with nodes; "
                f"draft level ms by rows {{{self.draft_level.describe()}}} x{self.draft_scale:.2f}"
                + ("" if self.draft_forward is None else
                   f", without logits {{{self.draft_forward.describe()}}}")
                + f" (first pass x{self.first_pass_scale:.2f}); drafting host work "
                f"{self.overhead_per_request * 1e3:.2f} ms per request")


def _add_products(gram: list[list[float]], moment: list[float], seconds_squared: float, step: Sequence[float],
                  sign: float) -> float:
    """Adds (``sign`` 1) or removes (-1) one step ``(x0..x4, seconds)`` to ``gram`` (sum of x x^T) and ``moment``
    (sum of x * seconds) in place; returns the sum of seconds^2 so changed."""
    *x, seconds = step
    for i in range(5):
        if x[i]:
            row, weighted = gram[i], sign * x[i]
            for j in range(5):
                row[j] += weighted * x[j]
            moment[i] += weighted * seconds
    return seconds_squared + sign * seconds * seconds


def _solve_positive_definite(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """``matrix^-1 vector`` for a small symmetric positive definite ``matrix``, by Cholesky decomposition."""
    size = len(vector)
    lower = [[0.0] * size for _ in range(size)]
    for i in range(size):
        for j in range(i + 1):
            total = matrix[i][j] - sum(lower[i][k] * lower[j][k] for k in range(j))
            lower[i][j] = total ** 0.5 if i == j else total / lower[j][j]
    forward = [0.0] * size
    for i in range(size):
        forward[i] = (vector[i] - sum(lower[i][k] * forward[k] for k in range(i))) / lower[i][i]
    solution = [0.0] * size
    for i in reversed(range(size)):
        solution[i] = (forward[i] - sum(lower[k][i] * solution[k] for k in range(i + 1, size))) / lower[i][i]
    return solution


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], rows: float) -> float:
    """Piecewise-linear through ``(xs, ys)``, the first value before them, the last segment extended past them."""
    if len(xs) == 1:
        return ys[0]
    index = min(max(bisect.bisect_right(xs, rows), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
    return max(y0 + slope * (rows - x0), 0.0) if rows >= xs[0] else ys[0]
