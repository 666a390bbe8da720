"""Rows as markdown tables and plots, and the result files a run writes under ``benchmarks/results/``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from benchmarks.harness.setups import RESULTS_DIR


def command_line(name: str, argv: list[str]) -> str:
    """The command that reran a benchmark: ``python -m benchmarks NAME ARGS``, each argument quoted for a shell."""
    return " ".join(["python -m benchmarks", name, shlex.join(argv)]).strip()


def fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _with_range(
    median: float | None, low: float | None, high: float | None, spec: str, unit: str = ""
) -> str:
    """``median [min–max]``; just the median when the range is missing."""
    if median is None:
        return "–"
    text = f"{format(median, spec)}{unit}"
    if low is not None and high is not None:
        text += f" [{format(low, spec)}–{format(high, spec)}]"
    return text


def ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else 1e3 * seconds, ".1f")


def identity_cell(row: dict[str, Any]) -> str:
    """ "yes", "near-tie (n prompts)", "FAILED" or "–" (no vanilla); flags repeats that disagree."""
    identity = row.get("identity")
    if identity is None:
        text = (
            "–"
            if row.get("outputs_identical_to_vanilla") is None
            else fmt(row["outputs_identical_to_vanilla"])
        )
    elif identity == "identical":
        text = "yes"
    elif identity == "near-tie":
        text = f"near-tie ({len({d['prompt'] for d in row['divergences']})})"
    else:
        text = "FAILED"
    if row.get("repeats_agree") is False:
        text += " (repeats differ)"
    return text


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| setup | method | k | batch | TP | decode tok/s | vs vanilla | mean acc. len | per-position acceptance "
        "| verify ms/step | draft ms/step | draft share | identical |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for r in rows:
        per_pos = " / ".join(f"{100 * a:.0f}%" for a in r["per_position_acceptance"] or []) or "–"
        share = None if r["drafting_share_of_decode"] is None else 100 * r["drafting_share_of_decode"]
        lines.append(
            f"| {r['setup']} | {r['method']} | {fmt(r['num_speculative_tokens'])} | {r['batch_size']} "
            f"| {r['tensor_parallel_size']} "
            f"| {_with_range(r['decode_tok_per_s'], r.get('decode_tok_per_s_min'), r.get('decode_tok_per_s_max'), '.1f')} "
            f"| {_with_range(r['speedup_vs_vanilla'], r.get('speedup_min'), r.get('speedup_max'), '.2f', 'x')} "
            f"| {fmt(r['mean_acceptance_length'])} | {per_pos} "
            f"| {ms(r.get('verify_seconds_per_step'))} | {ms(r['drafting_seconds_per_step'])} "
            f"| {fmt(share, '.0f')}{'%' if share is not None else ''} | {identity_cell(r)} |"
        )
    repeats = sorted({r.get("repeats") for r in rows if r.get("repeats")})
    if repeats:
        counts = "/".join(str(n) for n in repeats)
        lines.append(
            f"\nSpeeds: median [min–max] over {counts} engine processes per setup, run interleaved; ratios are "
            "median / vanilla's median, ranges min and max / vanilla's median. Per-step times are medians; "
            "verify = engine step - drafting."
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed_ax, accept_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["setup"] for r in rows]
    speedups = [r["speedup_vs_vanilla"] or 0.0 for r in rows]
    low = [max(s - (r.get("speedup_min") or s), 0.0) for s, r in zip(speedups, rows, strict=True)]
    high = [max((r.get("speedup_max") or s) - s, 0.0) for s, r in zip(speedups, rows, strict=True)]
    speed_ax.bar(
        names, speedups, yerr=[low, high], capsize=3,
        color=["#999999" if n.startswith("vanilla") else "#3b7dd8" for n in names],
    )  # fmt: skip
    speed_ax.axhline(1.0, color="black", linewidth=0.8)
    speed_ax.set_ylabel("decode tok/s ÷ vanilla (median, min–max)")
    speed_ax.tick_params(axis="x", rotation=30)
    for label in speed_ax.get_xticklabels():
        label.set_horizontalalignment("right")
    for row in rows:
        per_pos = list(row["per_position_acceptance"] or [])
        while per_pos and per_pos[-1] == 0 and len(per_pos) > 1:  # a tree's node slots past its deepest depth
            per_pos.pop()
        if per_pos:
            accept_ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=row["setup"])
    accept_ax.set_xlabel("draft position (tree depth)")
    accept_ax.xaxis.get_major_locator().set_params(integer=True)
    accept_ax.set_ylabel("acceptance rate (accepted / drafts)")
    accept_ax.set_ylim(0, 1)
    if accept_ax.lines:
        accept_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(
    rows: list[dict[str, Any]], stem: str, title: str, command: str, summary: str = ""
) -> dict[str, Path]:
    """Write ``stem``.json/.md/.png; ``summary`` (markdown) follows the table in the .md file."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    paths = {ext: RESULTS_DIR / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps({"title": title, "command": command, "rows": rows}, indent=2) + "\n")
    tail = f"\n{summary}\n" if summary else ""
    paths["md"].write_text(f"# {title}\n\nCommand: `{command}`\n\n{markdown_table(rows)}\n{tail}")
    plot(rows, paths["png"], title)
    return paths


def steps_by_drafts_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each row's decode steps by the draft tokens they verify (``steps.steps_by_drafts``)."""
    lines = ["| setup | drafts verified | steps | mean drafts | requests with drafts | verify ms (median) | "
             "forward ms | drafting stages producing them | drafting ms (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for name, entry in (row.get("decode_steps_by_drafts") or {}).items():
            lines.append(
                f"| {row['setup']} | {name} | {entry['steps']} | {entry['draft_tokens']:.1f} | "
                f"{entry['requests_with_drafts']:.1f} | {ms(entry['verify_seconds'])} | "
                f"{ms(entry['forward_seconds'])} | {entry['drafting_stages']} | {ms(entry['drafting_seconds'])} |")
    return "\n".join(lines)

