"""The controller's figures on their way to vLLM's metrics (``integration/metrics.py``): the worker's snapshot,
read back by the front end's collector, parsed by vLLM's own ``get_metrics()`` reader and written in the
Prometheus text format that ``/metrics`` serves. The engine-level check is in ``tests/tree/test_engine_auto.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest  # noqa: E402
from vllm.v1.metrics.reader import Counter, Gauge, Histogram, get_metrics_snapshot  # noqa: E402

from vllm_easyspec.control.acceptance import NodeFeatures  # noqa: E402
from vllm_easyspec.control.controller import RequestTree, SpeculationController  # noqa: E402
from vllm_easyspec.control.cost import CostCurve, StepCostModel  # noqa: E402
from vllm_easyspec.integration import metrics  # noqa: E402


@pytest.fixture
def controller() -> SpeculationController:
    cost = StepCostModel(CostCurve.from_measurements([1, 8, 32], [0.010, 0.011, 0.020]),
                         CostCurve.from_measurements([1, 8], [0.004, 0.005]))
    controller = SpeculationController(cost, max_depth=3, max_nodes=4, level_width=2)
    for _ in range(20):
        trees = [RequestTree(f"r{i}", [5, 6, 7], [-1, 0, 1],
                             [NodeFeatures(False, d, -0.1 * (i + 1)) for d in (1, 2, 3)], keeps_order=False)
                 for i in range(3)]
        for tree, choice in zip(trees, controller.choose(trees), strict=True):
            accepted = {0, 1} if tree.req_id != "r2" else set()
            controller.observe(tree.req_id, choice.features[: choice.count], choice.parents[: choice.count],
                               {i for i in accepted if i < choice.count})
        controller.plan_depth(["r0", "r1", "r2"], first_pass_rows=3)
    controller.cost.observe_overhead(3, 0.006)  # a drafting stage's host work: 2 ms per request, learnt at 0.1
    return controller


@pytest.fixture
def published(controller, tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "snapshot_directory", lambda: tmp_path)
    metrics.ControllerPublisher(controller, "abcde").publish()
    collector = metrics.ControllerMetricsCollector()
    collector.watch("abcde", "target")
    return collector


def test_vllms_reader_sees_the_controllers_counters_histograms_and_curves(controller, published):
    REGISTRY.register(published)
    try:
        snapshot = {(m.name, tuple(sorted(m.labels.items()))): m for m in get_metrics_snapshot()}
    finally:
        REGISTRY.unregister(published)
    stats = controller.stats
    model = (("model_name", "target"),)
    assert snapshot["vllm:easyspec_auto_steps", model].value == stats.steps == 20
    assert isinstance(snapshot["vllm:easyspec_auto_steps", model], Counter)
    assert snapshot["vllm:easyspec_auto_request_steps", model].value == stats.requests == 60
    assert snapshot["vllm:easyspec_auto_nodes_chosen", model].value == stats.nodes_chosen
    assert snapshot["vllm:easyspec_auto_realised_accepted", model].value == stats.realised_accepted
    histogram = snapshot["vllm:easyspec_auto_nodes_per_request", model]
    assert isinstance(histogram, Histogram)
    assert histogram.count == stats.requests and histogram.sum == stats.nodes_chosen
    assert histogram.buckets[str(float(controller.max_nodes))] == stats.requests
    assert histogram.buckets["0.0"] == stats.nodes_per_request[0]
    depth = snapshot["vllm:easyspec_auto_draft_depth", model]
    assert depth.count == sum(stats.depth_per_step.values()) == 20
    for rows in controller.cost.verify.rows:
        gauge = snapshot["vllm:easyspec_auto_verify_seconds", (("model_name", "target"), ("rows", str(rows)))]
        assert isinstance(gauge, Gauge) and gauge.value == pytest.approx(controller.cost.verify_seconds(rows))
    observed = [m for (name, _), m in snapshot.items() if name == "vllm:easyspec_auto_calibration_observed"]
    assert observed and {m.labels["table"] for m in observed} == {"conditional", "path"}
    assert snapshot["vllm:easyspec_auto_realised_over_predicted", model].value == pytest.approx(
        controller.realised_over_predicted)
    assert snapshot["vllm:easyspec_auto_drafting_host_seconds_per_request", model].value == pytest.approx(
        controller.cost.overhead_seconds(1)) and controller.cost.overhead_seconds(1) > 0


def test_the_prometheus_text_of_metrics_names_them_and_a_missing_snapshot_yields_nothing(published, tmp_path):
    registry = CollectorRegistry()
    registry.register(published)
    text = generate_latest(registry).decode()
    assert 'vllm:easyspec_auto_nodes_per_request_bucket{le="+Inf",model_name="target"} 60.0' in text
    assert "vllm:easyspec_auto_controller_seconds_total" in text
    (tmp_path / "abcde.json").unlink()
    assert generate_latest(registry).decode() == ""
