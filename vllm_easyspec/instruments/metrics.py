"""Speculative-decoding acceptance figures as vLLM defines them, read from ``LLM.get_metrics()``.

Invariants: mean acceptance length = 1 + accepted / drafts (vLLM's ``SpecDecodingLogging``);
per-position acceptance = accepted at position i / drafts. vLLM's counters are cumulative, so a figure for
one workload is the difference of two snapshots.

Token trees report through the same counters: a tree step is one draft whose draft tokens are its nodes,
its accepted tokens are the accepted branch, and position i is depth i + 1 (a step that accepts a branch of
depth d counts at positions 0..d-1). So nodes verified per step is ``num_draft_tokens / num_drafts``, and
the acceptance rate ``accepted / draft tokens`` is per node, lower than a chain's for the same branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SpecDecodeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_metrics(cls, metrics: list[Any]) -> SpecDecodeCounters:
        """Sum vLLM's ``vllm:spec_decode_*`` counters (over engines, if several) into one snapshot."""
        totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        per_position: list[int] = []
        for metric in metrics:
            short = metric.name.removeprefix("vllm:spec_decode_")
            if short in totals:
                totals[short] += int(metric.value)
            elif short == "num_accepted_tokens_per_pos":
                values = [int(v) for v in metric.values]
                per_position.extend([0] * (len(values) - len(per_position)))
                for index, value in enumerate(values):
                    per_position[index] += value
        return cls(**totals, accepted_per_position=tuple(per_position))

    def __sub__(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        width = max(len(self.accepted_per_position), len(earlier.accepted_per_position))
        now = list(self.accepted_per_position) + [0] * (width - len(self.accepted_per_position))
        before = list(earlier.accepted_per_position) + [0] * (width - len(earlier.accepted_per_position))
        return SpecDecodeCounters(
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(now, before)),
        )

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def nodes_per_step(self) -> float | None:
        """Draft tokens verified per speculative step: k for a chain, the (scheduled) node count for a tree."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def per_position_acceptance(self) -> list[float]:
        if not self.num_drafts:
            return []
        return [accepted / self.num_drafts for accepted in self.accepted_per_position]


def read_spec_decode_counters(llm: Any) -> SpecDecodeCounters:
    """Snapshot of an ``LLM``'s counters; the engine must be built with ``disable_log_stats=False``.

    vLLM reads these from the process-wide Prometheus registry, and each new engine unregisters the
    collectors of the engines built before it: in a process with several engines, only the newest one's
    counters are readable."""
    return SpecDecodeCounters.from_metrics(llm.get_metrics())
