"""Pinning the ``tree.auto`` controller's cost model in tests whose assertions need trees verified."""

from __future__ import annotations


def steps_cost_nothing(worker) -> bool:
    """Worker-side: the controller's verify cost becomes flat and its drafting (first pass and levels) nearly
    free, and both stay so (a tiny model's timings are noise, and these tests need deep trees verified: to see a
    bias, or nodes accepted at several depths); everything else about the controller runs as usual."""
    from vllm_easyspec.control.cost import CostCurve

    controller = worker.model_runner.tree_verifier.controller
    cost = controller.cost
    cost.verify = CostCurve.from_measurements([1], [0.01])
    cost.verify_scale, cost.extra_per_row = 1.0, 0.0
    cost.draft_level = CostCurve.from_measurements([1], [1e-5])
    cost.draft_scale = cost.first_pass_scale = 1.0
    controller.observe_verify = lambda rows, seconds: None
    controller.observe_draft = lambda levels, rows_per_level, seconds: None
    controller.observe_first_pass = lambda rows, seconds: None
    return True
