"""Benchmark harness bookkeeping (no engine): run order, medians and ranges, identity verdicts vs vanilla."""

from __future__ import annotations

import time

import pytest

from benchmarks.harness import engine, processes, report, steps
from benchmarks.harness.aggregate import finalize_rows, spread
from benchmarks.harness.identity import classify_identity, identity_failures, near_tie_threshold, ulp
from benchmarks.harness.processes import run_matrix
from benchmarks.harness.report import identity_cell, markdown_table
from benchmarks.harness.setups import Cell, Setup, Workload, cell_order, interleaved_order, select_setups
from benchmarks.harness.steps import counter_delta


def _raw(name: str, tok_s: float, ids: list[list[int]], **extra) -> dict:
    return {"setup": name, "decode_tok_per_s": tok_s, "token_ids": ids} | extra


# ---- run order ----


def test_interleaved_order_runs_every_setup_once_per_round_and_rotates_the_first():
    order = interleaved_order(["vanilla", "a", "b"], 4)
    rounds = [[name for r, name in order if r == i] for i in range(4)]
    assert rounds == [["vanilla", "a", "b"], ["a", "b", "vanilla"], ["b", "vanilla", "a"], ["vanilla", "a", "b"]]
    # Rounds are contiguous: round r+1 starts only after every setup ran in round r.
    assert [r for r, _ in order] == sorted(r for r, _ in order)
    assert {rounds[i][0] for i in range(3)} == {"vanilla", "a", "b"}


def test_select_setups_keeps_the_matches_and_vanilla():
    setups = [Setup(name, "") for name in ("vanilla", "eagle3-k2", "eagle3-k3", "eagle3-tree-4@2:2c")]
    assert [s.name for s in select_setups(setups, r"eagle3-k2$|@")] == ["vanilla", "eagle3-k2", "eagle3-tree-4@2:2c"]
    assert select_setups(setups, None) == setups


def test_interleaved_order_needs_a_repeat():
    assert interleaved_order(["x"], 1) == [(0, "x")]
    with pytest.raises(ValueError):
        interleaved_order(["x"], 0)


# ---- aggregation ----


def test_spread_is_median_min_max():
    assert spread([9.0, 15.0, 10.0]) == (10.0, 9.0, 15.0)
    assert spread([8.0, 12.0]) == (10.0, 8.0, 12.0)  # even count: mean of the middle two


def test_rows_take_medians_and_ratios_against_the_vanilla_median():
    ids = [[1, 2]]
    raw = [
        _raw("vanilla", 10.0, ids, drafting_seconds_per_step=None, verify_seconds_per_step=0.10),
        _raw("spec", 15.0, ids, verify_seconds_per_step=0.12, drafting_seconds_per_step=0.03),
        _raw("spec", 18.0, ids, verify_seconds_per_step=0.14, drafting_seconds_per_step=0.05),
        _raw("vanilla", 8.0, ids, verify_seconds_per_step=0.11),
        _raw("vanilla", 12.0, ids, verify_seconds_per_step=0.09),
        _raw("spec", 30.0, ids, verify_seconds_per_step=0.13, drafting_seconds_per_step=0.04),
    ]
    rows = finalize_rows(raw, order=["vanilla", "spec"])
    assert [r["setup"] for r in rows] == ["vanilla", "spec"]
    vanilla, spec = rows
    assert vanilla["repeats"] == spec["repeats"] == 3
    assert vanilla["decode_tok_per_s"] == 10.0 and vanilla["speedup_vs_vanilla"] == 1.0
    assert (vanilla["speedup_min"], vanilla["speedup_max"]) == (0.8, 1.2)
    assert spec["decode_tok_per_s_runs"] == [15.0, 18.0, 30.0]
    assert (spec["decode_tok_per_s"], spec["decode_tok_per_s_min"], spec["decode_tok_per_s_max"]) == (18.0, 15.0, 30.0)
    assert spec["speedup_vs_vanilla"] == 1.8 and (spec["speedup_min"], spec["speedup_max"]) == (1.5, 3.0)
    assert spec["verify_seconds_per_step"] == 0.13 and spec["drafting_seconds_per_step"] == 0.04
    assert vanilla["drafting_seconds_per_step"] is None and vanilla["verify_seconds_per_step"] == 0.10
    assert spec["repeats_agree"] and spec["identity"] == "identical" and spec["outputs_identical_to_vanilla"]
    table = markdown_table(rows)
    assert "18.0 [15.0–30.0]" in table and "1.80x [1.50–3.00]" in table and "| yes |" in table


def test_repeats_that_disagree_are_flagged_and_judged_each():
    top = [[[[5, 10.0], [6, 9.0]], [[7, 10.0], [8, 10.0]]]]
    raw = [
        _raw("vanilla", 10.0, [[5, 7]], vanilla_top=top, logits_dtype="float32"),
        _raw("spec", 12.0, [[5, 7]]),
        _raw("spec", 12.0, [[5, 8]]),  # position 1 is an exact tie: a near-tie in the second run only
    ]
    spec = finalize_rows(raw)[1]
    assert spec["repeats_agree"] is False
    assert spec["identity"] == "near-tie" and not spec["outputs_identical_to_vanilla"]
    assert identity_cell(spec) == "near-tie (1) (repeats differ)"


def test_no_vanilla_leaves_ratios_and_identity_empty():
    rows = finalize_rows([_raw("a", 8.0, [[1]]), _raw("a", 9.0, [[1]])])
    assert rows[0]["speedup_vs_vanilla"] is None and rows[0]["identity"] is None
    assert identity_cell(rows[0]) == "–"


def test_vanilla_whose_tokens_change_with_logprobs_fails():
    raw = [_raw("vanilla", 10.0, [[1]], vanilla_top=[[[[1, 3.0], [2, 1.0]]]], logprobs_tokens_match=False)]
    row = finalize_rows(raw)[0]
    assert row["identity"] == "FAILED"
    assert identity_failures([row])[0].startswith("LOSSLESS CHECK FAILED: setup vanilla")


# ---- identity verdicts ----


def test_ulp_matches_the_significand_width():
    assert ulp(1.0, "bfloat16") == 2**-7 and ulp(1.99, "bfloat16") == 2**-7 and ulp(-2.0, "bfloat16") == 2**-6
    assert ulp(20.0, "bfloat16") == 2**-3  # floor(log2 20) = 4
    assert ulp(1.0, "float16") == 2**-10 and ulp(1.0, "float32") == 2**-23
    assert ulp(1.0, "torch.bfloat16") == ulp(1.0, "bf16")
    assert near_tie_threshold(20.0, "bfloat16") == 0.25


def test_identical_outputs():
    verdict = classify_identity([[1, 2, 3], [4]], [[1, 2, 3], [4]], None, "bfloat16")
    assert verdict == {"identity": "identical", "divergences": []}


def _vanilla_top(logit_1: float, logit_2: float) -> list:
    """Prompt 0: vanilla generated [5, 7, 9]; at position 1 its top choices are 7, 8 (and 12 at 19.0)."""
    return [[[[5, 30.0], [6, 20.0]], [[7, logit_1], [8, logit_2], [12, 19.0]], [[9, 25.0], [3, 1.0]]]]


def test_near_tie_within_bf16_rounding():
    # top logit 20.0: bf16 ulp 0.125, threshold 0.25; margin 0.125 is one bf16 step.
    verdict = classify_identity([[5, 8, 4]], [[5, 7, 9]], _vanilla_top(20.0, 19.875), "bfloat16")
    assert verdict["identity"] == "near-tie"
    (d,) = verdict["divergences"]
    assert (d["prompt"], d["position"], d["setup_token"], d["vanilla_token"]) == (0, 1, 8, 7)
    assert d["margin"] == 0.125 and d["threshold"] == 0.25 and d["near_tie"]
    assert d["vanilla_top"] == [[7, 20.0], [8, 19.875]]


def test_margin_above_rounding_fails():
    verdict = classify_identity([[5, 8, 4]], [[5, 7, 9]], _vanilla_top(20.0, 19.5), "bfloat16")
    assert verdict["identity"] == "FAILED" and verdict["divergences"][0]["margin"] == 0.5
    row = {"setup": "spec", **verdict}
    (line,) = identity_failures([row])
    assert line.startswith("LOSSLESS CHECK FAILED: setup spec, prompt 0, position 1, margin 0.5")
    assert "setup token 8" in line


def test_three_way_tie_within_rounding_is_a_near_tie():
    # Vanilla's logits 19.125 / 19.0 / 19.0: its third choice is as close to the top as its second.
    verdict = classify_identity([[5, 12, 4]], [[5, 7, 9]], _vanilla_top(19.125, 19.0), "bfloat16")
    (d,) = verdict["divergences"]
    assert verdict["identity"] == "near-tie" and d["margin"] == 0.125 and d["threshold"] == 0.25
    assert d["vanilla_top"] == [[7, 19.125], [8, 19.0], [12, 19.0]]


def test_lower_choice_outside_rounding_fails():
    verdict = classify_identity([[5, 12, 4]], [[5, 7, 9]], _vanilla_top(20.0, 19.875), "bfloat16")
    (d,) = verdict["divergences"]
    assert verdict["identity"] == "FAILED" and d["margin"] == 1.0 and not d["near_tie"]


def test_divergent_token_outside_the_record_fails():
    verdict = classify_identity([[5, 11, 4]], [[5, 7, 9]], _vanilla_top(20.0, 20.0), "bfloat16")
    (d,) = verdict["divergences"]
    assert verdict["identity"] == "FAILED" and not d["near_tie"]
    assert d["margin"] == 1.0  # at least the margin to vanilla's last recorded choice


def test_float32_threshold_is_tight():
    # The bf16 near-tie above is far outside float32 rounding (threshold 2 * 2**-19 at 20.0).
    assert classify_identity([[5, 8, 4]], [[5, 7, 9]], _vanilla_top(20.0, 19.875), "float32")["identity"] == "FAILED"
    close = 20.0 - 2**-19
    verdict = classify_identity([[5, 8, 4]], [[5, 7, 9]], _vanilla_top(20.0, close), "float32")
    assert verdict["identity"] == "near-tie" and verdict["divergences"][0]["threshold"] == 2**-18


def test_missing_record_or_early_stop_fails():
    assert classify_identity([[5, 8]], [[5, 7]], None, "bfloat16")["identity"] == "FAILED"
    verdict = classify_identity([[5]], [[5, 7, 9]], _vanilla_top(20.0, 20.0), "bfloat16")
    assert verdict["identity"] == "FAILED" and verdict["divergences"][0]["setup_token"] is None


def test_one_divergence_per_prompt_and_the_worst_wins():
    vanilla = [[5, 7, 9], [5, 7, 9]]
    top = _vanilla_top(20.0, 19.875) * 2
    verdict = classify_identity([[5, 8, 1], [5, 7, 2]], vanilla, top, "bfloat16")
    assert [d["prompt"] for d in verdict["divergences"]] == [0, 1]
    assert [d["near_tie"] for d in verdict["divergences"]] == [True, False]  # prompt 1: 2 vs 9 at margin 24
    assert verdict["identity"] == "FAILED"


# ---- matrix runs ----


def test_counter_delta_subtracts_counters_and_keeps_states():
    before = {"steps": 3, "seconds": 0.5, "nodes_per_request": {0: 2, 1: 1}, "realised_over_predicted": 0.9,
              "verify_curve": {"rows": [1, 2], "seconds": [0.1, 0.2]}, "flag": True}
    after = {"steps": 10, "seconds": 2.0, "nodes_per_request": {0: 2, 1: 4, 2: 1}, "realised_over_predicted": 1.1,
             "verify_curve": {"rows": [1, 2], "seconds": [0.1, 0.3]}, "flag": True}
    delta = counter_delta(before, after)
    assert delta["steps"] == 7 and delta["seconds"] == 1.5
    assert delta["nodes_per_request"] == {0: 0, 1: 3, 2: 1}
    assert delta["realised_over_predicted"] == 1.1  # a state, not a counter
    assert delta["verify_curve"] == after["verify_curve"] and delta["flag"] is True
    assert counter_delta(None, after) is after and counter_delta(before, None) is None


def test_a_matrix_aggregates_each_cell_and_resumes_from_its_runs_file(tmp_path, monkeypatch):
    cells = [Cell("chat-b1", ["p"] * 4, 1, 8), Cell("chat-b4", ["p"] * 8, 4, 8)]
    speeds = {("vanilla", "chat-b1"): 10.0, ("vanilla", "chat-b4"): 30.0,
              ("spec", "chat-b1"): 20.0, ("spec", "chat-b4"): 27.0}
    called = []

    def fake_child(setup, workload, round_index, record_top_logits, cells_asked):
        called.append((round_index, setup.name))
        assert [c.name for c in cells_asked] == ["chat-b1", "chat-b4"] and workload.batch_size == 4
        factor = 1.0 + 0.1 * round_index
        return {"setup": setup.name, "cells": {
            c.name: _raw(setup.name, 1.0, [[1, 2]], throughput_tok_per_s=factor * speeds[setup.name, c.name])
            for c in cells_asked}}

    monkeypatch.setattr(processes, "_run_in_child", fake_child)
    runs = tmp_path / "runs.jsonl"
    setups = [Setup("vanilla"), Setup("spec")]
    workload = Workload(target="t", prompts=[], batch_size=4)
    first = run_matrix(setups, workload, cells, repeats=2, runs_file=runs, progress=False)
    assert called == [(0, "vanilla"), (0, "spec"), (1, "spec"), (1, "vanilla")]
    assert len(runs.read_text().splitlines()) == 4
    spec_b1 = first["chat-b1"][1]
    assert spec_b1["repeats"] == 2 and spec_b1["throughput_tok_per_s_runs"] == [20.0, 22.0]
    assert spec_b1["speedup_vs_vanilla"] == pytest.approx(21.0 / 10.5)
    assert first["chat-b4"][1]["speedup_vs_vanilla"] == pytest.approx(28.35 / 31.5)
    called.clear()
    again = run_matrix(setups, workload, cells, repeats=3, runs_file=runs, progress=False)
    assert called == [(2, "vanilla"), (2, "spec")]  # rounds 0 and 1 came from the runs file
    assert again["chat-b1"][1]["repeats"] == 3
    with pytest.raises(ValueError, match="below a cell's batch"):
        run_matrix(setups, Workload(target="t", prompts=[], batch_size=2), cells, runs_file=None, progress=False)


def test_each_round_serves_the_classes_rotated_so_none_is_always_first():
    cells = [Cell(f"{group}-b{batch}", ["p"] * 4, batch, 8, group=group)
             for group in ("chat", "edit", "mixed") for batch in (1, 4)]
    orders = [[c.name for c in cell_order(cells, r)] for r in range(4)]
    assert orders[0] == [c.name for c in cells]
    assert orders[1] == ["edit-b1", "edit-b4", "mixed-b1", "mixed-b4", "chat-b1", "chat-b4"]
    assert orders[3] == orders[0]
    assert {order[0] for order in orders[:3]} == {"chat-b1", "edit-b1", "mixed-b1"}
    assert all(sorted(order) == sorted(orders[0]) for order in orders)


def test_side_by_side_every_engine_takes_each_cell_in_turn_before_the_next_cell(monkeypatch):
    started, measured = [], []

    def fake_start(setup, workload):
        started.append((setup.name, engine.os.environ.get("BENCH_MARK")))
        return setup.name, 1.0

    def fake_measure(llm, tokenizer, setup, workload, cell, record_top_logits, limit_in_flight, counters_readable):
        measured.append((cell.name, setup.name, record_top_logits))
        assert counters_readable == (setup.name == "b")  # the newest engine's metrics alone are registered
        return {"throughput_tok_per_s": 1.0}

    class Engine(str):
        def reset_prefix_cache(self):
            pass

    monkeypatch.setattr(engine, "_start_engine", lambda s, w: (Engine(fake_start(s, w)[0]), 1.0))
    monkeypatch.setattr(engine, "_measure", fake_measure)
    monkeypatch.delenv("BENCH_MARK", raising=False)
    setups = [Setup("vanilla"), Setup("a", env={"BENCH_MARK": "a"}), Setup("b")]
    cells = [Cell("chat-b1", ["p"] * 4, 1, 8, group="chat"), Cell("edit-b1", ["p"] * 4, 1, 8, group="edit")]
    runs = engine._side_by_side_round(setups, Workload(target="t", prompts=[]), None, cells, round_index=1)
    assert [r["setup"] for r in runs] == ["vanilla", "a", "b"]
    assert all(set(r["cells"]) == {"chat-b1", "edit-b1"} for r in runs)
    assert started == [("vanilla", None), ("a", "a"), ("b", None)]  # each engine starts under its setup's env
    assert "BENCH_MARK" not in engine.os.environ
    # cell by cell, the setups rotated by round and cell; vanilla records top logits in round 0 only
    assert measured == [("chat-b1", "a", False), ("chat-b1", "b", False), ("chat-b1", "vanilla", False),
                        ("edit-b1", "b", False), ("edit-b1", "vanilla", False), ("edit-b1", "a", False)]
    measured.clear()
    engine._side_by_side_round(setups, Workload(target="t", prompts=[]), None, cells[:1], round_index=0)
    assert measured[0] == ("chat-b1", "vanilla", True)


def test_a_side_by_side_matrix_runs_whole_rounds_and_resumes_from_its_runs_file(tmp_path, monkeypatch):
    cells = [Cell("chat-b1", ["p"] * 4, 1, 8)]
    rounds = []

    def fake_round(setups, workload, round_index, cells_asked):
        rounds.append(round_index)
        return [{"setup": s.name, "cells": {"chat-b1": _raw(s.name, 1.0, [[1]], throughput_tok_per_s=10.0
                                                             * (1 + (s.name == "spec")) + round_index)}}
                for s in setups]

    monkeypatch.setattr(processes, "_run_round_in_child", fake_round)
    runs = tmp_path / "runs.jsonl"
    setups = [Setup("vanilla"), Setup("spec")]
    workload = Workload(target="t", prompts=[], batch_size=1)
    first = run_matrix(setups, workload, cells, repeats=2, runs_file=runs, progress=False, side_by_side=True)
    assert rounds == [0, 1] and len(runs.read_text().splitlines()) == 4
    assert first["chat-b1"][1]["throughput_tok_per_s_runs"] == [20.0, 21.0]
    assert first["chat-b1"][1]["speedup_vs_vanilla"] == pytest.approx(20.5 / 10.5)
    rounds.clear()
    again = run_matrix(setups, workload, cells, repeats=3, runs_file=runs, progress=False, side_by_side=True)
    assert rounds == [2] and again["chat-b1"][1]["repeats"] == 3


def test_a_matrix_cell_is_measured_by_throughput_and_older_runs_get_it_from_their_totals():
    runs = [_raw("vanilla", 99.0, [[1]], output_tokens=64, generate_seconds=4.0, throughput_tok_per_s=16.0),
            _raw("spec", 10.0, [[1]], output_tokens=64, generate_seconds=2.0)]  # recorded without the field
    vanilla, spec = finalize_rows(runs, speed="throughput_tok_per_s")
    assert vanilla["throughput_tok_per_s"] == 16.0 and spec["throughput_tok_per_s"] == 32.0
    assert spec["speedup_vs_vanilla"] == 2.0  # not the decode tok/s (10 against 99)


def test_the_step_log_records_each_steps_drafts_and_times_and_empties_when_taken():
    from types import SimpleNamespace

    from benchmarks.harness.step_timers import take_step_log, time_steps

    class Model:
        def compute_logits(self, hidden):
            time.sleep(0.002)
            return hidden

    class Runner:
        drafter = None
        model = Model()

        def _model_forward(self, **inputs):
            time.sleep(0.003)
            return inputs["input_ids"]

        def execute_model(self, scheduler_output):
            time.sleep(0.001)
            self.model.compute_logits(self._model_forward(input_ids=[1]))
            return None

        def sample_tokens(self, grammar_output=None):
            return "sampled"

    worker = SimpleNamespace(model_runner=Runner())
    assert take_step_log(worker) is None  # not timed
    assert time_steps(worker)

    def step(scheduled, drafts, new=()):
        output = SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts,
                                 scheduled_new_reqs=list(new), total_num_scheduled_tokens=sum(scheduled.values()))
        assert worker.model_runner.execute_model(output) is None
        assert worker.model_runner.sample_tokens() == "sampled"

    step({"a": 5, "b": 1}, {"a": [1, 2, 3, 4]})
    step({"a": 1, "b": 3}, {"b": [7, 8]})
    step({"c": 30}, {}, new=["c"])
    log = take_step_log(worker)
    assert [(r["requests"], r["draft_tokens"], r["requests_with_drafts"], r["decode"]) for r in log] == [
        (2, 4, 1, True), (2, 2, 1, True), (1, 0, 0, False)]
    assert all(r["seconds"] >= r["forward_seconds"] > r["model_seconds"] >= 0.005 and r["drafting_seconds"] == 0
               for r in log)
    assert take_step_log(worker) == []


def test_steps_by_drafts_groups_decode_steps_and_files_each_drafting_stage_under_the_drafts_it_produced():
    def record(drafts, seconds, drafting, decode=True):
        return {"requests": 1, "draft_tokens": drafts, "requests_with_drafts": int(drafts > 0), "decode": decode,
                "seconds": seconds, "forward_seconds": seconds / 2, "drafting_seconds": drafting}

    records = [record(0, 0.500, 0.0, decode=False),  # a prefill: neither a verify nor a drafting stage counted
               record(0, 0.050, 0.003),   # drafted nothing for the next step
               record(0, 0.052, 0.012),   # drafted 5 for the next step
               record(5, 0.070, 0.011),   # drafted 7
               record(7, 0.074, 0.002),   # drafted nothing
               record(0, 0.051, 0.0)]
    summary = steps.steps_by_drafts(records)
    assert list(summary) == ["0", "4-7"]
    none, some = summary["0"], summary["4-7"]
    assert none["steps"] == 3 and none["draft_tokens"] == 0
    assert none["verify_seconds"] == pytest.approx(0.047)  # median of 0.047, 0.040, 0.051
    assert none["drafting_stages"] == 2 and none["drafting_seconds"] == pytest.approx(0.0025)  # 0.003, 0.002
    assert some["steps"] == 2 and some["draft_tokens"] == 6 and some["requests_with_drafts"] == 1
    assert some["verify_seconds"] == pytest.approx((0.059 + 0.072) / 2)
    assert some["drafting_stages"] == 2 and some["drafting_seconds"] == pytest.approx((0.012 + 0.011) / 2)
    table = report.steps_by_drafts_table([{"setup": "auto", "decode_steps_by_drafts": summary}])
    assert "| auto | 4-7 | 2 | 6.0 | 1.0 | 65.5 |" in table
    assert steps._draft_bucket(64) == "64-" and steps._draft_bucket(1) == "1" and steps._draft_bucket(3) == "2-3"
