"""Pinning the ``tree.auto`` controller's cost model in tests whose assertions need trees verified."""

from __future__ import annotations


def drafting_costs_nothing(worker) -> bool:
    """Worker-side: the controller's drafting (first pass and levels) becomes nearly free and stays so, while
    the verify cost is still measured and kept current by the engine's steps. A tiny draft costs about what its
    tiny target does, so on a quiet machine the controller rightly drafts little; tests that need nodes
    verified and the verify model observed pin this. The outcome guard, which would see the real drafting cost,
    never holds a step back."""
    from vllm_easyspec.control.cost import CostCurve

    controller = worker.model_runner.tree_verifier.policy.controller
    cost = controller.cost
    cost.draft_level = CostCurve.from_measurements([1], [1e-5])
    cost.draft_forward = None
    cost.draft_scale = cost.first_pass_scale = 1.0
    controller.observe_draft = lambda *arguments, **keywords: None
    controller.observe_first_pass = lambda *arguments, **keywords: None
    controller.guard.holds_back = lambda requests, plain_seconds: False
    return True


def steps_cost_nothing(worker) -> bool:
    """Worker-side: as :func:`drafting_costs_nothing`, and the verify cost flat and fixed too (a tiny model's
    timings are noise, and these tests need deep trees verified: to see a bias, or nodes accepted at several
    depths); everything else about the controller runs as usual."""
    from vllm_easyspec.control.cost import CostCurve

    drafting_costs_nothing(worker)
    controller = worker.model_runner.tree_verifier.policy.controller
    cost = controller.cost
    cost.verify = CostCurve.from_measurements([1], [0.01])
    cost.verify_scale, cost.extra_per_row, cost.extra_per_masked_row = 1.0, 0.0, 0.0
    cost.extra_per_masked_request = cost.extra_per_speculating_row = 0.0
    controller.observe_verify = lambda *arguments, **keywords: None
    return True


def only_prompt_lookup_pays(worker) -> bool:
    """Worker-side: as :func:`steps_cost_nothing` for the verify (rows free), with drafting dearer than any step
    can repay or explore: every step drafts nothing and verifies the requests' prompt-lookup paths alone."""
    from vllm_easyspec.control.cost import CostCurve

    steps_cost_nothing(worker)
    cost = worker.model_runner.tree_verifier.policy.controller.cost
    cost.draft_level = CostCurve.from_measurements([1], [1000.0])
    return True
