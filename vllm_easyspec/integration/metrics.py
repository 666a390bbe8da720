"""vLLM's metrics seam for ``easyspec.tree.auto``: the controller's figures in ``LLM.get_metrics()`` and in the
server's ``/metrics``, and a summary line in the engine's log (docs/design.md lists the metrics).

The worker of tensor-parallel rank 0 publishes its controller's state after every engine step as a small JSON
file, replaced atomically (:class:`ControllerPublisher`), under ``/dev/shm/vllm-easyspec-metrics-$UID/`` (else the
temporary directory), named by vLLM's ``instance_id``; one collector per front-end process
(:class:`ControllerMetricsCollector`) turns the newest engine's file into metrics when the registry is read, and
the front end removes its engine's file when it exits. With several API server processes vLLM serves
``/metrics`` from its multiprocess registry, which does not include these.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_easyspec.control.controller import SpeculationController
from vllm_easyspec.integration.compat import plugin_logger

logger = plugin_logger(__name__)

LOG_INTERVAL_SECONDS = 10.0  # as vLLM's own periodic stats line
PREFIX = "vllm:easyspec_auto_"
COUNTERS = ("steps", "requests", "nodes_offered", "nodes_chosen", "requests_without_nodes", "exploring_steps",
            "exploring_drafts", "steps_without_drafting", "steps_held_back", "lookup_only_steps",
            "lookup_steps_held_back", "predicted_accepted", "realised_accepted", "controller_seconds")
COUNTER_NAMES = {"requests": "request_steps"}  # a request verified in one step


def snapshot_directory() -> Path:
    """In shared memory where there is some (a snapshot written there costs ~0.02 ms, on disk ~0.2 ms)."""
    shared = Path("/dev/shm")
    base = shared if shared.is_dir() and os.access(shared, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"vllm-easyspec-metrics-{os.getuid()}"


def snapshot_path(instance_id: str) -> Path:
    return snapshot_directory() / f"{instance_id}.json"


def controller_snapshot(controller: SpeculationController) -> dict[str, Any]:
    """The controller's counters, histograms, cost curves (as used now: scaled, with the per-row extra) and
    calibration tables, as plain JSON values."""
    stats = controller.stats
    cost = controller.cost
    return {
        "counters": {name: getattr(stats, name) for name in COUNTERS},
        "nodes_per_request": {str(k): v for k, v in sorted(stats.nodes_per_request.items())},
        "depth_per_step": {str(k): v for k, v in sorted(stats.depth_per_step.items())},
        "max_nodes": controller.max_nodes,
        "max_depth": controller.max_depth,
        "realised_over_predicted": controller.realised_over_predicted,
        "verify_seconds": {str(r): cost.verify_seconds(r) for r in cost.verify.rows},
        "draft_level_seconds": {str(r): cost.draft_scale * s
                                for r, s in zip(cost.draft_level.rows, cost.draft_level.seconds, strict=True)},
        "drafting_host_seconds_per_request": cost.overhead_per_request,
        "calibration": {"conditional": controller.acceptance.conditional.table(),
                        "path": controller.acceptance.path.table()},
    }


class ControllerPublisher:
    """Worker side: after each engine step, the controller's snapshot to its file, and every
    :data:`LOG_INTERVAL_SECONDS` one summary line in the log."""

    def __init__(self, controller: SpeculationController, instance_id: str) -> None:
        self.controller = controller
        self.path = snapshot_path(instance_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
        self._logged_at = time.monotonic()
        self._logged_stats = asdict(controller.stats)

    def publish(self) -> None:
        started = time.perf_counter()
        self._scratch.write_text(json.dumps(controller_snapshot(self.controller)))
        os.replace(self._scratch, self.path)
        if time.monotonic() - self._logged_at >= LOG_INTERVAL_SECONDS:
            self._log_summary()
        self.controller.stats.controller_seconds += time.perf_counter() - started

    def _log_summary(self) -> None:
        now, before = asdict(self.controller.stats), self._logged_stats
        steps = now["steps"] - before["steps"]
        requests = now["requests"] - before["requests"]
        if steps and requests:
            chosen = now["nodes_chosen"] - before["nodes_chosen"]
            logger.info(
                "easyspec.tree.auto: %d steps, %.2f nodes per request (none for %.0f%%), accepted %.2f per "
                "request predicted, %.2f realised; controller %.2f ms per step",
                steps, chosen / requests,
                100 * (now["requests_without_nodes"] - before["requests_without_nodes"]) / requests,
                (now["predicted_accepted"] - before["predicted_accepted"]) / requests,
                (now["realised_accepted"] - before["realised_accepted"]) / requests,
                1e3 * (now["controller_seconds"] - before["controller_seconds"]) / steps)
        self._logged_at, self._logged_stats = time.monotonic(), now


class ControllerMetricsCollector:
    """Front-end side: a Prometheus collector over the newest engine's snapshot (vLLM's ``get_metrics()`` and
    ``/metrics`` read only the newest engine of a process too). It names no metrics up front, so vLLM's
    ``unregister_vllm_metrics`` leaves it registered across engines."""

    def __init__(self) -> None:
        self.instance_id: str | None = None
        self.model_name = ""

    def watch(self, instance_id: str, model_name: str) -> None:
        self.instance_id, self.model_name = instance_id, model_name
        path = snapshot_path(instance_id)
        atexit.register(path.unlink, missing_ok=True)

    def describe(self) -> list:
        return []

    def collect(self):
        if self.instance_id is None:
            return
        try:
            snapshot = json.loads(snapshot_path(self.instance_id).read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # no decode step yet
            return
        yield from snapshot_metrics(snapshot, self.model_name)


def snapshot_metrics(snapshot: dict[str, Any], model_name: str) -> list:
    """Prometheus metric families for one snapshot (:func:`controller_snapshot`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels, values = ["model_name"], [model_name]
    families = []
    for name, value in snapshot["counters"].items():
        family = CounterMetricFamily(PREFIX + COUNTER_NAMES.get(name, name),
                                     f"easyspec.tree.auto controller: {name.replace('_', ' ')}", labels=labels)
        family.add_metric(values, value)
        families.append(family)
    for name, key, top, doc in (
        ("nodes_per_request", "nodes_per_request", snapshot["max_nodes"], "nodes chosen per request per step"),
        ("draft_depth", "depth_per_step", snapshot["max_depth"], "levels drafted per step"),
    ):
        counts = {int(k): v for k, v in snapshot[key].items()}
        buckets, running = [], 0
        for edge in range(top + 1):
            running += counts.get(edge, 0)
            buckets.append((str(float(edge)), running))
        buckets.append(("+Inf", sum(counts.values())))
        family = HistogramMetricFamily(PREFIX + name, f"easyspec.tree.auto controller: {doc}", labels=labels)
        family.add_metric(values, buckets, sum_value=float(sum(k * v for k, v in counts.items())))
        families.append(family)
    ratio = GaugeMetricFamily(PREFIX + "realised_over_predicted",
                              "easyspec.tree.auto: realised over predicted accepted nodes (recent)", labels=labels)
    ratio.add_metric(values, snapshot["realised_over_predicted"])
    families.append(ratio)
    host = GaugeMetricFamily(PREFIX + "drafting_host_seconds_per_request",
                             "easyspec.tree.auto cost model: a drafting stage's host work beyond its forwards, "
                             "seconds per request", labels=labels)
    host.add_metric(values, snapshot["drafting_host_seconds_per_request"])
    families.append(host)
    for curve, doc in (("verify_seconds", "target verify forward seconds by rows in the batch"),
                       ("draft_level_seconds", "one draft level forward seconds by rows")):
        family = GaugeMetricFamily(PREFIX + curve, f"easyspec.tree.auto cost model: {doc}",
                                   labels=[*labels, "rows"])
        for rows, seconds in snapshot[curve].items():
            family.add_metric([*values, rows], seconds)
        families.append(family)
    for field in ("predicted", "observed", "nodes"):
        family = GaugeMetricFamily(PREFIX + f"calibration_{field}",
                                   f"easyspec.tree.auto acceptance model calibration: {field} by bin of prediction",
                                   labels=[*labels, "table", "bin"])
        for table, rows in snapshot["calibration"].items():
            for row in rows:
                family.add_metric([*values, table, f"{row['low']:.1f}-{row['high']:.1f}"], row[field])
        families.append(family)
    return families


_collector: ControllerMetricsCollector | None = None


def export_controller_metrics(vllm_config) -> None:
    """Front end: the newest engine's controller in this process's Prometheus registry (one collector per
    process, registered on first use)."""
    global _collector
    from prometheus_client import REGISTRY

    if _collector is None:
        _collector = ControllerMetricsCollector()
        REGISTRY.register(_collector)
    model_config = vllm_config.model_config
    _collector.watch(vllm_config.instance_id, model_config.served_model_name or model_config.model)
