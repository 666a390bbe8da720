"""A cell's figures: the controller against vanilla and the best fixed setup of its pair, overall, by round,
and at equal process speed."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.setups import MATRIX_SPEED, VANILLA
from benchmarks.matrix.setups import held_against, is_controller

# undrafted decode steps each of two runs needs at one request count before their forwards are compared
MIN_MATCHED_STEPS = 3
VANILLA_SPREAD_WARNING = 1.10  # vanilla's processes differing more than this flag a machine whose speed drifted


def cell_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pair: the best fixed setup (the median-fastest of the pair's setups that do not run the controller
    and of the model-free ones), the controller's ratio to vanilla and to that setup, and its model's predicted
    against realised tokens. The controller is the pair's ``-auto`` setup, else its first ``-auto-`` one."""
    by_name = {row["setup"]: row for row in rows}
    summary: dict[str, Any] = {"vanilla_tok_per_s": by_name[VANILLA][MATRIX_SPEED]}
    for prefix in ("eagle", "smol"):
        pair = [row for row in rows if held_against(row["setup"], prefix)]
        controllers = [row for row in pair if is_controller(row["setup"])]
        auto = next((row for row in controllers if row["setup"] == f"{prefix}-auto"), None) or next(
            iter(controllers), None)
        fixed = [row for row in pair if not is_controller(row["setup"]) and row[MATRIX_SPEED]]
        if auto is None or not fixed:
            continue
        best = max(fixed, key=lambda row: row[MATRIX_SPEED])
        controller = auto.get("controller") or {}
        steps = controller.get("steps") or 0
        equal_speed_vs_best, slowness_vs_best = equal_speed_ratios(auto, best)
        summary[prefix] = {
            "controller": auto["setup"],
            "best_fixed": best["setup"],
            "best_fixed_vs_vanilla": best["speedup_vs_vanilla"],
            "auto_vs_vanilla": auto["speedup_vs_vanilla"],
            "auto_vs_vanilla_range": [auto["speedup_min"], auto["speedup_max"]],
            "auto_vs_best_fixed": auto[MATRIX_SPEED] / best[MATRIX_SPEED],
            "auto_vs_best_fixed_range": [auto[f"{MATRIX_SPEED}_min"] / best[MATRIX_SPEED],
                                         auto[f"{MATRIX_SPEED}_max"] / best[MATRIX_SPEED]],
            "auto_vs_vanilla_by_round": paired_ratios(auto, by_name[VANILLA]),
            "auto_vs_best_fixed_by_round": paired_ratios(auto, best),
            # the same with the processes' speed difference taken out, and that difference (auto's forward time
            # over the other process's at equal request counts)
            "auto_vs_vanilla_equal_speed_by_round": equal_speed_ratios(auto, by_name[VANILLA])[0],
            "auto_vs_best_fixed_equal_speed_by_round": equal_speed_vs_best,
            "process_slowness_auto_over_best_fixed_by_round": slowness_vs_best,
            # the ratio's split: fewer tokens per step (the choice and acceptance) or dearer steps (cost, host work,
            # the process's speed); steps are counted in each setup's first round and barely move between rounds
            "steps_best_fixed_over_auto": (best["engine_steps"] / auto["engine_steps"]
                                           if best.get("engine_steps") and auto.get("engine_steps") else None),
            "predicted_accepted_per_step": controller.get("predicted_accepted", 0) / steps if steps else None,
            "realised_accepted_per_step": controller.get("realised_accepted", 0) / steps if steps else None,
            "nodes_per_request_step": (controller.get("nodes_chosen", 0) / controller["requests"]
                                       if controller.get("requests") else None),
            "controller_share_of_step": _controller_share(auto),
            "cost_predicted_over_observed": _cost_error(controller),
        }
    return summary


def paired_ratios(row: dict[str, Any], reference: dict[str, Any]) -> list[float]:
    """``row``'s speed over ``reference``'s in each round (the runs of both rows are in round order), sorted;
    empty when either lacks a round. Side by side, a round's two speeds were taken minutes apart at most, so
    their ratio carries little of the machine's drift."""
    mine, theirs = row.get(f"{MATRIX_SPEED}_runs") or [], reference.get(f"{MATRIX_SPEED}_runs") or []
    if len(mine) != len(theirs) or not all(mine) or not all(theirs):
        return []
    return sorted(a / b for a, b in zip(mine, theirs, strict=True))


def process_slowness(mine: dict[str, list[float]] | None, theirs: dict[str, list[float]] | None) -> float | None:
    """How much longer ``mine``'s engine process took than ``theirs`` for the same target forward (above 1: mine
    is the slower process): the median, over the request counts at which both ran at least
    ``MIN_MATCHED_STEPS`` undrafted decode steps, of the ratio of their median seconds (each a run's
    ``harness.steps.undrafted_forward_seconds``); None without such a request count."""
    if not mine or not theirs:
        return None
    ratios = [mine[n][0] / theirs[n][0] for n in mine
              if n in theirs and min(mine[n][1], theirs[n][1]) >= MIN_MATCHED_STEPS]
    return statistics.median(ratios) if ratios else None


def _undrafted_seconds(row: dict[str, Any], other: dict[str, Any], index: int) -> tuple[Any, Any]:
    """Round ``index``'s undrafted seconds of ``row`` and ``other`` to compare: the target model's own forward
    and logits where both runs timed them, else all of ``execute_model`` (runs recorded before the model's part
    was timed)."""
    for field in ("undrafted_model_seconds_runs", "undrafted_forward_seconds_runs"):
        mine, theirs = row.get(field) or [], other.get(field) or []
        if index < min(len(mine), len(theirs)) and mine[index] and theirs[index]:
            return mine[index], theirs[index]
    return None, None


def equal_speed_ratios(row: dict[str, Any], reference: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Per round, ``row``'s speed over ``reference``'s with their processes' speed difference taken out (the
    ratio times ``process_slowness`` of their target model's forwards on undrafted steps), and that slowness,
    each sorted; rounds without a matched request count are left out. Engine processes of one setup differ in
    speed by up to a third on the 2-core machines, so a ratio of two processes carries their difference; this
    is the part of it that is not the setups'."""
    mine, theirs = row.get(f"{MATRIX_SPEED}_runs") or [], reference.get(f"{MATRIX_SPEED}_runs") or []
    if len(mine) != len(theirs):
        return [], []
    adjusted, slowness = [], []
    for index, (speed, reference_speed) in enumerate(zip(mine, theirs, strict=True)):
        slower = process_slowness(*_undrafted_seconds(row, reference, index))
        if slower is not None and speed and reference_speed:
            adjusted.append(speed / reference_speed * slower)
            slowness.append(slower)
    return sorted(adjusted), sorted(slowness)


def _controller_share(row: dict[str, Any]) -> float | None:
    """The controller's own seconds over the timed call's engine-step seconds (first run)."""
    controller = row.get("controller") or {}
    steps, per_step = row.get("engine_steps"), row.get("step_seconds_per_step")
    if not controller.get("controller_seconds") or not steps or not per_step:
        return None
    return controller["controller_seconds"] / (steps * per_step)


def _cost_error(controller: dict[str, Any]) -> dict[str, float]:
    """Per part of a step (verify, draft levels, first pass, the drafting stage's host work), the seconds the cost model predicted for the
    steps it then observed over the seconds they took (1.0: no error; from the controller's counters)."""
    predicted = controller.get("cost_predicted_seconds") or {}
    observed = controller.get("cost_observed_seconds") or {}
    return {part: predicted[part] / observed[part] for part in predicted if observed.get(part)}


def vanilla_spread(rows: list[dict[str, Any]]) -> float:
    """Vanilla's fastest process over its slowest in a cell (1.0: identical processes)."""
    vanilla = next(row for row in rows if row["setup"] == VANILLA)
    low = vanilla[f"{MATRIX_SPEED}_min"]
    return vanilla[f"{MATRIX_SPEED}_max"] / low if low else 1.0


def batch1_over_classes(rows_by_cell: dict[str, list[dict[str, Any]]], prefix: str) -> dict[str, float]:
    """Each of the pair's setups' geometric-mean ratio to vanilla over the batch-1 cells of the classes apart
    (not ``mixed``), fastest first; empty when a setup lacks a cell."""
    cells_b1 = [rows for cell, rows in rows_by_cell.items() if cell.endswith("-b1") and not cell.startswith("mixed")]
    ratios: dict[str, list[float]] = {}
    for rows in cells_b1:
        for row in rows:
            if held_against(row["setup"], prefix) and row.get("speedup_vs_vanilla"):
                ratios.setdefault(row["setup"], []).append(row["speedup_vs_vanilla"])
    means = {name: statistics.geometric_mean(values) for name, values in ratios.items()
             if len(values) == len(cells_b1)}
    return dict(sorted(means.items(), key=lambda item: -item[1]))

