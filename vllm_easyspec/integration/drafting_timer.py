"""Drafting-stage time per step for any proposer, vLLM's built-in ones included.

The plugin's own drafter (``EasySpecDraftProposer`` with an ``easyspec`` config) times itself. For every
other proposer (``EagleProposer``, ``NgramProposer``, a plain ``draft_model``), ``time_drafter`` wraps the
``propose`` bound method of this worker's drafter instance -- it replaces, on that one instance only,
vLLM's ``SpecDecodeBaseProposer.propose`` / ``NgramProposer.propose`` -- so that benchmarks report
drafting time at the same boundary (one ``drafter.propose`` call per engine step) for every method.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict
from typing import Any

import torch

from vllm_easyspec.integration.draft_proposer import DraftingStats, EasySpecDraftProposer

_TIMER_ATTRIBUTE = "_easyspec_drafting_timer"


def _self_timed(drafter: Any) -> bool:
    return isinstance(drafter, EasySpecDraftProposer) and drafter.easyspec_config is not None


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
        start = time.perf_counter()
        result = untimed_propose(*args, **kwargs)
        tokens = result[0] if isinstance(result, tuple) else result
        if isinstance(tokens, torch.Tensor) and tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        stats.drafting_seconds += time.perf_counter() - start
        stats.steps += 1
        stats.drafted_requests += len(tokens) if tokens is not None else 0
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
    return asdict(stats) | {"seconds_per_step": stats.seconds_per_step, "timed_by": "drafter.propose wrapper"}
