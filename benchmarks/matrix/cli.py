"""``python -m benchmarks matrix [controller-cost | moe-cost]``: the controller matrix (``benchmarks.matrix``),
or one of the two studies beside it."""

from __future__ import annotations

import argparse
import json
import statistics
from importlib import import_module
from pathlib import Path

import benchmarks.matrix
from benchmarks.defaults import QWEN
from benchmarks.harness.processes import run_matrix
from benchmarks.harness.report import command_line, steps_by_drafts_table
from benchmarks.harness.setups import RESULTS_DIR, Workload, cpu_native_dtype, select_setups
from benchmarks.matrix.report import auto_states, goals, markdown, plot_calibration, plot_cost, plot_speed
from benchmarks.matrix.setups import BATCHES, CLASSES, PAIR_OF, SIDE_BY_SIDE_KV_CACHE_GIB, cells, setups
from benchmarks.matrix.summary import cell_summary
from vllm_easyspec.models import fetch_model

PARTS = {"controller-cost": "benchmarks.matrix.controller_cost", "moe-cost": "benchmarks.matrix.moe_cost"}


def main(argv: list[str], prog: str = "python -m benchmarks matrix") -> int | None:
    """The matrix with the flags ``argv``; a first argument naming one of ``PARTS`` runs that study instead."""
    if argv and argv[0] in PARTS:
        return import_module(PARTS[argv[0]]).main(argv[1:], prog=f"{prog} {argv[0]}")
    parser = argparse.ArgumentParser(prog=prog, description=benchmarks.matrix.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    command = command_line("matrix", argv)
    chosen = select_setups(setups(args.pairs), args.only)
    names = [s.name for s in chosen]
    matrix = cells(args.classes, args.batches, args.max_tokens, args.rounds, args.ragged, args.min_prompts)
    workload = Workload(target=str(fetch_model(QWEN)), prompts=[], batch_size=max(args.batches), dtype=args.dtype,
                        kv_cache_gib=SIDE_BY_SIDE_KV_CACHE_GIB if args.side_by_side else Workload.kv_cache_gib)
    runs_file = RESULTS_DIR / "logs" / f"{args.stem}.runs.jsonl"
    runs_file.parent.mkdir(parents=True, exist_ok=True)
    rows_by_cell = run_matrix(chosen, workload, matrix, repeats=args.repeats, runs_file=runs_file,
                              side_by_side=args.side_by_side)
    states = auto_states(rows_by_cell)
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
