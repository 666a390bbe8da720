"""The matrix's report: the ratio tables, the goals it is read by, and its plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness.setups import MATRIX_SPEED, VANILLA
from benchmarks.matrix.setups import CLASSES, PAIR_OF, is_controller
from benchmarks.matrix.summary import (
    VANILLA_SPREAD_WARNING,
    batch1_over_classes,
    cell_summary,
    vanilla_spread,
)


def _paired(ratios: list[float]) -> str:
    """``median [min–max]`` of per-round ratios; – without them."""
    if not ratios:
        return "–"
    return f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}–{ratios[-1]:.2f}]"


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


def auto_states(raw_rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
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

