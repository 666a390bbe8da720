"""The speculation controller (``easyspec.tree.auto``) against every fixed setup, for each prompt class and
batch size, with both drafters of the default target, side by side in one run.

    python -m benchmarks.auto_matrix [--batches 1 2 4 8 16] [--classes chat heldout edit mixed]
        [--pairs eagle draft] [--max-tokens 32] [--rounds 2] [--min-prompts 4] [--repeats 2] [--only REGEX]
        [--stem auto_matrix]

Setups (``SETUPS``): vanilla; vLLM's ``eagle3`` chains with the committed head at k = 2 and 3, and k set by
batch size with vLLM's ``num_speculative_tokens_per_batch_size`` (``EAGLE_SCHEDULE``); the plugin's fixed
merged EAGLE-2 trees (4 and 8 head nodes + 4 prompt-lookup nodes); the 4-node one with the README's
``budget_by_batch`` table; the controller on a 16 + 4-node candidate (and, as ``eagle-auto-8`` and
``eagle-auto-4``, on the 8 + 4 and the 4 + 4 ones); and with SmolLM2-135M drafting across vocabularies: vLLM's
``draft_model`` chain at k = 1 (its fastest k), that chain by batch size (``DRAFT_SCHEDULE``), the bridged
tree of 4 root children + 4 lookup nodes, that tree with a table that stops speculating from batch 4, and the
controller on a 12 + 4-node candidate. A cell is one prompt class at one batch size: ``rounds x batch``
prompts (at least ``--min-prompts``) served ``batch`` at a time, a finished request replaced by the next
prompt, ``--max-tokens`` each. Every engine process times every cell in turn (``harness.run_matrix``); each
setup runs in ``--repeats`` interleaved processes; round r serves the classes in their order rotated by r.
With ``--side-by-side`` each round's engines are all started at once and take turns cell by cell, so the
setups' times of a cell are taken minutes apart at most (in 24 GiB four engines of one pair fit in bfloat16,
five came within 1 GiB of it, and in float32 three fit: choose the setups with ``--only``; a round that would
not fit stops before the engine that would not, naming this).

The report gives the controller's ratio to vanilla and to the best fixed setup by round, and again at equal
process speed (``equal_speed_ratios``: each round's ratio times how much longer the controller's process took
for the same target model forward on undrafted steps), the split a missed goal is read by.

Results: ``benchmarks/results/{stem}.{json,md}``, ``{stem}_speed.png`` (speed against batch per class),
``{stem}_calibration.png`` (the controller's predicted against observed acceptance, by bin) and
``{stem}_cost.png`` (the verify and draft-level cost curves it measured). Finished runs are kept in
``benchmarks/results/logs/{stem}.runs.jsonl``: the same command resumes an interrupted matrix.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
from itertools import cycle, islice
from pathlib import Path
from typing import Any

from benchmarks.eagle_bench import EAGLE_TREES, HEAD3, QWEN, SMOL, _prompts
from benchmarks.harness import (
    MATRIX_SPEED,
    RESULTS_DIR,
    VANILLA,
    Cell,
    Setup,
    Workload,
    cpu_native_dtype,
    run_matrix,
    select_setups,
    steps_by_drafts_table,
)
from vllm_easyspec.models import fetch_model

CLASSES = ("chat", "heldout", "edit", "mixed")
# undrafted decode steps each of two runs needs at one request count before their forwards are compared
MIN_MATCHED_STEPS = 3
BATCHES = (1, 2, 4, 8, 16)
LOOKUP = {"prompt_lookup": {"nodes": 4}}
# The README's table for the merged EAGLE tree: the whole tree alone, a k=2 chain from 2 requests, none from 5.
EAGLE_TABLE = {"2": {"chain": 2}, "5": 0}
# The README's advice for a draft model ("no speculation at batch 8"), as a table: the tree below 4 requests.
DRAFT_TABLE = {"4": 0}
# vLLM's own batch-size schedule for chains (num_speculative_tokens_per_batch_size: inclusive ranges -> k),
# set as the tables above: the head's k=3 chain alone, k=2 from 2 requests, none from 5; the draft model's
# k=1 chain below 4 requests.
EAGLE_SCHEDULE = [[1, 1, 3], [2, 4, 2], [5, 1024, 0]]
DRAFT_SCHEDULE = [[1, 3, 1], [4, 1024, 0]]
BRIDGED_TREE = {"choices": [[0], [1], [2], [3]], "sources": LOOKUP, "retokenize": True}
DRAFT_AUTO_TREE = {"top_k": 4, "depth": 3, "budget": 12, "sources": LOOKUP, "retokenize": True, "auto": True}
# vLLM's prompt-lookup chain needs no draft: a fixed setup every pair's controller is held against
MODEL_FREE = "ngram"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def setups(pairs: list[str]) -> list[Setup]:
    """Vanilla, vLLM's ngram chain, then each pair's fixed setups, its ``budget_by_batch`` table and its
    controller."""
    chosen = [Setup(VANILLA, "no speculation"),
              Setup(f"{MODEL_FREE}-k4", "vLLM ngram (prompt lookup) chain, k=4, n-grams of 2 to 4", NGRAM)]
    if "eagle" in pairs:
        head = {"method": "eagle3", "model": str(HEAD3)}
        tree4 = EAGLE_TREES[4] | {"sources": LOOKUP}
        chosen += [
            Setup("eagle3-k2", "vLLM eagle3 chain, k=2", head | {"num_speculative_tokens": 2}),
            Setup("eagle3-k3", "vLLM eagle3 chain, k=3", head | {"num_speculative_tokens": 3}),
            Setup("eagle3-schedule", f"vLLM eagle3 chain, num_speculative_tokens_per_batch_size {EAGLE_SCHEDULE}",
                  head | {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": EAGLE_SCHEDULE}),
            Setup("eagle-tree-4+4", "EAGLE-2 tree, 4 head + 4 lookup nodes", head, {"easyspec": {"tree": tree4}}),
            Setup("eagle-tree-8+4", "EAGLE-2 tree, 8 head + 4 lookup nodes", head,
                  {"easyspec": {"tree": EAGLE_TREES[8] | {"sources": LOOKUP}}}),
            Setup("eagle-table", f"the 4 + 4 tree with budget_by_batch {json.dumps(EAGLE_TABLE)}", head,
                  {"easyspec": {"tree": tree4 | {"budget_by_batch": EAGLE_TABLE}}}),
            Setup("eagle-auto", "controller (auto) on a 16 + 4-node EAGLE-2 candidate", head,
                  {"easyspec": {"tree": EAGLE_TREES[16] | {"sources": LOOKUP, "auto": True}}}),
            Setup("eagle-auto-8", "controller (auto) on an 8 + 4-node EAGLE-2 candidate", head,
                  {"easyspec": {"tree": EAGLE_TREES[8] | {"sources": LOOKUP, "auto": True}}}),
            Setup("eagle-auto-4", "controller (auto) on the 4 + 4-node EAGLE-2 candidate (the table's tree)", head,
                  {"easyspec": {"tree": tree4 | {"auto": True}}}),
        ]
    if "draft" in pairs:
        draft = {"method": "draft_model", "model": str(fetch_model(SMOL)), "use_heterogeneous_vocab": True}
        chosen += [
            Setup("smol-k1", "vLLM draft_model chain, SmolLM2-135M, k=1", draft | {"num_speculative_tokens": 1}),
            Setup("smol-schedule", f"vLLM draft_model chain, num_speculative_tokens_per_batch_size {DRAFT_SCHEDULE}",
                  draft | {"num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": DRAFT_SCHEDULE}),
            Setup("smol-tree-4+4", "bridged tree, 4 root children + 4 lookup nodes", draft | {"num_speculative_tokens": 8},
                  {"easyspec": {"tree": BRIDGED_TREE}}),
            Setup("smol-table", f"the bridged tree with budget_by_batch {json.dumps(DRAFT_TABLE)}",
                  draft | {"num_speculative_tokens": 8},
                  {"easyspec": {"tree": BRIDGED_TREE | {"budget_by_batch": DRAFT_TABLE}}}),
            Setup("smol-auto", "controller (auto) on a 12 + 4-node bridged candidate",
                  draft | {"num_speculative_tokens": 16}, {"easyspec": {"tree": DRAFT_AUTO_TREE}}),
        ]
    return chosen


def cells(classes: list[str], batches: list[int], max_tokens: int, rounds: int = 2, ragged: bool = False,
          min_prompts: int = 4) -> list[Cell]:
    """Every class at every batch size: ``rounds x batch`` prompts (at least ``min_prompts``), the class's prompts
    repeated in order when it has fewer. With ``ragged``, each prompt's output length is drawn uniformly from
    ``max_tokens / 2`` to ``3 max_tokens / 2`` (:func:`ragged_lengths`: the same draw for every setup)."""
    out = []
    for prompt_class in classes:
        pool = _prompts(prompt_class, 48)
        for batch in batches:
            count = max(rounds * batch, min_prompts)
            name = f"{prompt_class}-b{batch}"
            lengths = ragged_lengths(name, count, max_tokens) if ragged else None
            out.append(Cell(name, list(islice(cycle(pool), count)), batch, max_tokens, lengths, prompt_class))
    return out


def ragged_lengths(cell_name: str, count: int, mean: int) -> list[int]:
    """``count`` output lengths uniform in ``[mean / 2, 3 mean / 2]``, seeded by the cell's name. Requests that
    end on different steps, as a server's do, so that no setup's requests all finish on one step and have the
    next wave's prompts prefilled in one step (equal lengths give vanilla that alignment; speculation breaks it)."""
    draw = random.Random(cell_name)
    return [draw.randint(max(mean // 2, 1), mean + mean // 2) for _ in range(count)]


SIDE_BY_SIDE_KV_CACHE_GIB = 1  # per engine when a round's engines are resident at once (16 requests need ~0.1 GiB)
PAIR_OF = {"eagle": "EAGLE-3 head", "smol": "SmolLM2-135M draft"}
VANILLA_SPREAD_WARNING = 1.10  # vanilla's processes differing more than this flag a machine whose speed drifted


def pair_of(name: str) -> str | None:
    return next((label for prefix, label in PAIR_OF.items() if name.startswith(prefix)), None)


def held_against(name: str, prefix: str) -> bool:
    """Whether setup ``name`` is one of the pair's (``prefix``) or a model-free one, which every pair is held
    against."""
    return name.startswith((prefix, MODEL_FREE))


def is_controller(name: str) -> bool:
    """Whether setup ``name`` runs the controller: ``{pair}-auto``, or ``{pair}-auto-{candidate}``."""
    return name.endswith("-auto") or "-auto-" in name


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
    ``harness.undrafted_forward_seconds``); None without such a request count."""
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


def _paired(ratios: list[float]) -> str:
    """``median [min–max]`` of per-round ratios; – without them."""
    if not ratios:
        return "–"
    return f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}–{ratios[-1]:.2f}]"


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


def _ratio(row: dict[str, Any] | None) -> str:
    if row is None or row.get("speedup_vs_vanilla") is None:
        return "–"
    return f"{row['speedup_vs_vanilla']:.2f} [{row['speedup_min']:.2f}–{row['speedup_max']:.2f}]"


def markdown(rows_by_cell: dict[str, list[dict[str, Any]]], names: list[str]) -> str:
    """One table of speed ratios (setups as columns), one of the controller against the best fixed setup."""
    header = "| cell | vanilla tok/s [min–max] | " + " | ".join(n for n in names if n != VANILLA) + " |"
    lines = [header, "|" + "---|" * (len(names) + 1)]
    for cell, rows in rows_by_cell.items():
        by_name = {row["setup"]: row for row in rows}
        vanilla = by_name[VANILLA]
        lines.append(
            f"| {cell} | {vanilla[MATRIX_SPEED]:.1f} [{vanilla[f'{MATRIX_SPEED}_min']:.1f}–"
            f"{vanilla[f'{MATRIX_SPEED}_max']:.1f}] | "
            + " | ".join(_ratio(by_name.get(n)) for n in names if n != VANILLA) + " |"
        )
    lines += ["", "| cell | pair | best fixed | its ratio | auto vs vanilla | auto vs best fixed | "
              "by round: auto / vanilla, auto / best fixed | "
              "by round at equal process speed: auto / vanilla, auto / best fixed (auto's process time / best fixed's; "
              "rounds with undrafted steps to compare) | "
              "steps: best fixed / auto | "
              "predicted / realised accepted per step | nodes per request-step | controller share "
              "| cost model predicted / observed: verify, levels, first pass, host work |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell, rows in rows_by_cell.items():
        summary = cell_summary(rows)
        for prefix, label in PAIR_OF.items():
            s = summary.get(prefix)
            if s is None:
                continue
            low, high = s["auto_vs_best_fixed_range"]
            predicted, realised = s["predicted_accepted_per_step"], s["realised_accepted_per_step"]
            lines.append(
                f"| {cell} | {label}{_controller_named(s, prefix)} | {s['best_fixed']} | {s['best_fixed_vs_vanilla']:.2f} "
                f"| {s['auto_vs_vanilla']:.2f} | {s['auto_vs_best_fixed']:.2f} [{low:.2f}–{high:.2f}] "
                f"| {_paired(s['auto_vs_vanilla_by_round'])}, {_paired(s['auto_vs_best_fixed_by_round'])} "
                f"| {_paired(s['auto_vs_vanilla_equal_speed_by_round'])}, "
                f"{_paired(s['auto_vs_best_fixed_equal_speed_by_round'])} "
                f"({_paired(s['process_slowness_auto_over_best_fixed_by_round'])}; rounds compared "
                f"{len(s['auto_vs_vanilla_equal_speed_by_round'])}, "
                f"{len(s['auto_vs_best_fixed_equal_speed_by_round'])} of {len(s['auto_vs_vanilla_by_round'])}) "
                f"| {_num(s.get('steps_best_fixed_over_auto'))} "
                f"| {_num(predicted)} / {_num(realised)} | {_num(s['nodes_per_request_step'])} "
                f"| {_pct(s['controller_share_of_step'])} "
                f"| {', '.join(_num(s['cost_predicted_over_observed'].get(p)) for p in ('verify', 'draft', 'first_pass', 'overhead'))} |"
            )
    return "\n".join(lines)


def _controller_named(summary: dict[str, Any], prefix: str) -> str:
    """`` (its setup)`` when the pair's controller row is not ``{prefix}-auto``."""
    return "" if summary["controller"] == f"{prefix}-auto" else f" ({summary['controller']})"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def goals(rows_by_cell: dict[str, list[dict[str, Any]]]) -> str:
    """The issue's goals per pair: cells where auto's median is below vanilla's spread, or below 0.97x the
    best fixed setup."""
    lines = []
    for prefix, label in PAIR_OF.items():
        below_vanilla, below_best, cells_seen = [], [], 0
        paired_below_vanilla, paired_below_best, paired_cells = [], [], 0
        for cell, rows in rows_by_cell.items():
            s = cell_summary(rows).get(prefix)
            if s is None:
                continue
            cells_seen += 1
            vanilla = next(row for row in rows if row["setup"] == VANILLA)
            vanilla_low = vanilla["speedup_min"]
            if s["auto_vs_vanilla"] < min(1.0, vanilla_low):
                below_vanilla.append(f"{cell} ({s['auto_vs_vanilla']:.2f})")
            if s["auto_vs_best_fixed"] < 0.97:
                below_best.append(f"{cell} ({s['auto_vs_best_fixed']:.2f} of {s['best_fixed']})")
            by_vanilla, by_best = s["auto_vs_vanilla_by_round"], s["auto_vs_best_fixed_by_round"]
            if by_vanilla and by_best:
                paired_cells += 1
                if by_vanilla[-1] < 1.0:  # slower than vanilla in every round
                    paired_below_vanilla.append(
                        f"{cell} ({statistics.median(by_vanilla):.2f}"
                        f"{_at_equal_speed(s['auto_vs_vanilla_equal_speed_by_round'], len(by_vanilla))})")
                if statistics.median(by_best) < 0.97:
                    paired_below_best.append(
                        f"{cell} ({statistics.median(by_best):.2f} of {s['best_fixed']}"
                        f"{_at_equal_speed(s['auto_vs_best_fixed_equal_speed_by_round'], len(by_best), s['process_slowness_auto_over_best_fixed_by_round'])})")
        if cells_seen:
            lines.append(f"- {label}: {cells_seen} cells; auto below vanilla's spread in "
                         f"{len(below_vanilla)}: {', '.join(below_vanilla) or 'none'}; below 0.97x the best fixed "
                         f"setup in {len(below_best)}: {', '.join(below_best) or 'none'}")
            if paired_cells:
                lines.append(f"  - by round (each round's auto over the other setup's in the same round): slower than "
                             f"vanilla in every round in {len(paired_below_vanilla)}: "
                             f"{', '.join(paired_below_vanilla) or 'none'}; median below 0.97x the best fixed "
                             f"setup in {len(paired_below_best)}: {', '.join(paired_below_best) or 'none'}")
            one_config = batch1_over_classes(rows_by_cell, prefix)
            if one_config:
                lines.append("  - batch 1, geometric mean over the classes apart (one configuration for all): "
                             + ", ".join(f"{name} {ratio:.2f}" for name, ratio in one_config.items()))
            mixed = [f"{cell}: {s[prefix]['auto_vs_best_fixed']:.2f} of {s[prefix]['best_fixed']}"
                     for cell, s in ((c, cell_summary(r)) for c, r in rows_by_cell.items())
                     if cell.startswith("mixed-") and prefix in s]
            if mixed:
                lines.append("  - mixed cells, auto against the best uniform setting (goal >= 1.05): " + ", ".join(mixed))
    drifted = [f"{cell} ({vanilla_spread(rows):.2f}x)" for cell, rows in rows_by_cell.items()
               if vanilla_spread(rows) > VANILLA_SPREAD_WARNING]
    if drifted:
        lines.append(f"- vanilla's fastest process ran more than {VANILLA_SPREAD_WARNING:.2f}x its slowest in "
                     f"{', '.join(drifted)}: the machine's speed changed during the run, and these cells' ratios "
                     "carry that; re-run them with more --repeats")
    return "\n".join(lines)


def _at_equal_speed(adjusted: list[float], rounds: int, slowness: list[float] | None = None) -> str:
    """A goal's split: ``; X at equal process speed in N of M rounds`` (and, given ``slowness``, how much
    longer auto's process took for the same forward), or nothing without a comparable round."""
    if not adjusted:
        return ""
    split = f"; {statistics.median(adjusted):.2f} at equal process speed in {len(adjusted)} of {rounds} rounds"
    if slowness:
        split += f", auto's process took {statistics.median(slowness):.2f}x the other's time for the same forward"
    return split


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


def plot_speed(rows_by_cell: dict[str, list[dict[str, Any]]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = sorted({cell.rsplit("-b", 1)[0] for cell in rows_by_cell}, key=lambda c: CLASSES.index(c))
    pairs = [p for p in PAIR_OF if any(n.startswith(p) for n in names)]
    fig, axes = plt.subplots(len(pairs), len(classes), figsize=(4 * len(classes), 3.6 * len(pairs)),
                             squeeze=False, sharey="row")
    for i, prefix in enumerate(pairs):
        for j, prompt_class in enumerate(classes):
            ax = axes[i][j]
            cells_here = [c for c in rows_by_cell if c.rsplit("-b", 1)[0] == prompt_class]
            batches = [int(c.rsplit("-b", 1)[1]) for c in cells_here]
            for name in [n for n in names if n.startswith(prefix)]:
                ratios = [next((r["speedup_vs_vanilla"] for r in rows_by_cell[c] if r["setup"] == name), None)
                          for c in cells_here]
                style = {"linewidth": 2.5, "color": "black"} if is_controller(name) else {"alpha": 0.8}
                ax.plot(batches, ratios, marker="o", label=name, **style)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_title(f"{PAIR_OF[prefix]}, {prompt_class}", fontsize=9)
            ax.set_xlabel("batch (requests in flight)")
            if j == 0:
                ax.set_ylabel("tok/s ÷ vanilla (median)")
            if j == len(classes) - 1:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _auto_states(raw_rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per controller setup, its first run's controller state after the last cell (cumulative tables)."""
    last_cell = list(raw_rows)[-1]
    return {row["setup"]: row["controller"] for row in raw_rows[last_cell]
            if is_controller(row["setup"]) and row.get("controller")}


def plot_calibration(states: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, table, title in ((axes[0], "calibration_path", "P(accepted) of every offered node"),
                             (axes[1], "calibration_conditional", "P(accepted | parent accepted)")):
        for name, state in states.items():
            bins = state.get(table) or []
            ax.plot([b["predicted"] for b in bins], [b["observed"] for b in bins], marker="o", label=name)
            for b in bins:
                ax.annotate(str(b["nodes"]), (b["predicted"], b["observed"]), fontsize=6)
        ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--")
        ax.set_xlabel("predicted (mean of the bin)")
        ax.set_ylabel("observed")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_cost(states: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for name, state in states.items():
        verify, level = state["verify_curve"], state["draft_level_curve"]
        axes[0].plot(verify["rows"], [1e3 * s * verify["scale"] for s in verify["seconds"]], marker="o",
                     label=f"{name}: scale {verify['scale']:.2f},\n+{1e3 * verify['extra_per_masked_row']:.2f} "
                           f"ms per masked row, +{1e3 * verify.get('extra_per_masked_request', 0.0):.2f} ms "
                           f"per masked tree,\n+{1e3 * verify.get('extra_per_speculating_row', 0.0):.2f} ms per "
                           "row of a step with nodes")
        axes[1].plot(level["rows"], [1e3 * s * level["scale"] for s in level["seconds"]], marker="o",
                     label=f"{name} (scale {level['scale']:.2f})")
    axes[0].set_title("target verify: start-up curve x current scale", fontsize=9)
    axes[1].set_title("one draft level", fontsize=9)
    for ax in axes:
        ax.set_xlabel("rows in the forward")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    parser.add_argument("--pairs", nargs="+", default=["eagle", "draft"], choices=("eagle", "draft"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ragged", action="store_true",
                        help="each request's output length uniform in [max_tokens / 2, 3 max_tokens / 2], so "
                             "requests end on different steps as a server's do")
    parser.add_argument("--rounds", type=int, default=2,
                        help="prompts per cell: rounds x batch (at least --min-prompts)")
    parser.add_argument("--min-prompts", type=int, default=4,
                        help="the fewest prompts of a cell (raise it to lengthen the batch-1 and batch-2 cells)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--side-by-side", action="store_true",
                        help="each round's engines resident together, taking turns cell by cell")
    parser.add_argument("--only", default=None, help="only the setups whose name matches this regex (and vanilla)")
    parser.add_argument("--stem", default="auto_matrix")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: bfloat16 where the CPU computes it natively (AVX-512 BF16, AMX), else float32")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or cpu_native_dtype()
    command = "python -m benchmarks.auto_matrix " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    chosen = select_setups(setups(args.pairs), args.only)
    names = [s.name for s in chosen]
    matrix = cells(args.classes, args.batches, args.max_tokens, args.rounds, args.ragged, args.min_prompts)
    workload = Workload(target=str(fetch_model(QWEN)), prompts=[], batch_size=max(args.batches), dtype=args.dtype,
                        kv_cache_gib=SIDE_BY_SIDE_KV_CACHE_GIB if args.side_by_side else Workload.kv_cache_gib)
    runs_file = RESULTS_DIR / "logs" / f"{args.stem}.runs.jsonl"
    runs_file.parent.mkdir(parents=True, exist_ok=True)
    rows_by_cell = run_matrix(chosen, workload, matrix, repeats=args.repeats, runs_file=runs_file,
                              side_by_side=args.side_by_side)
    states = _auto_states(rows_by_cell)
    table = markdown(rows_by_cell, names)
    described = ", ".join(f"`{s.name}`: {s.description}" for s in chosen)
    lengths = (f"{args.max_tokens // 2} to {args.max_tokens * 3 // 2} tokens each (uniform, the same draw for "
               f"every setup)" if args.ragged else f"{args.max_tokens} tokens each")
    spread_over = ("rounds, each a process whose engines took turns cell by cell" if args.side_by_side
                   else "interleaved engine processes")
    md = (f"# The controller against fixed setups, by prompt class and batch\n\nCommand: `{command}`\n\n"
          f"Setups: {described}.\n\nCells: {args.rounds} x batch prompts (at least {args.min_prompts}) served "
          f"batch at a time, {lengths}, {args.dtype}, greedy. Ratios: median throughput (output tokens / "
          f"wall time of the cell, prefills included) / vanilla's median "
          f"[min–max over {args.repeats} {spread_over}].\n\n{table}\n\n"
          f"Goals (auto >= vanilla beyond the spread, >= 0.97x the best fixed setup of its pair):\n\n"
          f"{goals(rows_by_cell)}\n")
    stem = RESULTS_DIR / args.stem
    Path(f"{stem}.md").write_text(md)
    Path(f"{stem}.json").write_text(json.dumps(
        {"command": command,
         "cells": {c.name: {"batch": c.batch_size, "prompts": len(c.prompts), "lengths": c.lengths} for c in matrix},
         "summary": {cell: cell_summary(rows) for cell, rows in rows_by_cell.items()},
         "rows": rows_by_cell}, indent=1) + "\n")
    Path(f"{stem}_steps.md").write_text(
        f"# Decode steps by the draft tokens they verify\n\nCommand: `{command}`\n\nEach setup's first "
        "round; verify = the step less its drafting stage; a drafting stage is counted under the drafts it "
        "produced (those the next step verifies).\n\n"
        + "\n\n".join(f"## {cell}\n\n{steps_by_drafts_table(rows)}" for cell, rows in rows_by_cell.items()) + "\n")
    plot_speed(rows_by_cell, names, Path(f"{stem}_speed.png"))
    if states:
        plot_calibration(states, Path(f"{stem}_calibration.png"))
        plot_cost(states, Path(f"{stem}_cost.png"))
    print(md)
    medians = [s[p]["auto_vs_vanilla"] for s in (cell_summary(r) for r in rows_by_cell.values())
               for p in PAIR_OF if p in s]
    if medians:
        print(f"auto vs vanilla over all cells: median {statistics.median(medians):.2f}, min {min(medians):.2f}")


if __name__ == "__main__":
    main()
