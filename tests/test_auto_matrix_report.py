"""The controller matrix's report flags cells whose vanilla processes disagree (a machine whose speed drifted),
and compares setups round by round."""

from __future__ import annotations

from benchmarks.auto_matrix import VANILLA_SPREAD_WARNING, cell_summary, goals, paired_ratios, vanilla_spread
from benchmarks.harness import MATRIX_SPEED, VANILLA


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
