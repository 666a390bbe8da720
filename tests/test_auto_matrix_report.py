"""The controller matrix's report flags cells whose vanilla processes disagree (a machine whose speed drifted),
and compares setups round by round."""

from __future__ import annotations

from benchmarks.harness.setups import MATRIX_SPEED, VANILLA
from benchmarks.harness.steps import undrafted_forward_seconds
from benchmarks.matrix.report import goals
from benchmarks.matrix.summary import (
    VANILLA_SPREAD_WARNING,
    cell_summary,
    equal_speed_ratios,
    paired_ratios,
    process_slowness,
    vanilla_spread,
)


def _vanilla(low: float, high: float) -> dict:
    return {"setup": VANILLA, MATRIX_SPEED: (low + high) / 2, f"{MATRIX_SPEED}_min": low,
            f"{MATRIX_SPEED}_max": high, "speedup_vs_vanilla": 1.0}


def test_a_cell_whose_vanilla_processes_disagree_is_flagged_and_one_whose_agree_is_not():
    drifted, steady = [_vanilla(30.8, 40.3)], [_vanilla(38.0, 39.5)]
    assert vanilla_spread(drifted) > VANILLA_SPREAD_WARNING > vanilla_spread(steady)
    report = goals({"heldout-b8": drifted, "mixed-b8": steady})
    assert "heldout-b8 (1.31x)" in report and "mixed-b8" not in report
    assert goals({"mixed-b8": steady}) == ""


def _row(name: str, runs: list[float], vanilla_median: float) -> dict:
    median = sorted(runs)[len(runs) // 2]
    return {"setup": name, MATRIX_SPEED: median, f"{MATRIX_SPEED}_min": min(runs), f"{MATRIX_SPEED}_max": max(runs),
            f"{MATRIX_SPEED}_runs": runs, "speedup_vs_vanilla": median / vanilla_median,
            "speedup_min": min(runs) / vanilla_median, "speedup_max": max(runs) / vanilla_median}


def test_round_by_round_ratios_see_through_drift_that_the_medians_of_each_setup_carry():
    # the machine ran 30% slower in round 1: every setup's median is the mean of a fast and a slow run
    vanilla = _row(VANILLA, [40.0, 28.0, 39.0], 39.0)
    auto = _row("eagle-auto", [38.0, 27.0, 37.0], 39.0)  # 2.5-5% below vanilla in every round
    fixed = _row("eagle-table", [37.0, 29.0, 36.0], 39.0)
    assert paired_ratios(auto, vanilla) == sorted([38 / 40, 27 / 28, 37 / 39])
    assert paired_ratios(auto, _row(VANILLA, [40.0, 28.0], 34.0)) == []  # a round missing: no pairs
    summary = cell_summary([vanilla, auto, fixed])["eagle"]
    assert summary["best_fixed"] == "eagle-table"
    assert summary["auto_vs_best_fixed_by_round"] == sorted([38 / 37, 27 / 29, 37 / 36])
    report = goals({"chat-b16": [vanilla, auto, fixed]})
    assert "slower than vanilla in every round in 1: chat-b16 (0.95)" in report
    assert "median below 0.97x the best fixed setup in 0" in report


def test_the_controllers_ratio_is_split_into_steps_needed_and_the_price_of_a_step():
    vanilla = _row(VANILLA, [14.0, 14.0, 14.0], 14.0)
    auto = _row("eagle-auto", [22.0, 22.0, 22.0], 14.0) | {"engine_steps": 60}
    table = _row("eagle-table", [24.0, 24.0, 24.0], 14.0) | {"engine_steps": 52}
    summary = cell_summary([vanilla, auto, table])["eagle"]
    # the table needs 52 steps where the controller needs 60: 0.87 of the gap is tokens per step, not a dearer step
    assert summary["steps_best_fixed_over_auto"] == 52 / 60
    assert cell_summary([vanilla, auto | {"engine_steps": None}, table])["eagle"]["steps_best_fixed_over_auto"] is None


def test_a_controller_on_another_candidate_is_the_controller_not_a_fixed_setup():
    vanilla = _row(VANILLA, [10.0, 10.0], 10.0)
    table, auto_4 = _row("eagle-table", [15.0, 15.0], 10.0), _row("eagle-auto-4", [16.0, 16.0], 10.0)
    alone = cell_summary([vanilla, table, auto_4])["eagle"]
    assert (alone["controller"], alone["best_fixed"]) == ("eagle-auto-4", "eagle-table")
    assert abs(alone["auto_vs_best_fixed"] - 16 / 15) < 1e-9
    both = cell_summary([vanilla, table, auto_4, _row("eagle-auto", [14.0, 14.0], 10.0)])["eagle"]
    assert (both["controller"], both["best_fixed"]) == ("eagle-auto", "eagle-table")  # auto-4 is no fixed setup


def _step(requests: int, forward: float, drafts: int = 0, decode: bool = True) -> dict:
    return {"requests": requests, "draft_tokens": drafts, "requests_with_drafts": min(drafts, requests),
            "decode": decode, "seconds": forward + 0.01, "forward_seconds": forward, "model_seconds": forward - 0.1,
            "drafting_seconds": 0.005}


def test_undrafted_decode_steps_are_grouped_by_request_count_and_the_rest_left_out():
    log = [_step(8, 1.0, decode=False), _step(8, 0.30), _step(8, 0.32), _step(8, 0.50, drafts=4), _step(8, 0.31),
           _step(3, 0.20)]
    assert undrafted_forward_seconds(log) == {"3": [0.20, 1], "8": [0.31, 3]}
    model = undrafted_forward_seconds(log, "model_seconds")
    assert {n: [round(s, 6), count] for n, (s, count) in model.items()} == {"3": [0.1, 1], "8": [0.21, 3]}
    older = [{k: v for k, v in record.items() if k != "model_seconds"} for record in log]  # logged before it was timed
    assert undrafted_forward_seconds(older, "model_seconds") == {}


def test_process_speed_is_compared_at_equal_request_counts_with_enough_steps_only():
    slow = {"8": [0.33, 5], "7": [0.33, 4], "2": [0.9, 1]}
    fast = {"8": [0.30, 6], "7": [0.30, 3], "2": [0.1, 9], "1": [0.2, 9]}
    assert abs(process_slowness(slow, fast) - 1.1) < 1e-9  # the request count 2 has one slow step only
    assert process_slowness({"2": [0.9, 1]}, fast) is None
    assert process_slowness(None, fast) is None


def test_a_controller_behind_only_because_its_process_ran_slower_is_shown_level_at_equal_process_speed():
    # auto reached 0.93 of the table in both rounds while its process took 1.08x the table's time for the same
    # target forward: level with the table once the processes' difference is taken out
    vanilla = _row(VANILLA, [18.0, 18.0], 18.0) | {"undrafted_forward_seconds_runs": [{"8": [0.30, 9]}] * 2}
    auto = _row("eagle-auto-4", [18.6, 18.6], 18.0) | {"undrafted_forward_seconds_runs": [{"8": [0.324, 4]}] * 2}
    table = _row("eagle-table", [20.0, 20.0], 18.0) | {"undrafted_forward_seconds_runs": [{"8": [0.30, 9]}] * 2}
    summary = cell_summary([vanilla, auto, table])["eagle"]
    assert summary["auto_vs_best_fixed_by_round"] == [0.93, 0.93]
    assert [round(r, 4) for r in summary["auto_vs_best_fixed_equal_speed_by_round"]] == [1.0044, 1.0044]
    assert [round(r, 2) for r in summary["process_slowness_auto_over_best_fixed_by_round"]] == [1.08, 1.08]
    report = goals({"heldout-b8": [vanilla, auto, table]})
    assert "heldout-b8 (0.93 of eagle-table; 1.00 at equal process speed in 2 of 2 rounds, auto's process took 1.08x" in report
    # slower than vanilla in both rounds as measured (0.97 each): 1.05 once the processes' difference is out
    slow_auto = auto | {f"{MATRIX_SPEED}_runs": [17.5, 17.5]}
    assert ("heldout-b8 (0.97; 1.05 at equal process speed in 2 of 2 rounds)"
            in goals({"heldout-b8": [vanilla, slow_auto, table]}))
    # without undrafted steps at a shared request count there is nothing to compare: no split is claimed
    unmatched = auto | {"undrafted_forward_seconds_runs": [{"1": [0.2, 9]}] * 2}
    assert cell_summary([vanilla, unmatched, table])["eagle"]["auto_vs_best_fixed_equal_speed_by_round"] == []
    assert "at equal process speed" not in goals({"heldout-b8": [vanilla, unmatched, table]})


def test_the_processes_are_compared_by_the_target_models_own_forward_where_both_runs_timed_it():
    # auto's execute_model took 1.2x the table's on undrafted steps, but its target model's forward and logits
    # took the same time: the extra is auto's own work in the step, not a slower process, so nothing is taken out
    table = _row("eagle-table", [20.0, 20.0], 18.0) | {"undrafted_forward_seconds_runs": [{"16": [0.30, 9]}] * 2,
                                                        "undrafted_model_seconds_runs": [{"16": [0.25, 9]}] * 2}
    auto = _row("eagle-auto-4", [19.0, 19.0], 18.0) | {"undrafted_forward_seconds_runs": [{"16": [0.36, 9]}] * 2,
                                                       "undrafted_model_seconds_runs": [{"16": [0.25, 9]}] * 2}
    adjusted, slowness = equal_speed_ratios(auto, table)
    assert slowness == [1.0, 1.0] and adjusted == [0.95, 0.95]
    # a round recorded before the model's part was timed falls back to the whole forward
    older = auto | {"undrafted_model_seconds_runs": [None, {"16": [0.25, 9]}]}
    assert [round(s, 2) for s in equal_speed_ratios(older, table)[1]] == [1.0, 1.2]
