"""``python -m benchmarks main --json`` without an engine: the JSON cell's requests carry the schema, the plain
cell's none, and the report divides each setup's JSON speedup by its plain one, round by round too."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks import main_json
from benchmarks.harness import processes
from benchmarks.harness.setups import Cell, Setup, Workload
from benchmarks.main_json import JSON_REQUEST, JSON_SCHEMA, goal_summary, json_cells, run_json


def test_the_json_cell_builds_sampling_params_with_the_schema_and_the_plain_cell_without():
    json_cell, plain_cell = json_cells(["Why is the sky blue?", "Sum 1 to 100."], 1, 16)
    assert json_cell.prompts == [p + JSON_REQUEST for p in plain_cell.prompts]
    assert (json_cell.name, plain_cell.name, json_cell.group, plain_cell.group) == ("json-b1", "plain-b1", "json", "plain")
    # the engine child rebuilds the cell from JSON: the schema must survive the trip
    rebuilt = Cell(**json.loads(json.dumps(asdict(json_cell))))
    params = rebuilt.sampling_params(temperature=0.0, seed=0)
    assert [p.max_tokens for p in params] == [16, 16]
    assert all(p.structured_outputs is not None and p.structured_outputs.json == JSON_SCHEMA for p in params)
    assert all(p.structured_outputs is None for p in plain_cell.sampling_params(temperature=0.0))
    assert rebuilt.structured_options()["structured_outputs"].json == JSON_SCHEMA and plain_cell.structured_options() == {}
    assert [c.name for c in json_cells(["p"], 8, 16, plain=False)] == ["json-b8"]
    assert set(JSON_SCHEMA["required"]) == set(JSON_SCHEMA["properties"])


def test_run_json_reports_decode_speed_per_cell_and_the_goal_ratio_by_round(tmp_path, monkeypatch):
    # decode tok/s per (setup, cell); round 1 runs 10% faster throughout
    speeds = {("vanilla", "json-b1"): 10.0, ("vanilla", "plain-b1"): 10.0, ("vanilla", "json-b8"): 40.0,
              ("tree", "json-b1"): 14.0, ("tree", "plain-b1"): 15.0, ("tree", "json-b8"): 36.0}

    def fake_child(setup, workload, round_index, record_top_logits, cells):
        # one run per batch: at batch 1 the JSON cell then the plain one, at 8 the JSON cell alone
        expected = [True, False] if workload.batch_size == 1 else [True]
        assert [c.structured_outputs is not None for c in cells] == expected
        assert len(workload.prompts) == max(2, workload.batch_size)
        return {"setup": setup.name, "cells": {c.name: {
            "setup": setup.name, "decode_tok_per_s": (1 + 0.1 * round_index) * speeds[setup.name, c.name],
            "throughput_tok_per_s": 1.0, "token_ids": [[1, 2]], "mean_acceptance_length": 2.0 if setup.name == "tree" else None,
        } for c in cells}}  # fmt: skip

    monkeypatch.setattr(processes, "_run_in_child", fake_child)
    monkeypatch.setattr(main_json, "RESULTS_DIR", tmp_path)
    workload = Workload(target="t", prompts=["a", "b"], max_tokens=8, batch_size=1)
    code = run_json([Setup("vanilla"), Setup("tree")], workload, [1, 8], 2, "stem", "title",
                    "python -m benchmarks main --json --batch-size 1 8")
    assert code == 0
    written = json.loads((tmp_path / "stem.json").read_text())
    assert list(written["rows"]) == ["json-b1", "plain-b1", "json-b8"]
    assert written["rows"]["json-b8"][1]["speedup_vs_vanilla"] == pytest.approx(0.9)
    tree = written["summary"]["tree"]
    assert tree["json_speedup"] == pytest.approx(1.4) and tree["plain_speedup"] == pytest.approx(1.5)
    assert tree["ratio"] == pytest.approx(1.4 / 1.5) and tree["goal_met"]
    assert tree["ratio_by_round"] == pytest.approx([1.4 / 1.5] * 2)
    report = (tmp_path / "stem.md").read_text()
    assert "## json-b8: 8 prompts" in report and "## plain-b1: 2 prompts" in report and "| tree | 1.40x | 1.50x | 0.93" in report
    assert goal_summary({"json-b8": written["rows"]["json-b1"]}) == {}  # no plain cell, no goal
