"""The controller matrix's report flags cells whose vanilla processes disagree (a machine whose speed drifted)."""

from __future__ import annotations

from benchmarks.auto_matrix import VANILLA_SPREAD_WARNING, goals, vanilla_spread
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
