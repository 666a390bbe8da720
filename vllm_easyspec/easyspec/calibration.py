"""Bonus calibration: which draft forward of a speculation step runs exact. The first draft forward of a step runs
over the tokens verified in the step and rewrites their draft KV; run exact, it overwrites every fuzzy KV entry
that survived verification; the later forwards of the step run fuzzy.

Invariants:
- a forward that carries prompt tokens (a prefill or a chunk of one) is always exact;
- ``every_round``: the first forward is always exact;
- ``on_mismatch``: the first forward is exact unless every draft of every request in the batch was accepted;
- ``never``: the first forward of a decode step is fuzzy (ablation);
- every forward after the first is fuzzy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

CalibrationPolicy = Literal["every_round", "on_mismatch", "never"]


def first_forward_is_exact(
    policy: CalibrationPolicy, *, has_prompt_tokens: bool, all_drafts_accepted: bool | Callable[[], bool]
) -> bool:
    """Whether the first draft forward of a step runs exact under ``policy``; ``all_drafts_accepted`` may be a
    function, called only where the policy decides by it (on a GPU it reads the device)."""
    if has_prompt_tokens or policy == "every_round":
        return True
    if policy == "on_mismatch":
        return not (all_drafts_accepted() if callable(all_drafts_accepted) else all_drafts_accepted)
    if policy == "never":
        return False
    raise ValueError(f"unknown calibration policy {policy!r}; use every_round, on_mismatch or never")


@dataclass
class CalibrationSchedule:
    """Per-step state machine: :meth:`start_step` decides the first forward, :meth:`next_forward_exact`
    answers once per forward of the step (True at most once, for the first)."""

    policy: CalibrationPolicy
    exact_first_forwards: int = 0
    fuzzy_first_forwards: int = 0
    _first_pending: bool = False
    _first_exact: bool = False

    def start_step(self, *, has_prompt_tokens: bool, all_drafts_accepted: bool | Callable[[], bool]) -> bool:
        exact = first_forward_is_exact(
            self.policy, has_prompt_tokens=has_prompt_tokens, all_drafts_accepted=all_drafts_accepted
        )
        self._first_pending = True
        self._first_exact = exact
        if exact:
            self.exact_first_forwards += 1
        else:
            self.fuzzy_first_forwards += 1
        return exact

    def next_forward_exact(self) -> bool:
        """Consume one forward of the step: the first answers the step's decision, later ones fuzzy.

        Forwards outside a step (warm-up dummy runs) are fuzzy.
        """
        if self._first_pending:
            self._first_pending = False
            return self._first_exact
        return False
