"""A worker extension (``worker_extension_cls``) that lets the front end read the plugin's per-worker counters
through ``LLM.collective_rpc("easyspec_drafting_stats")`` (and ``easyspec_tree_stats``,
``easyspec_controller_stats``) without sending code to workers. The ``read_*`` functions take a vLLM worker;
tests also send them to workers directly (``LLM.collective_rpc(read_tree_stats)``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

WORKER_EXTENSION_CLS = "vllm_easyspec.instruments.worker_extension.EasySpecWorkerExtension"


def read_drafting_stats(worker) -> dict[str, Any] | None:
    """This rank's drafting counters of the plugin's proposer, or None when it drafts with vLLM's own."""
    drafter = getattr(worker.model_runner, "drafter", None)
    stats = getattr(drafter, "drafting_stats", None)
    if stats is None:
        return None
    result: dict[str, Any] = stats.settled().as_dict()  # an instrument read: waits for pending timings
    calibration = getattr(drafter, "calibration", None)
    if calibration is not None:
        result["exact_first_forwards"] = calibration.exact_first_forwards
        result["fuzzy_first_forwards"] = calibration.fuzzy_first_forwards
    controller = getattr(drafter, "fuzzy_controller", None)
    if controller is not None:
        counts = controller.counts
        result |= {
            "exact_forwards": counts.exact,
            "fuzzy_forwards": counts.fuzzy,
            "fused_group_calls": counts.fused_groups,
            "parallel_group_calls": counts.parallel_groups,
        }
    grouping = getattr(drafter, "layer_grouping", None)
    if grouping is not None:
        result["mode"] = grouping.mode
        result["groups"] = [list(g) for g in grouping.groups]
    return result


def read_tree_stats(worker) -> dict[str, int] | None:
    """This rank's token-tree counters (:class:`~vllm_easyspec.integration.tree_step.TreeStats`), or None
    without trees."""
    verifier = getattr(worker.model_runner, "tree_verifier", None)
    return None if verifier is None else asdict(verifier.stats)


def read_controller_stats(worker) -> dict[str, Any] | None:
    """This rank's ``easyspec.tree.auto`` controller: its counters (chosen nodes per request, drafted depth per
    step, predicted against realised accepted tokens, its own seconds), the measured cost curves with their
    current scales, and the acceptance model's calibration tables; None without the controller."""
    verifier = getattr(worker.model_runner, "tree_verifier", None)
    controller = None if verifier is None else verifier.policy.controller
    if controller is None:
        return None
    stats = asdict(controller.stats)
    stats["nodes_per_request"] = dict(sorted(controller.stats.nodes_per_request.items()))
    stats["depth_per_step"] = dict(sorted(controller.stats.depth_per_step.items()))
    cost = controller.cost
    stats["realised_over_predicted"] = controller.realised_over_predicted
    return stats | {
        "verify_curve": {"rows": list(cost.verify.rows), "seconds": list(cost.verify.seconds),
                         "scale": cost.verify_scale, "extra_per_row": cost.extra_per_row,
                         "extra_per_masked_row": cost.extra_per_masked_row,
                         "extra_per_masked_request": cost.extra_per_masked_request,
                         "extra_per_speculating_row": cost.extra_per_speculating_row},
        "draft_level_curve": {"rows": list(cost.draft_level.rows), "seconds": list(cost.draft_level.seconds),
                              "scale": cost.draft_scale},
        "draft_forward_curve": None if cost.draft_forward is None else {
            "rows": list(cost.draft_forward.rows), "seconds": list(cost.draft_forward.seconds),
            "scale": cost.first_pass_scale},
        "cost_observations": dict(cost.observations),
        # one-step-ahead: what the model predicted for each observed step, and what the steps took
        "cost_predicted_seconds": dict(cost.predicted_seconds),
        "cost_observed_seconds": dict(cost.observed_seconds),
        "calibration_conditional": controller.acceptance.conditional.table(),
        "calibration_path": controller.acceptance.path.table(),
        "outcome_guard": controller.guard.table(),
    }


class EasySpecWorkerExtension:
    def easyspec_drafting_stats(self) -> dict[str, Any] | None:
        """This rank's drafting counters of the plugin's proposer (:func:`read_drafting_stats`)."""
        return read_drafting_stats(self)

    def easyspec_tree_stats(self) -> dict[str, int] | None:
        """This rank's token-tree counters (steps, tree requests, nodes verified, accepted, fallbacks)."""
        return read_tree_stats(self)

    def easyspec_controller_stats(self) -> dict[str, Any] | None:
        """This rank's ``easyspec.tree.auto`` controller (:func:`read_controller_stats`)."""
        return read_controller_stats(self)
