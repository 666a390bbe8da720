"""The harness's timers inside each engine worker: drafting time per step for any proposer, vLLM's built-in ones
included, and whole engine steps of any setup, vanilla included.

The plugin's own proposers time themselves. For every other proposer (``EagleProposer``, ``NgramProposer``, a plain
``draft_model``), ``time_drafter`` wraps the ``propose`` bound method of this worker's drafter instance -- it
replaces, on that one instance only, vLLM's ``SpecDecodeBaseProposer.propose`` / ``NgramProposer.propose`` -- so
that every method's drafting time has the same boundary (one ``drafter.propose`` call per engine step).

``time_steps`` times whole engine steps by wrapping the model runner's ``execute_model`` and ``sample_tokens``, and
inside them the target model's forward and logits; with the drafting time read inside the same steps, each step
splits into verify (target forward, sampling, bookkeeping) and drafting. Engines the harness starts pass
``worker_extension_cls=WORKER_EXTENSION_CLS`` (vLLM imports it in every worker: ``benchmarks`` must be importable
there, as it is from the repository root).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_easyspec.instruments.device_clock import DraftingStats
from vllm_easyspec.instruments.worker_extension import EasySpecWorkerExtension, read_drafting_stats

WORKER_EXTENSION_CLS = "benchmarks.harness.step_timers.HarnessWorkerExtension"

_TIMER_ATTRIBUTE = "_easyspec_drafting_timer"


def _self_timed(drafter: Any) -> bool:
    """The plugin's proposers time themselves."""
    return getattr(drafter, "drafting_stats", None) is not None


def time_drafter(worker: Any) -> bool:
    """Worker-side: start timing this rank's drafter; idempotent. False when there is no drafter."""
    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None or _self_timed(drafter):
        return drafter is not None
    if getattr(drafter, _TIMER_ATTRIBUTE, None) is not None:
        return True
    stats = DraftingStats()
    untimed_propose = drafter.propose

    @functools.wraps(untimed_propose)
    def timed_propose(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()  # host time: this instrument waits for the device (below)
        result = untimed_propose(*args, **kwargs)
        tokens = result[0] if isinstance(result, tuple) else result
        if isinstance(tokens, torch.Tensor) and tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        stats.count_step(start, len(tokens) if tokens is not None else 0)
        return result

    drafter.propose = timed_propose
    setattr(drafter, _TIMER_ATTRIBUTE, stats)
    return True


def read_timed_drafting_stats(worker: Any) -> dict[str, Any] | None:
    """Worker-side: the counters of ``time_drafter``, or None when this rank's drafter is not timed by it."""
    drafter = getattr(worker.model_runner, "drafter", None)
    stats: DraftingStats | None = getattr(drafter, _TIMER_ATTRIBUTE, None)
    if stats is None:
        return None
    return stats.as_dict() | {"timed_by": "drafter.propose wrapper"}


# ---- whole engine steps (any setup, vanilla included) ----

_STEP_TIMER_ATTRIBUTE = "_easyspec_step_timer"
_STEP_CLOCK_ATTRIBUTE = "_easyspec_step_clock"


@dataclass
class StepStats:
    """Cumulative engine-step counters of one worker: a step is one ``execute_model`` call that scheduled
    tokens plus the ``sample_tokens`` call that follows it (the drafter's ``propose`` runs inside the latter).

    ``drafting_seconds`` is the drafter's own timer read at the start and end of each step, so
    ``step_seconds - drafting_seconds`` is the verify (target forward + sampling + bookkeeping) time of exactly
    these steps. The ``decode_*`` counters repeat the three for steps in which no request computes prompt
    tokens (every scheduled request runs 1 + its scheduled draft tokens).
    """

    steps: int = 0
    step_seconds: float = 0.0
    drafting_seconds: float = 0.0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    decode_drafting_seconds: float = 0.0
    # time inside execute_model alone (inputs, attention metadata, the target forward, logits)
    forward_seconds: float = 0.0
    decode_forward_seconds: float = 0.0


STEP_LOG_LENGTH = 100_000  # the newest engine steps kept in a timed worker's step log


@dataclass(frozen=True)
class StepRecord:
    """One engine step of a timed worker: its requests, the draft tokens scheduled for verification (tree
    nodes or chain drafts) and how many requests had any, whether it was decode-only, and its seconds: the whole
    step, ``execute_model`` alone (the forward), the target model's own forward and logits inside it (the
    runner's ``_model_forward`` and ``model.compute_logits``: the same work for the same rows whatever the setup
    does around it), and the drafting stage."""

    requests: int
    draft_tokens: int
    requests_with_drafts: int
    decode: bool
    seconds: float
    forward_seconds: float
    model_seconds: float
    drafting_seconds: float


def _scheduled_drafts(scheduler_output: Any) -> tuple[int, int, int]:
    """(requests, draft tokens, requests with drafts) that a step schedules."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    counts = [len(drafts.get(req_id, ())) for req_id in scheduled]
    return len(scheduled), sum(counts), sum(count > 0 for count in counts)


def _cumulative_drafting_seconds(runner: Any) -> float:
    """The drafter's running total: ``time_drafter``'s wrapper, else the plugin drafter's own counters."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        return 0.0
    stats = getattr(drafter, _TIMER_ATTRIBUTE, None)
    if stats is None and _self_timed(drafter):
        stats = drafter.drafting_stats.settled()  # the step timer has waited for the device anyway
    return stats.drafting_seconds if stats is not None else 0.0


def _is_decode_only(scheduler_output: Any) -> bool:
    if getattr(scheduler_output, "scheduled_new_reqs", None):
        return False
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    return all(n == 1 + len(drafts.get(req_id, ())) for req_id, n in scheduled.items())


class _StepClock:
    """One open step at a time: ``execute_model`` opens it, ``sample_tokens`` (or an ``execute_model`` that
    already returned its output) closes it. Time spent in either call is the step's time."""

    def __init__(self, runner: Any, stats: StepStats) -> None:
        self.runner = runner
        self.stats = stats
        self.log: deque[StepRecord] = deque(maxlen=STEP_LOG_LENGTH)
        self.scheduled = (0, 0, 0)
        self.open = False
        self.counted = False
        self.decode = False
        self.seconds = 0.0
        self.forward_seconds = 0.0
        self.model_seconds = 0.0
        self.drafting_at_start = 0.0

    def begin(self, scheduler_output: Any) -> None:
        self.open = True
        self.counted = getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0
        self.decode = self.counted and _is_decode_only(scheduler_output)
        self.scheduled = _scheduled_drafts(scheduler_output)
        self.seconds = 0.0
        self.forward_seconds = 0.0
        self.model_seconds = 0.0
        self.drafting_at_start = _cumulative_drafting_seconds(self.runner)

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        if not self.counted:
            return
        drafting = _cumulative_drafting_seconds(self.runner) - self.drafting_at_start
        stats = self.stats
        stats.steps += 1
        stats.step_seconds += self.seconds
        stats.drafting_seconds += drafting
        stats.forward_seconds += self.forward_seconds
        self.log.append(StepRecord(*self.scheduled, self.decode, self.seconds, self.forward_seconds,
                                   self.model_seconds, drafting))
        if self.decode:
            stats.decode_steps += 1
            stats.decode_step_seconds += self.seconds
            stats.decode_drafting_seconds += drafting
            stats.decode_forward_seconds += self.forward_seconds


def _synchronize(runner: Any) -> None:
    device = getattr(runner, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(worker: Any) -> bool:
    """Worker-side: start timing this rank's engine steps; idempotent. Wraps, on this worker's model-runner
    instance only, its ``execute_model`` and ``sample_tokens`` bound methods; arguments, results and
    exceptions pass through unchanged. On a CUDA device each call ends with ``torch.cuda.synchronize`` so
    that the wall time covers the kernels (this serialises async scheduling, as ``time_drafter`` does)."""
    runner = worker.model_runner
    if getattr(runner, _STEP_TIMER_ATTRIBUTE, None) is not None:
        return True
    stats = StepStats()
    clock = _StepClock(runner, stats)
    untimed_execute_model = runner.execute_model
    untimed_sample_tokens = runner.sample_tokens

    # Replaces vLLM's GPUModelRunner.execute_model (CPUModelRunner inherits it) on this instance: the target
    # forward of one engine step; it returns None when sample_tokens is to follow in the same step.
    @functools.wraps(untimed_execute_model)
    def timed_execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        clock.close()  # a step whose sample_tokens never came (not expected) ends here
        clock.begin(scheduler_output)
        start = time.perf_counter()
        try:
            result = untimed_execute_model(scheduler_output, *args, **kwargs)
            _synchronize(runner)
        finally:
            elapsed = time.perf_counter() - start
            clock.seconds += elapsed
            clock.forward_seconds += elapsed
        if result is not None:
            clock.close()  # the step ended here (nothing to sample, or an intermediate pipeline rank)
        return result

    # Replaces vLLM's GPUModelRunner.sample_tokens on this instance: sampling, bookkeeping and the
    # drafter's propose of the step that execute_model opened.
    @functools.wraps(untimed_sample_tokens)
    def timed_sample_tokens(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            result = untimed_sample_tokens(*args, **kwargs)
            _synchronize(runner)
        finally:
            clock.seconds += time.perf_counter() - start
            clock.close()
        return result

    runner.execute_model = timed_execute_model
    runner.sample_tokens = timed_sample_tokens
    _time_target_model(runner, clock)
    setattr(runner, _STEP_TIMER_ATTRIBUTE, stats)
    setattr(runner, _STEP_CLOCK_ATTRIBUTE, clock)
    return True


def _time_target_model(runner: Any, clock: _StepClock) -> None:
    """Adds to the open step's ``model_seconds`` the time in the target model's forward (vLLM's
    ``GPUModelRunner._model_forward``, replaced on this runner instance) and logits (``compute_logits`` of the
    runner's model instance); the drafter's own model is not counted. Runners without them are left alone."""
    model = getattr(runner, "model", None)
    for owner, name in ((runner, "_model_forward"), (model, "compute_logits")):
        untimed = getattr(owner, name, None) if owner is not None else None
        if untimed is None:
            continue

        def timed(*args: Any, _untimed: Any = untimed, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = _untimed(*args, **kwargs)
                _synchronize(runner)
            finally:
                if clock.open:
                    clock.model_seconds += time.perf_counter() - start
            return result

        setattr(owner, name, functools.wraps(untimed)(timed))


def read_step_stats(worker: Any) -> dict[str, Any] | None:
    """Worker-side: the counters of ``time_steps`` (cumulative), or None when this rank is not timed."""
    stats: StepStats | None = getattr(worker.model_runner, _STEP_TIMER_ATTRIBUTE, None)
    return None if stats is None else asdict(stats)


def take_step_log(worker: Any) -> list[dict[str, Any]] | None:
    """Worker-side: the steps timed since the last call (at most :data:`STEP_LOG_LENGTH`, the newest), oldest
    first, and an empty log after it; None when this rank is not timed."""
    clock: _StepClock | None = getattr(worker.model_runner, _STEP_CLOCK_ATTRIBUTE, None)
    if clock is None:
        return None
    records = [asdict(record) for record in clock.log]
    clock.log.clear()
    return records


class HarnessWorkerExtension(EasySpecWorkerExtension):
    """The plugin's worker extension plus the harness's timers, as ``LLM.collective_rpc`` names."""

    def easyspec_drafting_stats(self) -> dict[str, Any] | None:
        """This rank's drafting counters: the plugin drafter's own, else those of ``easyspec_time_drafter``."""
        return read_drafting_stats(self) or read_timed_drafting_stats(self)

    def easyspec_time_drafter(self) -> bool:
        """Time every ``drafter.propose`` call of this rank, whatever the speculative method."""
        return time_drafter(self)

    def easyspec_time_steps(self) -> bool:
        """Time every engine step (``execute_model`` + ``sample_tokens``) of this rank; idempotent."""
        return time_steps(self)

    def easyspec_step_stats(self) -> dict[str, Any] | None:
        """This rank's cumulative step counters from ``easyspec_time_steps``, or None when not timed."""
        return read_step_stats(self)

    def easyspec_take_step_log(self) -> list[dict[str, Any]] | None:
        """This rank's engine steps timed since the last call, one record each (``StepRecord``), and an empty
        log after it; None when not timed."""
        return take_step_log(self)
