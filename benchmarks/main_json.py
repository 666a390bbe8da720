"""``python -m benchmarks main --json``: the main job's setups on its prompts asking for a JSON answer (vLLM
structured output with ``JSON_SCHEMA``, the prompt extended by ``JSON_REQUEST``), and at batch 1, unless
``--no-plain``, the same prompts without it in the same engine processes. Issue 62's goal: the plugin's speedup
on JSON requests at batch 1 at least ``GOAL`` of its speedup on the same prompts without one.

Invariants:
- One harness run per batch size (``run_matrix``, interleaved engine processes, no two engines at once), each
  serving max(--num-prompts, batch) prompts; at batch 1 each setup's process times the ``json`` cell and the
  ``plain`` cell in turn, the order rotated by round, each after a warm-up request with the cell's own
  structured output (so the schema's grammar is compiled before timing). Speeds are decode tok/s as the main
  job reports them: median [min–max] over the processes.
- Each cell's vanilla tokens are that cell's lossless reference, prompt by prompt, as in the main job.
- The goal's ratio is (setup's JSON speedup) / (its plain speedup), of medians; the spread beside it is the
  same ratio round by round, both cells of a round having run in one process.
- Writes ``benchmarks/results/STEM.{json,md}`` (default ``main_job_json``; no plot).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from typing import Any

from benchmarks.harness.processes import run_matrix
from benchmarks.harness.report import fmt, markdown_table
from benchmarks.harness.setups import RESULTS_DIR, VANILLA, Cell, Setup, Workload, load_prompts

# One schema for the main job's chat, code and math prompts: a short title, a few key points, the answer.
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "key_points": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "answer": {"type": "string"},
    },
    "required": ["title", "key_points", "answer"],
    "additionalProperties": False,
}
JSON_REQUEST = (
    '\n\nReply with a JSON object only: "title" (a few words), "key_points" (one to five short strings) and '
    '"answer" (the full answer as one string).'
)
JSON_STEM = "main_job_json"
GOAL = 0.9  # JSON speedup / plain speedup at batch 1


def json_cells(prompts: list[str], batch_size: int, max_tokens: int, plain: bool = True) -> list[Cell]:
    """The ``json-bB`` cell (the prompts with ``JSON_REQUEST``, every request constrained to ``JSON_SCHEMA``)
    and, with ``plain``, the ``plain-bB`` cell of the same prompts as the main job serves them."""
    cells = [Cell(f"json-b{batch_size}", [p + JSON_REQUEST for p in prompts], batch_size, max_tokens,
                  group="json", structured_outputs={"json": JSON_SCHEMA})]
    if plain:
        cells.append(Cell(f"plain-b{batch_size}", list(prompts), batch_size, max_tokens, group="plain"))
    return cells


def _speedups_by_round(rows: list[dict[str, Any]], name: str) -> list[float]:
    """``name``'s decode tok/s over vanilla's, round by round (runs are kept in round order)."""
    by_name = {row["setup"]: row for row in rows}
    ours, theirs = by_name[name]["decode_tok_per_s_runs"], by_name[VANILLA]["decode_tok_per_s_runs"]
    return [a / b for a, b in zip(ours, theirs, strict=True)]


def goal_summary(rows_by_cell: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per speculative setup: its speedup on JSON and on plain requests and their ratio (medians), with the
    ratio round by round, at the batch of the plain cell; {} without one."""
    plain_cell = next((c for c in rows_by_cell if c.startswith("plain")), None)
    json_cell = None if plain_cell is None else plain_cell.replace("plain", "json", 1)
    if json_cell not in rows_by_cell:
        return {}
    plain_rows = {row["setup"]: row for row in rows_by_cell[plain_cell]}
    summary = {}
    for row in rows_by_cell[json_cell]:
        name = row["setup"]
        if name == VANILLA or name not in plain_rows:
            continue
        json_speedup, plain_speedup = row["speedup_vs_vanilla"], plain_rows[name]["speedup_vs_vanilla"]
        by_round = [j / p for j, p in zip(_speedups_by_round(rows_by_cell[json_cell], name),
                                          _speedups_by_round(rows_by_cell[plain_cell], name), strict=True)]
        summary[name] = {
            "json_speedup": json_speedup, "plain_speedup": plain_speedup,
            "ratio": json_speedup / plain_speedup, "ratio_by_round": by_round,
            "json_mean_acceptance_length": row["mean_acceptance_length"],
            "plain_mean_acceptance_length": plain_rows[name]["mean_acceptance_length"],
            "goal_met": json_speedup / plain_speedup >= GOAL,
        }  # fmt: skip
    return summary


def goal_table(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown: each setup's JSON and plain speedups, their ratio against ``GOAL``, and its acceptance."""
    lines = [f"| setup | JSON speedup | plain speedup | JSON / plain (by round) | >= {GOAL} | MAL JSON / plain |",
             "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        rounds = s["ratio_by_round"]
        lines.append(
            f"| {name} | {s['json_speedup']:.2f}x | {s['plain_speedup']:.2f}x | {s['ratio']:.2f} "
            f"({statistics.median(rounds):.2f} [{min(rounds):.2f}–{max(rounds):.2f}]) | "
            f"{'yes' if s['goal_met'] else 'no'} | {fmt(s['json_mean_acceptance_length'])} / "
            f"{fmt(s['plain_mean_acceptance_length'])} |")
    return "\n".join(lines)


def run_json(setups: list[Setup], workload: Workload, batches: list[int], repeats: int, stem: str, title: str,
             command: str, plain: bool = True) -> int:
    """One harness run per batch size: the JSON cell (and at batch 1 the plain one) on every setup; one report.
    Returns 1 when a lossless check fails."""
    rows_by_cell: dict[str, list[dict[str, Any]]] = {}
    prompt_counts: dict[str, int] = {}
    for batch in batches:
        prompts = load_prompts(max(len(workload.prompts), batch))
        cells = json_cells(prompts, batch, workload.max_tokens, plain and batch == 1)
        run = replace(workload, prompts=prompts, batch_size=batch)
        prompt_counts |= {cell.name: len(cell.prompts) for cell in cells}
        rows_by_cell |= run_matrix(setups, run, cells, repeats=repeats, speed="decode_tok_per_s")
    summary = goal_summary(rows_by_cell)
    sections = [f"## {cell}: {prompt_counts[cell]} prompts\n\n{markdown_table(rows)}"
                for cell, rows in rows_by_cell.items()]
    goal = (f"## The goal: JSON speedup at least {GOAL} of the plain speedup (batch 1)\n\n"
            f"{goal_table(summary)}\n\nRatios are of medians; in brackets the same ratio round by round (both "
            "cells of a round ran in one engine process)." if summary else "")
    md = (f"# {title}\n\nCommand: `{command}`\n\nJSON requests: the prompt followed by `{JSON_REQUEST.strip()}`, "
          f"every request constrained to the schema `{json.dumps(JSON_SCHEMA)}` (vLLM structured output, its "
          "default backend). Plain: the same prompts as the main job serves them.\n\n"
          + "\n\n".join(sections + ([goal] if goal else [])) + "\n")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{stem}.md").write_text(md)
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(
        {"title": title, "command": command, "schema": JSON_SCHEMA, "json_request": JSON_REQUEST,
         "summary": summary, "rows": rows_by_cell}, indent=1) + "\n")
    print(f"\n{md}\nresults: {RESULTS_DIR / stem}.md, .json")
    failed = [f"{cell}: {row['setup']}" for cell, rows in rows_by_cell.items() for row in rows
              if row["identity"] == "FAILED"]
    if failed:
        print(f"LOSSLESS CHECK FAILED for: {', '.join(failed)} (see the lines above)", file=sys.stderr)
        return 1
    return 0
