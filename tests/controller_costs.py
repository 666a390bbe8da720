"""Pinning the ``tree.auto`` controller's cost model in tests whose assertions need trees verified.

Each function runs worker-side (``llm.collective_rpc``) and swaps the controller's public ``cost`` and ``guard``
for ones built here: a cost model whose pinned parts do not learn from the engine's timings, and a guard that
never holds a step back. Everything else about the controller runs as usual."""

from __future__ import annotations

import dataclasses
import math

from vllm_easyspec.control.controller import OutcomeGuard, SpeculationController
from vllm_easyspec.control.cost import CostCurve, StepCostModel


class FreeDrafting(StepCostModel):
    """Drafting (first pass, levels and host overhead) nearly free, and it stays so; the verify is still learnt."""

    def observe_draft(self, levels: int, rows_per_level: int, seconds: float) -> None:
        pass

    def observe_first_pass(self, rows: int, seconds: float, requests: int = 0) -> None:
        pass

    def observe_overhead(self, requests: int, seconds: float) -> None:
        pass  # a drafting stage's host time: on a loaded machine it alone can make every tree look dear


class FreeSteps(FreeDrafting):
    """As :class:`FreeDrafting`, and the verify flat and fixed too."""

    def observe_verify(self, rows: int, seconds: float, masked_rows: int = 0, masked_requests: int = 0,
                       requests: int | None = None) -> None:
        pass


def _controller(worker) -> SpeculationController:
    return worker.model_runner.tree_verifier.policy.controller


def _pin(controller: SpeculationController, model: type[StepCostModel], **parts) -> None:
    cost = controller.cost
    fields = {field.name: getattr(cost, field.name) for field in dataclasses.fields(cost)}
    controller.cost = model(**(fields | parts))
    controller.guard = OutcomeGuard(standard_errors=math.inf)  # would see the real drafting cost: never holds back


def drafting_costs_nothing(worker) -> bool:
    """Worker-side: the controller's drafting becomes nearly free and stays so, while the verify cost is still
    measured and kept current by the engine's steps. A tiny draft costs about what its tiny target does, so on a
    quiet machine the controller rightly drafts little; tests that need nodes verified and the verify model
    observed pin this."""
    _pin(_controller(worker), FreeDrafting, draft_level=CostCurve.from_measurements([1], [1e-5]),
         draft_forward=None, draft_scale=1.0, first_pass_scale=1.0, overhead_per_request=0.0)
    return True


def steps_cost_nothing(worker) -> bool:
    """Worker-side: as :func:`drafting_costs_nothing`, and the verify cost flat and fixed too (a tiny model's
    timings are noise, and these tests need deep trees verified: to see a bias, or nodes accepted at several
    depths)."""
    _pin(_controller(worker), FreeSteps, draft_level=CostCurve.from_measurements([1], [1e-5]),
         draft_forward=None, draft_scale=1.0, first_pass_scale=1.0, overhead_per_request=0.0,
         verify=CostCurve.from_measurements([1], [0.01]), verify_scale=1.0, extra_per_row=0.0,
         extra_per_masked_row=0.0, extra_per_masked_request=0.0, extra_per_speculating_row=0.0)
    return True


def only_prompt_lookup_pays(worker) -> bool:
    """Worker-side: as :func:`steps_cost_nothing` for the verify (rows free), with drafting dearer than any step
    can repay or explore: every step drafts nothing and verifies the requests' prompt-lookup paths alone."""
    steps_cost_nothing(worker)
    _controller(worker).cost.draft_level = CostCurve.from_measurements([1], [1000.0])
    return True
