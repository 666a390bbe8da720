"""The controller's plan log: what ``plan_depth`` priced, written only when asked for, and its summary."""

from __future__ import annotations

import pytest

from vllm_easyspec.control.controller import SpeculationController
from vllm_easyspec.control.cost import CostCurve, StepCostModel
from vllm_easyspec.control.planning import AveragedOffer, Candidates, DepthRate, choose_depth
from vllm_easyspec.instruments.plan_log import PLAN_LOG_VARIABLE, appender, plan_log_path, read, summary


def _controller() -> SpeculationController:
    # verify flat at 50 ms, first pass 10 ms, a level 2 ms
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05]),
                         CostCurve.from_measurements([1, 64], [0.002, 0.002]),
                         CostCurve.from_measurements([1, 64], [0.01, 0.01]))
    return SpeculationController(cost, max_depth=2, max_nodes=2, level_width=1)


def test_choose_depth_records_every_option_it_priced():
    record: list[DepthRate] = []
    by_depth = [[Candidates([0.9], 2)], [Candidates([0.9, 0.5], 2)]]
    plan = choose_depth(by_depth, lambda rows, masked, masked_requests, requests: 0.05, lambda depth: 0.01 * depth,
                        [Candidates([0.3], 2)], record)
    assert plan.depth == 2
    assert [(r.depth, r.nodes) for r in record] == [(0, 0), (0, 1), (1, 1), (2, 2)]
    assert [r.gain for r in record] == pytest.approx([0.0, 0.3, 0.9, 1.4])
    assert [r.rate for r in record] == pytest.approx([1 / 0.05, 1.3 / 0.05, 1.9 / 0.06, 2.4 / 0.07])


def test_the_controller_logs_each_plan_only_when_a_log_is_set(tmp_path, monkeypatch):
    controller = _controller()
    controller.offered["a"] = {(1, False): AveragedOffer([0.9], None), (2, False): AveragedOffer([0.9, 0.5], None)}
    assert controller.plan_depth(["a"], first_pass_rows=2) == 2  # no log: nothing written anywhere
    monkeypatch.setenv(PLAN_LOG_VARIABLE, str(tmp_path / "plan"))
    path = plan_log_path()
    assert path is not None and path.startswith(str(tmp_path / "plan."))
    controller.plan_log = appender(path)
    controller.plan_depth(["a"], first_pass_rows=2, lookup_lengths=[0])
    (record,) = read([path])
    assert record["requests"] == 1 and record["with_lookup"] == 0 and record["planned"] == record["drafted"] == 2
    assert [option["depth"] for option in record["options"]] == [0, 0, 1, 2]  # nothing, lookup paths, 1, 2
    text = summary([record, record | {"drafted": 1, "held_back": True}])
    assert "## 1 request: 2 steps" in text and "Drafted depth: 1: 1, 2: 1" in text and "held back by the outcome guard 1" in text
    assert "| depth 2 | 2 | 2 | 1.40 |" in text
    monkeypatch.delenv(PLAN_LOG_VARIABLE)
    assert plan_log_path() is None
